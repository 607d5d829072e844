"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089) and the weighted average ("linear").

Both are elementwise and need no statistics pass. Parameter names follow mergekit: a per-model
``weight``, ``normalize``, and task arithmetic's scaling ``lambda`` (here ``scaling``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._torch import torch
from ..errors import ConfigError
from ..params import check_range
from ._ops import weight_sum
from .spec import BlockContext, MethodSpec


def _check_weights(where: str, weights: tuple[float, ...] | None) -> None:
    if weights is None:
        return
    for w in weights:
        check_range(where, "weight", w, -10.0, 10.0)


def agent_weights(where: str, weights: tuple[float, ...] | None, n: int) -> np.ndarray:
    """[N] float32 weights; all 1 when not given."""
    if weights is None:
        return np.ones(n, dtype=np.float32)
    if len(weights) != n:
        raise ConfigError(f"{where}: {len(weights)} weight(s) given for {n} agent(s)",
                          hint="give one weight per agent, in the order the agents are listed")
    return np.array(weights, dtype=np.float32)


@dataclass(frozen=True)
class TaskArithmeticParams:
    """θ = θ₀ + scaling · Σ_t w_t τ_t (divided by Σ w_t when ``normalize``)."""

    scaling: float = 1.0  # the paper's λ; the RAM paper's grid is 0.1 … 1.0
    weights: tuple[float, ...] | None = None
    normalize: bool = False

    def __post_init__(self) -> None:
        check_range("task_arithmetic", "scaling", self.scaling, -10.0, 10.0)
        _check_weights("task_arithmetic", self.weights)


@dataclass(frozen=True)
class LinearParams:
    """θ = Σ_t w_t θ_t / Σ_t w_t (the plain average of the agents when all w_t = 1)."""

    weights: tuple[float, ...] | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        _check_weights("linear", self.weights)


def weighted_sum(deltas: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t · deltas[t], added in agent order."""
    total = deltas[0] * w[0]
    for t in range(1, deltas.shape[0]):
        total += deltas[t] * w[t]
    return total


def _divisor(where: str, w: np.ndarray) -> np.float32:
    s = weight_sum(w)
    if s == 0.0:
        raise ConfigError(f"{where}: weights sum to zero, cannot normalize", hint="set normalize to false")
    return s


def _merge_ta(base: torch.Tensor, deltas: torch.Tensor, params: TaskArithmeticParams,
              ctx: BlockContext) -> torch.Tensor:
    w = agent_weights("task_arithmetic", params.weights, deltas.shape[0])
    mixed = weighted_sum(deltas, torch.from_numpy(w).to(deltas.device))
    if params.normalize:
        mixed /= torch.tensor(_divisor("task_arithmetic", w), device=deltas.device)
    return base + mixed * params.scaling


def _merge_linear(base: torch.Tensor, deltas: torch.Tensor, params: LinearParams,
                  ctx: BlockContext) -> torch.Tensor:
    w_np = agent_weights("linear", params.weights, deltas.shape[0])
    w = torch.from_numpy(w_np).to(deltas.device)
    total = (base + deltas[0]) * w[0]  # base + τ_t recovers θ_t exactly for same-dtype checkpoints
    for t in range(1, deltas.shape[0]):
        total += (base + deltas[t]) * w[t]
    return total / torch.tensor(_divisor("linear", w_np), device=deltas.device) if params.normalize else total


def _check(where: str) -> Callable[[TaskArithmeticParams | LinearParams, int], None]:
    def check(params: TaskArithmeticParams | LinearParams, n: int) -> None:
        if params.normalize:
            _divisor(where, agent_weights(where, params.weights, n))

    return check


METHODS = [
    MethodSpec("task_arithmetic", "base + scaling × the (weighted) sum of task vectors", "arXiv:2212.04089",
               "elementwise", TaskArithmeticParams, _merge_ta, check=_check("task_arithmetic")),
    MethodSpec("linear", "weighted average of the agents' weights", "arXiv:2203.05482", "elementwise",
               LinearParams, _merge_linear, check=_check("linear")),
]
