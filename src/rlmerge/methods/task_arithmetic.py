"""Task arithmetic (Ilharco et al. 2023, arXiv:2212.04089) and the weighted average ("linear").

Both are elementwise and need no statistics pass. Parameter names follow mergekit: a per-model
``weight``, ``normalize``, and task arithmetic's scaling ``lambda`` (here ``scaling``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..params import Weights, agent_weights, check_each, check_range, flag, weight_sum
from .rule import Expr, Terms
from .spec import MethodSpec


@dataclass(frozen=True)
class TaskArithmeticParams:
    """θ = θ₀ + scaling · Σ_t w_t τ_t (divided by Σ w_t when ``normalize``)."""

    scaling: float = field(default=1.0, metadata=flag("task arithmetic λ"))  # the RAM paper's grid: 0.1 … 1.0
    weights: Weights = None
    normalize: bool = False

    def __post_init__(self) -> None:
        check_range("task_arithmetic", "scaling", self.scaling, -10.0, 10.0)
        check_each("task_arithmetic", "weight", self.weights, -10.0, 10.0)


@dataclass(frozen=True)
class LinearParams:
    """θ = Σ_t w_t θ_t / Σ_t w_t (the plain average of the agents when all w_t = 1)."""

    weights: Weights = None
    normalize: bool = True

    def __post_init__(self) -> None:
        check_each("linear", "weight", self.weights, -10.0, 10.0)


def divisor(where: str, w: np.ndarray) -> np.float32:
    """Σ w_t for normalising (params.weight_sum); refused when it is zero."""
    s = weight_sum(w)
    if s == 0.0:
        raise ConfigError(f"{where}: weights sum to zero, cannot normalize", hint="set normalize to false")
    return s


def ta_rule(t: Terms, p: TaskArithmeticParams) -> Expr:
    """θ₀ + scaling · Σ_t w_t τ_t / div (div = Σ w_t when normalising, else 1: x / 1 is x exactly)."""
    total = t.x[0] * t.agent.w[0]
    for i in range(1, t.n):
        total = total + t.x[i] * t.agent.w[i]
    return t.b + (total / t.const.div) * t.const.scaling


def linear_rule(t: Terms, p: LinearParams) -> Expr:
    """Σ_t w_t θ_t / div; base + τ_t recovers θ_t exactly for same-dtype checkpoints."""
    total = (t.b + t.x[0]) * t.agent.w[0]
    for i in range(1, t.n):
        total = total + (t.b + t.x[i]) * t.agent.w[i]
    return total / t.const.div


def _constants(where: str) -> Callable[..., dict[str, Any]]:
    def constants(p: TaskArithmeticParams | LinearParams, prepared: Any, ts: Any, n: int,
                  name: str) -> dict[str, Any]:
        w = agent_weights(where, p.weights, n)
        return {"w": w, "div": divisor(where, w) if p.normalize else np.float32(1.0),
                "scaling": np.float32(getattr(p, "scaling", 1.0))}

    return constants


def _check(where: str) -> Callable[[TaskArithmeticParams | LinearParams, int], None]:
    def check(params: TaskArithmeticParams | LinearParams, n: int) -> None:
        if params.normalize:
            divisor(where, agent_weights(where, params.weights, n))

    return check


METHODS = [
    MethodSpec("task_arithmetic", "base + scaling × the (weighted) sum of task vectors", "arXiv:2212.04089",
               "elementwise", TaskArithmeticParams, rule=ta_rule, constants=_constants("task_arithmetic"),
               checks=_check("task_arithmetic"), varying=("weights", "scaling")),
    MethodSpec("linear", "weighted average of the agents' weights", "arXiv:2203.05482", "elementwise",
               LinearParams, rule=linear_rule, constants=_constants("linear"), checks=_check("linear"),
               varying=("weights",), task_vectors=False),
]
