"""Merge methods: a registry of named declarations, built from explicit imports (no registration by side effect).

``spec.MethodSpec`` says what a method is; each module here declares one family of methods.
"""

from __future__ import annotations

from ..errors import ConfigError
from . import arm_ties, fisher, gta, model_stock, ram, slerp, task_arithmetic
from .spec import BlockContext, MethodSpec, Scope, validate


def _registry() -> dict[str, MethodSpec]:
    specs = [*ram.METHODS, *arm_ties.METHODS, *task_arithmetic.METHODS, *gta.METHODS, *slerp.METHODS,
             *model_stock.METHODS, *fisher.METHODS]
    return {s.name: s for s in specs}


REGISTRY: dict[str, MethodSpec] = _registry()
ALIASES = {"ramplus": "ram+", "ram_plus": "ram+", "ta": "task_arithmetic", "dare_linear": "dare_ta"}


def get_method(name: str) -> MethodSpec:
    key = ALIASES.get(name, name)
    if key not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}", hint=f"choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[key]


__all__ = ["ALIASES", "REGISTRY", "BlockContext", "MethodSpec", "Scope", "get_method", "validate"]
