"""Per-tensor parameter values: mergekit's gradients and filters, with mergekit 0.1.5's meaning.

In a mergekit recipe a parameter is a number, a *gradient* (a list of numbers interpolated over the layer index)
or a list of *filters* (``{filter: SUBSTRING, value: NUMBER | GRADIENT}``, the first whose substring is in the
tensor's name wins; no filter, or ``*``, matches every tensor). ``evaluate`` is mergekit's
``config.evaluate_setting``; ``layer_positions`` its t: layer i of L gets t = i / (L − 1) (t = 1 when L = 1), and
every tensor outside the layers (embeddings, final norm, lm_head) t = 0, as mergekit's planner does.

A ``PerTensor`` is one parameter's settings in precedence order (a model's own, then the recipe's top level) and
mergekit's default; ``at(tensor, t)`` is its value for one tensor (a tuple, one per agent, for a per-agent one).

>>> g = parse_setting([1, 0.7, 0.1], "density")
>>> [evaluate(g, "model.layers.0.mlp.up_proj.weight", t) for t in (0.0, 0.25, 1.0)]
[1.0, 0.85, 0.1]
>>> f = parse_setting([{"filter": "mlp", "value": 0.5}, {"value": 0}], "weight")
>>> evaluate(f, "model.layers.3.mlp.up_proj.weight", 0.5), evaluate(f, "model.norm.weight", 0.0)
(0.5, 0)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

Scalar = bool | int | float | str
_SCALAR = (bool, int, float, str)


@dataclass(frozen=True)
class Gradient:
    """Values at evenly spaced points from the first layer (t = 0) to the last (t = 1)."""

    values: tuple[Scalar, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.values)) + "]"


@dataclass(frozen=True)
class Filter:
    """``value`` for the tensors whose name contains ``pattern`` (None or ``*``: every tensor)."""

    pattern: str | None
    value: Scalar | Gradient

    def matches(self, tensor: str) -> bool:
        return self.pattern is None or self.pattern == "*" or (bool(tensor) and self.pattern in tensor)

    def __str__(self) -> str:
        return f"{self.value} where the name contains {self.pattern!r}" if self.pattern not in (None, "*") \
            else f"{self.value} elsewhere"


@dataclass(frozen=True)
class Filters:
    """The first matching filter wins; none matching leaves the parameter to the next setting (or the default)."""

    filters: tuple[Filter, ...]

    def __str__(self) -> str:
        return "; ".join(map(str, self.filters))


Setting = Scalar | Gradient | Filters


def _numeric(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _value(raw: Any, where: str) -> Scalar | Gradient:
    """A filter's value (or a whole setting without filters): a number or a gradient of numbers."""
    if isinstance(raw, _SCALAR):
        return raw
    if isinstance(raw, list):
        if not raw:
            raise ConfigError(f"{where}: an empty list is not a value", hint="give a number, or a list of numbers "
                              "(a gradient over the layers)")
        if not all(isinstance(v, _SCALAR) for v in raw):
            raise ConfigError(f"{where}: a gradient is a list of numbers; this one holds "
                              f"{', '.join(sorted({type(v).__name__ for v in raw if not isinstance(v, _SCALAR)}))}",
                              hint="filters are a list of {filter: NAME, value: ...} entries, not nested in a "
                                   "gradient")
        return raw[0] if len(raw) == 1 else Gradient(tuple(raw))
    kind = "nothing" if raw is None else type(raw).__name__
    raise ConfigError(f"{where}: a value must be a number or a list of numbers, not {kind}")


def _filter(raw: Any, where: str) -> Filter:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: a filter entry must be a mapping {{filter: NAME, value: ...}}, not "
                          f"{type(raw).__name__}", hint="do not mix plain numbers and filter entries in one list")
    unknown = sorted(str(k) for k in raw if k not in ("filter", "value"))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in a filter entry",
                          hint="a filter entry has `filter` (a substring of tensor names; omit it for every "
                               "tensor) and `value`")
    if "value" not in raw:
        raise ConfigError(f"{where}: a filter entry has no `value`")
    pattern = raw.get("filter")
    if pattern is not None and not isinstance(pattern, str):
        raise ConfigError(f"{where}: `filter` must be text (a substring of tensor names), not {pattern!r}")
    return Filter(pattern, _value(raw["value"], where))


def parse_setting(raw: Any, where: str) -> Setting:
    """A recipe's parameter value → a number, a ``Gradient`` or ``Filters``; a bad shape is a ``ConfigError``.

    Settings that cannot vary are simplified: a one-element gradient is its number, a filter list whose first
    entry matches every tensor is that entry's value.
    """
    if isinstance(raw, dict):
        raw = [raw]  # one filter entry on its own, as mergekit's ConditionalParameter
    if isinstance(raw, list) and raw and all(isinstance(v, dict) for v in raw):
        filters = tuple(_filter(v, f"{where}[{i}]") for i, v in enumerate(raw))
        if filters[0].pattern in (None, "*"):
            return filters[0].value
        return Filters(filters)
    if isinstance(raw, list) and any(isinstance(v, dict) for v in raw):
        raise ConfigError(f"{where}: a list mixes numbers and filter entries",
                          hint="either a gradient [0.1, 0.5, ...] or filters [{filter: mlp, value: ...}, ...]")
    return _value(raw, where)


def _number(v: Scalar) -> float | None:
    if _numeric(v):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _interpolate(g: Gradient, t: float) -> Any:
    """mergekit's interpolation: numbers interpolate linearly between neighbours; other values are picked."""
    numbers = [_number(v) for v in g.values]
    if any(v is None for v in numbers):
        return g.values[int(t * (len(g.values) - 1))]
    scaled = t * (len(numbers) - 1)
    i0 = int(scaled)
    i1 = min(len(numbers) - 1, i0 + 1)
    frac = scaled - i0
    return (1 - frac) * numbers[i0] + frac * numbers[i1]  # type: ignore[operator]


def evaluate(setting: Setting, tensor: str, t: float) -> Any:
    """The setting's value for ``tensor`` at layer position ``t``; None when no filter matches."""
    if isinstance(setting, Filters):
        for f in setting.filters:
            if f.matches(tensor):
                return evaluate(f.value, tensor, t)
        return None
    if isinstance(setting, Gradient):
        return _interpolate(setting, t)
    return setting


def varies(setting: Any) -> bool:
    return isinstance(setting, (Gradient, Filters))


@dataclass(frozen=True)
class PerTensor:
    """A parameter whose value depends on the tensor.

    ``chains``: per agent (one chain for a parameter shared by all agents), the settings in precedence order (the
    model's own, then the recipe's top level); the first that gives a value wins, else ``default``.
    """

    name: str  # the parameter, as the recipe spells it
    chains: tuple[tuple[Setting, ...], ...]
    default: Any
    per_agent: bool

    def _one(self, chain: tuple[Setting, ...], tensor: str, t: float) -> Any:
        for s in chain:
            v = evaluate(s, tensor, t)
            if v is not None:
                return v
        return self.default

    def at(self, tensor: str, t: float) -> Any:
        values = tuple(self._one(c, tensor, t) for c in self.chains)
        return values if self.per_agent else values[0]

    def __str__(self) -> str:
        def chain(c: tuple[Setting, ...]) -> str:
            return " else ".join(map(str, c)) + (f" else {self.default}" if self.default is not None else "")
        if not self.per_agent:
            return chain(self.chains[0])
        return "; ".join(f"agent {i}: {chain(c)}" for i, c in enumerate(self.chains))


# -- where a tensor sits: t over the layers ---------------------------------------------------------------------
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def layer_index(tensor: str) -> int | None:
    """The index of the decoder layer a tensor belongs to (``model.layers.7.…`` → 7), or None."""
    m = LAYER.search(tensor)
    return int(m.group(1)) if m else None


def layer_count(config: Mapping[str, Any], names: Iterable[str]) -> int:
    """L, the number of layers: the config's, else one more than the largest layer index among ``names``."""
    for cfg in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for key in LAYER_KEYS:
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    found = [i for i in map(layer_index, names) if i is not None]
    return max(found) + 1 if found else 0


def layer_positions(names: Iterable[str], config: Mapping[str, Any]) -> dict[str, float]:
    """t per tensor, as mergekit's planner gives it: i / (L − 1) in layer i (1 when L = 1), 0 outside the layers.

    Raises ``ConfigError`` when a tensor's layer index is not below the config's layer count."""
    names = list(names)
    count = layer_count(config, names)
    out = {}
    for name in names:
        i = layer_index(name)
        if i is None:
            out[name] = 0.0
        elif i >= count:
            raise ConfigError(f"tensor {name!r} is in layer {i}, but the base's config has {count} layer(s)",
                              hint="a gradient is interpolated over the layers: fix num_hidden_layers in "
                                   "config.json")
        else:
            out[name] = i / (count - 1) if count > 1 else 1.0
    return out
