"""SLERP: spherical linear interpolation between two models, per tensor (Shoemake 1985; mergekit's ``slerp``).

For each tensor, with v0, v1 flattened and unit-normalised, cos Ω = ⟨v0, v1⟩/(‖v0‖‖v1‖):

    slerp(v0, v1; t) = sin((1 − t)Ω)/sin Ω · v0 + sin(tΩ)/sin Ω · v1      (linear when |cos Ω| > dot_threshold)

One agent: v0 = θ₀ (the base), v1 = θ₁, as mergekit does with ``base_model`` = v0. Two agents: v0 = θ₁ and
v1 = θ₂ (``space: weights``), or θ₀ + slerp(τ₁, τ₂; t) (``space: task_vectors``). Norms and the dot product
come from the statistics pass (float64 sums), so the merge pass is elementwise: tensor-local.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .._torch import torch
from ..errors import ConfigError
from ..params import check_range
from .interface import BlockContext, Observer
from .spec import MethodSpec


@dataclass(frozen=True)
class SlerpParams:
    t: float = 0.5  # 0 → v0, 1 → v1
    dot_threshold: float = 0.9995  # above it (nearly collinear) interpolate linearly, as mergekit
    eps: float = 1e-8  # a norm ≤ eps is treated as 1, as mergekit
    space: Literal["weights", "task_vectors"] = "weights"

    def __post_init__(self) -> None:
        check_range("slerp", "t", self.t, 0.0, 1.0)
        check_range("slerp", "dot_threshold", self.dot_threshold, 0.0, 1.0)
        check_range("slerp", "eps", self.eps, 0.0, 1.0)


def _ends(params: SlerpParams, base: torch.Tensor, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v0, v1) of a block, per the number of agents and the space."""
    if deltas.shape[0] == 1:
        return base, base + deltas[0]
    if params.space == "task_vectors":
        return deltas[0], deltas[1]
    return base + deltas[0], base + deltas[1]


def coefficients(params: SlerpParams, s00: float, s11: float, s01: float) -> tuple[float, float]:
    """(c0, c1) from Σv0², Σv1², Σv0·v1 of one tensor, following mergekit's ``slerp`` step by step."""
    na, nb = math.sqrt(s00), math.sqrt(s11)
    na, nb = (na if na > params.eps else 1.0), (nb if nb > params.eps else 1.0)
    dot = min(1.0, max(-1.0, s01 / (na * nb)))
    t = params.t
    if abs(dot) > params.dot_threshold:
        return 1.0 - t, t
    theta = math.acos(dot)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


def _check_agents(params: SlerpParams, n: int) -> None:
    if n not in (1, 2):
        raise ConfigError(f"slerp merges exactly two models: the base and one agent, or two agents (got {n})")
    if n == 1 and params.space == "task_vectors":
        raise ConfigError("slerp: space = task_vectors needs two agents", hint="use space = weights")


class SlerpObserver(Observer):
    def __init__(self, params: SlerpParams, n: int, at: Callable[[str], Any] | None = None) -> None:
        _check_agents(params, n)
        self.params = params
        self.at = at if at is not None else (lambda name: params)  # each tensor's t (a recipe's gradient)
        self.coef: dict[str, tuple[float, float]] = {}
        self._acc = [0.0, 0.0, 0.0]

    def observe(self, ctx: BlockContext, base: torch.Tensor, deltas: torch.Tensor) -> None:
        if ctx.start == 0:
            self._acc = [0.0, 0.0, 0.0]
        v0, v1 = (v.double() for v in _ends(self.params, base, deltas))
        self._acc[0] += float(v0 @ v0)
        self._acc[1] += float(v1 @ v1)
        self._acc[2] += float(v0 @ v1)

    def again(self, name: str | None) -> bool:
        if name is not None:
            self.coef[name] = coefficients(self.at(name), *self._acc)
        return False


def _merge(base: torch.Tensor, deltas: torch.Tensor, params: SlerpParams, ctx: BlockContext) -> torch.Tensor:
    c0, c1 = ctx.prepared.coef[ctx.name]
    v0, v1 = _ends(params, base, deltas)
    out = v0 * c0 + v1 * c1  # c0, c1 rounded to float32, as mergekit's coefficients are float32
    return base + out if (deltas.shape[0] == 2 and params.space == "task_vectors") else out


class Slerp(MethodSpec):
    """Each tensor's coefficients from ``SlerpObserver``'s sums in the statistics pass, applied by ``_merge``."""

    def observer(self, p: SlerpParams, n: int, at: Callable[[str], Any] | None = None) -> SlerpObserver:
        return SlerpObserver(p, n, at)

    def prepare(self, p: SlerpParams, stats: Any, n: int) -> SlerpObserver:
        if stats is None or not isinstance(stats.observed, SlerpObserver):
            raise RuntimeError("slerp ran without its statistics pass")
        return stats.observed


METHODS = [
    Slerp("slerp", "spherical interpolation between two models, per tensor", "Shoemake 1985 (mergekit slerp)",
          "tensor-local", SlerpParams, _merge, checks=_check_agents, varying=("t",)),
]
