"""The registry of merge methods: named declarations, read from each family module's ``METHODS`` list (explicit
imports, no registration by side effect)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..stats import Statistics
from . import arm_ties, fisher, model_stock, ram, slerp, sparsify, task_arithmetic
from .spec import MethodSpec


def _registry() -> dict[str, MethodSpec]:
    specs = [*ram.METHODS, *arm_ties.METHODS, *task_arithmetic.METHODS, *sparsify.METHODS, *slerp.METHODS,
             *model_stock.METHODS, *fisher.METHODS]
    return {s.name: s for s in specs}


REGISTRY: dict[str, MethodSpec] = _registry()
ALIASES = {"ramplus": "ram+", "ram_plus": "ram+", "ta": "task_arithmetic", "dare_linear": "dare_ta"}


def inspected(stats: Statistics) -> dict[str, list[Any]]:
    """Every method's ``inspect`` of ``stats``, in the registry's order: the report's per-agent method fields."""
    return {key: list(values) for spec in REGISTRY.values() for key, values in spec.inspect(stats).items()}


def get_method(name: str) -> MethodSpec:
    key = ALIASES.get(name, name)
    if key not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}", hint=f"choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[key]


__all__ = ["ALIASES", "REGISTRY", "get_method", "inspected"]
