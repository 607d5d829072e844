"""The lab's only door to the merge engine: every merge goes through `merge_checkpoints` → `rlmerge.merge`.

The lab never implements a merge method itself. It knows which methods to try, with which small
hyperparameter grid (chosen on a validation split), and skips, with a visible reason, any method the
installed engine does not register.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MethodPlan:
    """One row of the results table: an engine method and the grid searched on validation."""

    label: str  # row name in the table, e.g. "RAM+ (paper)"
    method: str  # engine name, e.g. "ram+"
    grid: Mapping[str, Sequence[Any]] = field(default_factory=dict)  # empty: one fixed merge
    needs_fisher: bool = False  # the pipeline estimates each agent's diagonal Fisher first (side inputs)

    def candidates(self) -> list[dict[str, Any]]:
        keys = sorted(self.grid)
        return [dict(zip(keys, values, strict=True)) for values in itertools.product(*(self.grid[k] for k in keys))]


# Grids are small on purpose: 2-4 points per baseline, as the paper's own tuning. RAM / RAM+ use the
# paper's fixed defaults (no tuning), which is how the paper reports them.
METHOD_PLANS: tuple[MethodPlan, ...] = (
    MethodPlan("Average", "linear"),
    MethodPlan("Task arithmetic", "task_arithmetic", {"scaling": [0.3, 0.5, 1.0]}),
    MethodPlan("TIES", "ties", {"density": [0.2, 0.5], "scaling": [0.5, 1.0]}),
    MethodPlan("DARE+TA", "dare_ta", {"density": [0.3, 0.7], "scaling": [0.5, 1.0]}),
    MethodPlan("DARE+TIES", "dare_ties", {"density": [0.3, 0.7], "scaling": [0.5, 1.0]}),
    MethodPlan("Fisher", "fisher", needs_fisher=True),
    MethodPlan("RAM", "ram"),
    MethodPlan("RAM+ (paper)", "ram+", {"preset": ["paper"]}),
    MethodPlan("RAM+ (paper-soft)", "ram+", {"preset": ["paper-soft"]}),
    MethodPlan("RAM+ (official)", "ram+", {"preset": ["official"]}),
)


class EngineUnavailable(RuntimeError):
    """The merge engine (or one method of it) is not installed; the lab reports and skips."""


class MergeFailed(RuntimeError):
    """The engine refused a merge (bad parameters, mismatched checkpoints); the message is the engine's."""


def registered_methods() -> set[str] | None:
    """Method names the engine registers, or None when the engine itself is missing."""
    try:
        methods = importlib.import_module("rlmerge.methods")
    except ImportError:
        return None
    registry = getattr(methods, "REGISTRY", None)
    return set(registry) if isinstance(registry, Mapping) else None


def skip_reason(method: str) -> str | None:
    """Why `method` cannot run here, or None when it can."""
    known = registered_methods()
    if known is None:
        return "merge engine not installed (rlmerge.methods.REGISTRY missing)"
    if method not in known:
        return f"method {method!r} not registered in this engine (has: {', '.join(sorted(known))})"
    try:
        importlib.import_module("rlmerge").merge  # noqa: B018 - presence check of the public verb
    except (ImportError, AttributeError):
        return "rlmerge.merge is missing"
    return None


def merge_checkpoints(
    base: Path, agents: Sequence[Path], out: Path, method: str, params: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge through the engine and return what it reports (λ per agent for RAM+, statistics)."""
    reason = skip_reason(method)
    if reason is not None:
        raise EngineUnavailable(reason)
    import rlmerge

    result = rlmerge.merge(
        str(base),
        [str(a) for a in agents],
        str(out),
        method=method,
        params=dict(params or {}),
        force=True,
        quiet=True,
    )
    info: dict[str, Any] = {}
    lambdas = getattr(result, "lambdas", None)
    if lambdas is not None:
        info["lambdas"] = [float(x) for x in lambdas]
    return info


def estimate_fishers(agents: Sequence[Path], data: Sequence[Path], out: Path, examples: int) -> list[Path]:
    """Each agent's empirical diagonal Fisher on its own task's data, via the engine's estimator."""
    from rlmerge.engine.fisher_estimate import estimate_fisher

    return [
        Path(estimate_fisher(agent, jsonl, out / f"fisher-{i}", examples=examples, force=True))
        for i, (agent, jsonl) in enumerate(zip(agents, data, strict=True))
    ]
