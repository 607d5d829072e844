"""Fisher merging (Matena & Raffel 2022, arXiv:2111.09832): a diagonal-Fisher-weighted average.

    θ_i = Σ_t c_t F_t,i θ_t,i / Σ_t c_t F_t,i,   F_t,i ← max(F_t,i, floor),   c_t = w_t (/ ‖F_t‖₂ if normalize)

computed as θ₀ + Σ_t c_t F_t τ_t / Σ_t c_t F_t (the same number, without cancellation). F_t is a
safetensors folder with the agent's tensor names (``rlmerge fisher`` estimates one), read blockwise beside the
weights. Elementwise, except ``normalize`` (each F_t divided by its whole-model L2 norm, as the authors'
``normalize_fishers``), which needs the statistics pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._torch import torch
from ..errors import ConfigError
from ..params import Weights, agent_weights, check_each, check_range
from ..stats import Statistics
from .interface import BlockContext, Observer
from .spec import MethodSpec


@dataclass(frozen=True)
class FisherParams:
    fisher: tuple[str, ...] = ()  # one Fisher folder per agent, in agent order
    weights: Weights = None  # the authors' merging coefficients (one value, or one per agent)
    floor: float = 1e-6  # the authors' fisher_floor: no element has zero weight
    normalize: bool = False  # divide each F_t by its whole-model L2 norm

    def __post_init__(self) -> None:
        if not self.fisher:
            raise ConfigError("fisher: no Fisher files given (parameter fisher=F1,F2,...)",
                              hint="estimate one per agent with `rlmerge fisher AGENT --data prompts.jsonl -o F`")
        check_range("fisher", "floor", self.floor, 0.0, 1.0, lo_open=True)
        check_each("fisher", "weight", self.weights, 0.0, 10.0)


class FisherNorms(Observer):
    """Σ F_t² over the whole model, per agent (only with ``normalize``)."""

    def __init__(self, n: int) -> None:
        self.sumsq = torch.zeros(n, dtype=torch.float64)

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        assert ctx.extra is not None  # the engine reads the side inputs for this method
        self.sumsq += (ctx.extra.double() ** 2).sum(-1).cpu()

    def again(self, name: str | None) -> bool:
        return False


def _prepare(params: FisherParams, stats: Statistics | None, n: int) -> torch.Tensor:
    """The coefficients c_t [N]."""
    w = torch.from_numpy(agent_weights("fisher", params.weights, n)).double()
    obs = getattr(stats, "observed", None)
    if params.normalize and obs is not None:
        norms = obs.sumsq.sqrt()
        if bool((norms == 0).any()):
            raise ConfigError("fisher: a Fisher file is all zeros, cannot normalize", hint="set normalize to false")
        w = w / norms
    return w.float()


def _merge(base: torch.Tensor, deltas: torch.Tensor, params: FisherParams, ctx: BlockContext) -> torch.Tensor:
    assert ctx.extra is not None
    c = ctx.prepared.to(deltas.device).unsqueeze(-1)  # [N, 1]
    f = ctx.extra.clamp(min=params.floor) * c  # [N, n]
    num, den = f[0] * deltas[0], f[0].clone()
    for t in range(1, deltas.shape[0]):
        num += f[t] * deltas[t]
        den += f[t]
    return base + num / den


class Fisher(MethodSpec):
    """The coefficients c_t (``_prepare``: normalised by ``FisherNorms`` from the statistics pass) and the Fisher
    folders read beside the weights (``extra_inputs``), combined by ``_merge``."""

    def observer(self, p: FisherParams, n: int, at: Any = None) -> FisherNorms | None:
        return FisherNorms(n) if p.normalize else None

    def prepare(self, p: FisherParams, stats: Statistics | None, n: int) -> torch.Tensor:
        return _prepare(p, stats, n)

    def extra_inputs(self, p: FisherParams) -> tuple[str, ...]:
        return p.fisher


METHODS = [
    Fisher("fisher", "Fisher merging: average weighted by each agent's diagonal Fisher", "arXiv:2111.09832",
           "elementwise", FisherParams, _merge),
]

__all__ = ["METHODS", "FisherParams"]
