"""Typed parameters from loose values (command line, YAML): one dataclass field type per parameter.

Strings from the command line and YAML scalars become the annotated type (float, int, bool, Literal, tuple,
Optional); every problem is collected and raised together as ``ConfigError``s. Used for method parameters and
for a recipe's run options.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from .errors import ConfigError, RLMergeError, raise_all


def flag(help: str, *, name: str | None = None) -> dict[str, Any]:
    """A parameter dataclass field's metadata that makes it an option of ``rlmerge merge`` and ``rlmerge plan``:
    ``--NAME`` (default: the field's name, with ``-`` for ``_``), with ``help``. The command line passes its value
    as that parameter of whichever method runs; every other parameter is ``--param KEY=VALUE``.

    >>> import dataclasses
    >>> @dataclasses.dataclass(frozen=True)
    ... class Params:
    ...     r: float = dataclasses.field(default=0.1, metadata=flag("strength r"))
    """
    return {FLAG: {"name": name, "help": help}}


FLAG = "rlmerge.flag"  # the key of ``flag``'s entry in a field's metadata


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


def coerce(value: Any, hint: Any) -> Any:
    """One loose value as ``hint`` (what ``parse_params`` does per field); ValueError or TypeError when it is not."""
    return _coerce(value, hint)


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
        raise ValueError("; ".join(dict.fromkeys(errors)))
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


# -- parameters given per agent (weights, densities): one value for every agent, or one per agent -------------
Weights = float | tuple[float, ...] | None  # one value for every agent, or one per agent; None: all 1
PerAgent = float | tuple[float, ...]


def each(value: PerAgent | None) -> tuple[float, ...]:
    """The values of a per-agent parameter as given (one value stands for every agent; None: none)."""
    return () if value is None else value if isinstance(value, tuple) else (value,)


def check_each(where: str, name: str, value: PerAgent | None, lo: float, hi: float, **ends: bool) -> None:
    """``params.check_range`` on each value of a per-agent parameter."""
    for v in each(value):
        check_range(where, name, v, lo, hi, **ends)


def per_agent(value: PerAgent, n: int, where: str, name: str) -> tuple[float, ...]:
    """One value per agent: a tuple of N as given, or one value N times."""
    if isinstance(value, tuple):
        if len(value) != n:
            what = "weight(s)" if name == "weight" else f"value(s) of {name}"
            raise ConfigError(f"{where}: {len(value)} {what} given for {n} agent(s)",
                              hint="give one value, or one per agent in the order the agents are listed")
        return value
    return (float(value),) * n


def agent_weights(where: str, weights: Weights, n: int) -> np.ndarray:
    """[N] float32 weights; all 1 when not given, all w when one value w is given."""
    return np.array(per_agent(1.0 if weights is None else weights, n, where, "weight"), dtype=np.float32)


def weight_sum(w: np.ndarray) -> np.float32:
    """Σ w_t accumulated in float64 and rounded once to float32: the same on every machine and both paths
    (torch's own float32 sum adds in an order that depends on the length and the CPU's vector width)."""
    return np.float32(np.sum(np.asarray(w, dtype=np.float32), dtype=np.float64))
