"""The sparsify family's declarations: TIES, DARE (+TA / +TIES), Breadcrumbs, DELLA (presets.py), each a
``MethodSpec`` whose torch reference prunes a block (observer.py) and combines it (presets.combine_rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._torch import torch
from ...errors import ConfigError
from ...stats import Statistics
from ..interface import BlockContext, Rows
from ..rule import torch_eval
from ..spec import Capability, MethodSpec
from .fast_random import Random
from .fast_select import Select
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


@dataclass(frozen=True)
class Sparsify(MethodSpec):
    """One preset of the family (``preset``, presets.PRESETS): a block is pruned with what ``GtaObserver`` found
    (thresholds, L1 factors) and combined (``_merge``, the torch reference); on the numba path the preset's own
    backend (``backend``: fast_select.Select or fast_random.Random) does both. ``report``: what a trim kept."""

    preset: Preset | None = None

    @property
    def _preset(self) -> Preset:
        if self.preset is None:
            raise TypeError(f"method {self.name!r}: a sparsify method needs its preset")
        return self.preset

    def epsilon(self, p: Any) -> float:
        return 1e-5  # the statistics' threshold (DELLA's ``epsilon`` is MagPrune's, not this one)

    def observer(self, p: Any, n: int, at: Callable[[str], Any] | None = None) -> GtaObserver | None:
        return _needed(GtaObserver(self._preset, p, n, at))

    def prepare(self, p: Any, stats: Statistics | None, n: int) -> GtaObserver:
        observed = getattr(stats, "observed", None)
        return observed if isinstance(observed, GtaObserver) else GtaObserver(self._preset, p, n)

    def row_blocks(self, p: Any) -> bool:
        return self._preset.prune == "magprune"  # MagPrune ranks |τ| within each row

    def check(self, p: Any, n: int) -> None:
        if self._preset.prune == "magnitude-global" and getattr(p, "tie_break", None) == "index":
            raise ConfigError(f"{self.name}: tie_break = index is not available for a whole-model threshold",
                              hint="ties_global keeps every |τ| equal to its threshold (the TIES authors' rule); "
                                   "use ties for an exact k per tensor")

    def per_tensor(self, p: Any) -> tuple[str, ...]:
        """The weights and λ; the keep density and its companions unless the threshold is the whole model's."""
        names = ("weights", "scaling") if self._preset.prune == "magnitude-global" else (
            "weights", "scaling", "density", "p", "gamma", "epsilon")
        return tuple(n for n in names if hasattr(p, n))

    def report(self, p: Any, prepared: Any, observer: Any, stats: Statistics) -> Rows:
        found = observer if isinstance(observer, GtaObserver) else prepared
        return Rows(kept=found.kept_fraction(stats) if isinstance(found, GtaObserver) else None)

    def backend(self, p: Any) -> Capability:
        if self._preset.windowed:
            return Select(self.name, self._preset)
        return Random(self.name, self._preset, p.rescale)

    def merge_block(self, base: torch.Tensor, deltas: torch.Tensor, p: Any, ctx: BlockContext) -> torch.Tensor:
        return _merge(self.name, self._preset, base, deltas, p, ctx)


def _spec(name: str, params: type) -> Sparsify:
    preset = PRESETS[name]
    scope = {"magnitude-global": "global", "magnitude": "tensor-local", "outliers": "tensor-local"}.get(
        preset.prune, "elementwise")
    return Sparsify(name, preset.summary, preset.paper, scope, params,  # type: ignore[arg-type]
                    seeded=not preset.windowed, preset=preset)


METHODS = [
    _spec("ties", TiesParams), _spec("ties_global", TiesParams), _spec("dare_ta", DareParams),
    _spec("dare_ties", DareParams), _spec("breadcrumbs", BreadcrumbsParams),
    _spec("breadcrumbs_ties", BreadcrumbsParams), _spec("della", DellaParams), _spec("della_linear", DellaParams),
]
