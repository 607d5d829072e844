"""The sparsify family's declarations: TIES, DARE (+TA / +TIES), Breadcrumbs, DELLA (presets.py), each a
``MethodSpec`` whose torch reference prunes a block (observer.py) and combines it (presets.combine_rule).
"""

from __future__ import annotations

from typing import Any

from ..._torch import torch
from ...errors import ConfigError
from ..rule import torch_eval
from ..spec import BlockContext, MethodSpec
from .observer import GtaObserver, prune_block
from .presets import PRESETS, BreadcrumbsParams, DareParams, DellaParams, Preset, TiesParams, combine_constants


def _merge(name: str, preset: Preset, base: torch.Tensor, deltas: torch.Tensor, params: Any,
           ctx: BlockContext) -> torch.Tensor:
    obs: GtaObserver = ctx.prepared
    c = combine_constants(name, preset, params, deltas.shape[0])
    w = torch.from_numpy(c.w).to(deltas.device)
    pruned, prob = prune_block(preset, obs, deltas, ctx)
    rescale = getattr(params, "rescale", "none")
    if rescale == "inverse" and prob is not None:
        pruned = pruned / prob
    elif rescale == "l1":
        pruned = pruned * torch.from_numpy(obs.l1[ctx.name]).to(deltas.device).unsqueeze(-1)
    return torch_eval(c.program, base, pruned * w.unsqueeze(-1), c.values)


def _needed(obs: GtaObserver) -> GtaObserver | None:
    """The observer, if the statistics pass has anything to find for it (thresholds, L1 sums)."""
    return obs if (obs.needs_selection or obs.needs_l1) else None


def _spec(name: str, params: type) -> MethodSpec:
    preset = PRESETS[name]
    scope = {"magnitude-global": "global", "magnitude": "tensor-local", "outliers": "tensor-local"}.get(
        preset.prune, "elementwise")
    return MethodSpec(
        name, preset.summary, preset.paper, scope, params,  # type: ignore[arg-type]
        lambda b, d, p, c: _merge(name, preset, b, d, p, c),
        prepare=lambda p, stats, n: getattr(stats, "observed", None) or GtaObserver(preset, p, n),
        observer=lambda p, n, at=None: _needed(GtaObserver(preset, p, n, at)), sparsify=preset,
        row_blocks=lambda p: preset.prune == "magprune", epsilon=lambda p: 1e-5,
        per_tensor=lambda p: _per_tensor(preset, p), check=lambda p, n: _check_tie_break(name, preset, p))


def _check_tie_break(name: str, preset: Preset, p: Any) -> None:
    if preset.prune == "magnitude-global" and getattr(p, "tie_break", None) == "index":
        raise ConfigError(f"{name}: tie_break = index is not available for a whole-model threshold",
                          hint="ties_global keeps every |τ| equal to its threshold (the TIES authors' rule); use "
                               "ties for an exact k per tensor")


def _per_tensor(preset: Preset, p: Any) -> tuple[str, ...]:
    """What may vary per tensor: the weights and λ; the keep density and its companions unless the threshold is the
    whole model's (ties_global)."""
    names = ("weights", "scaling") if preset.prune == "magnitude-global" else (
        "weights", "scaling", "density", "p", "gamma", "epsilon")
    return tuple(n for n in names if hasattr(p, n))


METHODS = [
    _spec("ties", TiesParams), _spec("ties_global", TiesParams), _spec("dare_ta", DareParams),
    _spec("dare_ties", DareParams), _spec("breadcrumbs", BreadcrumbsParams),
    _spec("breadcrumbs_ties", BreadcrumbsParams), _spec("della", DellaParams), _spec("della_linear", DellaParams),
]
