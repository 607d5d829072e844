"""Merge methods: a registry of named, pure block functions.

A method is a ``MethodSpec``: a frozen parameter dataclass, whether it needs the statistics pass,
a ``prepare`` step that turns whole-model statistics into constants (RAM+'s λ, a global threshold),
and ``merge``, a pure function of (base block [n], float32 deltas [N, n], parameters, context)
returning the merged float32 weights [n]. No IO, no global state, no mutation of inputs.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .._torch import torch
from ..errors import ConfigError, RLMergeError, raise_all
from ..stats import Statistics, TensorStats

Scope = Literal["elementwise", "global", "tensor-local"]


@dataclass(frozen=True)
class BlockContext:
    """Where a block sits, and what the statistics pass learned about its tensor."""

    name: str  # tensor name
    start: int  # flat element range [start, stop) of the tensor
    stop: int
    shape: tuple[int, ...]
    present: tuple[bool, ...]  # per agent; a missing agent's deltas are zero
    prepared: Any  # what the method's prepare() returned
    tensor_stats: TensorStats | None  # None when the method ran without a statistics pass
    seed: int = 0
    extra: torch.Tensor | None = None  # [N, n] float32 side inputs of the block (e.g. Fisher), if any


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    paper: str  # arXiv id or citation
    scope: Scope
    params: type  # frozen dataclass; field defaults are the paper's
    merge: Callable[[torch.Tensor, torch.Tensor, Any, BlockContext], torch.Tensor]
    needs_stats: Callable[[Any], bool] = lambda p: False
    prepare: Callable[[Any, Statistics | None, int], Any] = lambda p, s, n: None
    epsilon: Callable[[Any], float] = lambda p: getattr(p, "epsilon", 1e-5)
    # Optional: an object fed every block of the statistics pass (``observe(ctx, base, deltas)``); after each
    # tensor and after the whole model, ``again(name | None)`` may ask for that range to be streamed once more
    # (exact order statistics need a second look). prepare() finds it as ``stats.observed``.
    observer: Callable[[Any, int], Any] = lambda p, n: None
    row_blocks: Callable[[Any], bool] = lambda p: False  # blocks hold whole rows (shape[1:]) of each tensor
    # Per-agent side inputs (folders shaped like the agents, e.g. Fisher diagonals), read blockwise as ``extra``.
    extra_inputs: Callable[[Any], tuple[str, ...] | None] = lambda p: None

    def parse(self, values: Mapping[str, Any] | None) -> Any:
        """Build the parameter dataclass from loose values (CLI, YAML); all problems at once."""
        return parse_params(self.params, values or {}, where=f"method {self.name!r}")


def parse_params(cls: type, values: Mapping[str, Any], *, where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    problems: list[RLMergeError] = []
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        k = str(key).replace("-", "_")  # YAML keys may be numbers
        if k not in fields:
            problems.append(ConfigError(f"unknown parameter {key!r} for {where}",
                                        hint=f"known parameters: {', '.join(fields) or 'none'}"))
            continue
        try:
            kwargs[k] = _coerce(value, hints[k])
        except (TypeError, ValueError, OverflowError) as e:
            problems.append(ConfigError(f"parameter {key!r} of {where}: {e}"))
    raise_all(problems)
    try:
        params = cls(**kwargs)
    except RLMergeError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from e
    return params


def _coerce(value: Any, hint: Any) -> Any:
    """Turn CLI/YAML text into the annotated type (float, int, bool, Literal, tuple, Optional)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_coerce(v, args[0]) for v in items)
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
        raise ValueError(f"{value!r} is not a boolean")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"{value!r} is not an integer")
        return int(value)
    if hint is float:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number")
        return float(value)
    if hint is str:
        return str(value)
    return value


def check_range(where: str, name: str, value: float, lo: float, hi: float, *,
                lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ConfigError unless lo ≤ value ≤ hi (open ends as requested)."""
    bad = value != value or value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi)
    if bad:
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ConfigError(f"{where}: {name} = {value} is out of range {lb}{lo}, {hi}{rb}")


def _registry() -> dict[str, MethodSpec]:
    from . import fisher, gta, model_stock, ram, slerp, task_arithmetic

    specs = [*ram.METHODS, *task_arithmetic.METHODS, *gta.METHODS, *slerp.METHODS, *model_stock.METHODS,
             *fisher.METHODS]
    return {s.name: s for s in specs}


REGISTRY: dict[str, MethodSpec] = _registry()
ALIASES = {"ramplus": "ram+", "ram_plus": "ram+", "ta": "task_arithmetic", "dare_linear": "dare_ta"}


def get_method(name: str) -> MethodSpec:
    key = ALIASES.get(name, name)
    if key not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}", hint=f"choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[key]
