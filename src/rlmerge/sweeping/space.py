"""What a search beyond a grid samples (``--search random|tpe|cmaes``): ranges, lists, and the method itself.

A space is written as a grid is (candidates.py), one ``--candidate`` (or a recipe's ``{method, parameters, seed}``)
per method, and each value is one of:

    KEY=LO..HI        a range: sampled as a float, or as an int where the method's parameter is an int (and seed)
    KEY=LO..HI:log    the same on a log scale (LO > 0)
    KEY=a,b,c         a choice among the values (categorical), each read as a grid reads it ([1,0.5]: per agent)
    KEY=v             fixed

Several spaces make the method itself a choice, each with its own parameters (a conditional space): the sampler
first picks a space, then that space's parameters (named ``ram+.r``, ``ties.density``: search.py). Every problem of
every space is reported at once, before any weight is read: the syntax, LO < HI, log ranges above 0, a range on a
parameter that is not a number, an int range with fractional ends, and each range's ends and each list's values
that the method (its own range checks) refuses beside every tested value of the others. A combination the method
refuses only together (DELLA's density ± ε, a RAM+ knob beside a preset a list offers) is found when it is
sampled: that trial fails (search.py).

    >>> s = parse_space("ram+ r=0.01..0.5:log alpha=0.5..3 preset=paper")
    >>> [(d.key, d.kind) for d in s.dims]
    [('r', 'float'), ('alpha', 'float'), ('preset', 'fixed')]
"""

from __future__ import annotations

import itertools
import math
import shlex
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError, ProblemsError, RLMergeError, raise_all
from ..methods import get_method
from ..params import coerce
from .candidates import Candidate, _split, _text, _value

Kind = Literal["float", "int", "choice", "fixed"]


@dataclass(frozen=True)
class Dim:
    """One parameter of a space: a range (``float``, ``int``), a choice among ``values``, or one fixed value."""

    key: str
    kind: Kind
    values: tuple[Any, ...] = ()  # choice: the values (as a grid reads them); fixed: the one value
    lo: float = 0.0
    hi: float = 0.0
    log: bool = False

    @property
    def texts(self) -> list[str]:
        """A choice's values as the sampler sees them (strings: a per-agent list is no categorical value)."""
        return [_text(v) for v in self.values]

    def describe(self) -> str:
        if self.kind in ("float", "int"):
            return f"{self.key}={_num(self.lo)}..{_num(self.hi)}" + (":log" if self.log else "")
        return f"{self.key}=" + ",".join(self.texts)


@dataclass(frozen=True)
class Space:
    """One method's part of the search: its parameters (``dims``, in the order given) and its default seed."""

    method: str  # the registry's name
    dims: tuple[Dim, ...]
    seed: int = 0

    @property
    def ranges(self) -> int:
        return sum(d.kind in ("float", "int") for d in self.dims)

    @property
    def text(self) -> str:
        return " ".join([self.method, *(d.describe() for d in self.dims)])

    def first(self) -> dict[str, Any]:
        """Each parameter's first value: a range's low end, a list's first value, the fixed value."""
        return {d.key: (d.lo if d.kind == "float" else int(d.lo)) if d.kind in ("float", "int") else d.values[0]
                for d in self.dims}

    def candidate(self, values: Mapping[str, Any]) -> Candidate:
        """The candidate for the sampled ``values`` (key → value; a fixed dim needs none)."""
        params, seed = [], self.seed
        for d in self.dims:
            v = d.values[0] if d.kind == "fixed" else values[d.key]
            if d.key == "seed":
                try:
                    seed = coerce(v, int)  # the recipe parser's int: "2" is 2, 1.5 and true are errors
                except (TypeError, ValueError):
                    raise ConfigError(f"seed {v!r} is not a whole number") from None
            else:
                params.append((d.key, v))
        return Candidate(self.method, tuple(params), seed)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(float(x))


def names(spaces: Sequence[Space]) -> list[str]:
    """The method choice's values: each space's method, numbered where two spaces share one (``ram+#2``)."""
    methods = [s.method for s in spaces]
    return [m if methods.count(m) == 1 else f"{m}#{i}" for i, m in enumerate(methods, 1)]


def parse_space(entry: str | Mapping[str, Any], *, seed: int = 0, where: str = "--candidate") -> Space:
    """One space from a ``--candidate`` string or a recipe's mapping; every problem in it at once."""
    method, raw, problems = _tokens(entry, where)
    if method is None:
        raise_all(problems)
    assert method is not None
    try:
        spec = get_method(method)
    except RLMergeError as e:
        raise ConfigError(f"{where}: {e.render()}") from None
    hints = typing.get_type_hints(spec.params)
    dims: list[Dim] = []
    for key, value in raw:
        try:
            dims.append(_dim(key, value, hints, spec.name, where))
        except ConfigError as e:
            problems.append(e)
    space = Space(spec.name, tuple(dims), seed)
    problems += _check_values(space, where)  # the dims that parsed: every bad value is reported at once
    raise_all(problems)
    return space


def parse_spaces(entries: Sequence[str | Mapping[str, Any]], *, seed: int = 0,
                 where: str = "--candidate") -> list[Space]:
    """Every space, every problem of every one at once."""
    out: list[Space] = []
    problems: list[RLMergeError] = []
    for i, entry in enumerate(entries):
        try:
            out.append(parse_space(entry, seed=seed, where=f"{where}[{i}]" if len(entries) > 1 else where))
        except RLMergeError as e:
            problems += e.problems if isinstance(e, ProblemsError) else [e]
    if not entries:
        problems.append(ConfigError("no candidates to search", hint='give --candidate "ram+ r=0.01..0.5:log"'))
    raise_all(problems)
    return out


def _tokens(entry: Any, where: str) -> tuple[str | None, list[tuple[str, Any]], list[RLMergeError]]:
    """(method, [(key, value text or YAML value)], problems) of a string or a mapping."""
    if isinstance(entry, Mapping):
        unknown = sorted(set(map(str, entry)) - {"method", "parameters", "seed"})
        params = entry.get("parameters") or {}
        if "method" not in entry or not isinstance(params, Mapping) or unknown:
            return None, [], [ConfigError(f"{where}: a candidate is a string or a mapping with method, parameters "
                                          "and seed" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))]
        raw = [(str(k), v) for k, v in params.items()]
        if "seed" in entry:
            raw.append(("seed", entry["seed"]))
        return str(entry["method"]), raw, []
    if not isinstance(entry, str):
        return None, [], [ConfigError(f"{where}: a candidate is a string or a mapping, not {entry!r}")]
    try:
        tokens = shlex.split(entry)
    except ValueError as e:
        return None, [], [ConfigError(f"{where} {entry!r}: {e}")]
    if not tokens:
        return None, [], [ConfigError(f"an empty {where}", hint='write e.g. --candidate "ram+ r=0.01..0.5:log"')]
    raw, problems = [], []
    for tok in tokens[1:]:
        key, sep, values = tok.partition("=")
        if not sep or not key or not values:
            problems.append(ConfigError(f"{where} {entry!r}: {tok!r} is not KEY=LO..HI, KEY=V1,V2 or KEY=V",
                                        hint='e.g. --candidate "ties density=0.05..0.9 scaling=0.5,1.0"'))
        else:
            raw.append((key.strip(), values))
    return tokens[0], raw, problems


def _dim(key: str, value: Any, hints: Mapping[str, Any], method: str, where: str) -> Dim:
    """One parameter's dim: a range (``LO..HI[:log]`` text), a list (text with commas, or a YAML list), or a value."""
    if key != "seed" and key.replace("-", "_") not in hints:
        raise ConfigError(f"{where}: unknown parameter {key!r} for method {method!r}",
                          hint=f"known parameters: {', '.join(hints) or 'none'}")
    if isinstance(value, str) and ".." in value:
        return _range(key, value, _numeric(key, hints), where)
    if isinstance(value, str):
        values = tuple(_value(v) for v in _split(value))
    else:
        values = tuple(value) if isinstance(value, list) else (value,)
    if len(set(map(_text, values))) != len(values):
        raise ConfigError(f"{where}: {key}={value}: a value is given twice")
    return Dim(key, "choice" if len(values) > 1 else "fixed", values)


def _numeric(key: str, hints: Mapping[str, Any]) -> type | None:
    """The number type a range of ``key`` is sampled as: int where the parameter is an int (and the seed), float
    where it takes a float (a per-agent parameter's one value for every agent); None where it takes no number."""
    if key == "seed":
        return int
    hint = hints[key.replace("-", "_")]
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return float if float in args else int if int in args else None


def _range(key: str, text: str, kind: type | None, where: str) -> Dim:
    body, colon, scale = text.strip().rpartition(":") if text.strip().endswith(":log") else (text, "", "")
    lo_text, _, hi_text = body.partition("..")
    what = f"{where}: {key}={text}"
    if kind is None:
        raise ConfigError(f"{what}: {key} takes no number, so it has no range",
                          hint=f"give its values as a list ({key}=a,b)")
    try:
        lo, hi = (coerce(t.strip(), kind) for t in (lo_text, hi_text))
        if not all(math.isfinite(x) for x in (lo, hi)):
            raise ValueError("the ends must be finite")
    except (TypeError, ValueError, OverflowError) as e:
        noun = "whole numbers (the parameter is an int)" if kind is int else "numbers"
        raise ConfigError(f"{what}: the ends of a range are {noun}: {e}",
                          hint="write KEY=LO..HI, or KEY=LO..HI:log for a log scale") from None
    if not lo < hi:
        raise ConfigError(f"{what}: a range needs LO < HI", hint=f"give one value ({key}={_num(lo)}) to fix it")
    if colon and lo <= 0:
        raise ConfigError(f"{what}: a log-scale range needs LO > 0")
    return Dim(key, "int" if kind is int else "float", (), float(lo), float(hi), bool(colon))


def _check_values(space: Space, where: str) -> list[RLMergeError]:
    """The method's own checks on each value of each parameter (a range's ends, a list's values, a fixed value): a
    value is refused when the method refuses it beside every tested value of the others (a range's ends and middle,
    each of a list's values; at most ``CONTEXTS`` combinations), so that a value fine beside some others (DELLA's ε
    beside a middle density) is tried, and a combination it cannot join fails as its trial (search.py)."""
    probes = {d.key: _probes(d) for d in space.dims}
    seen: dict[str, RLMergeError] = {}
    for d in space.dims:
        others = [k for k in probes if k != d.key]
        contexts = list(itertools.islice(itertools.product(*(probes[k] for k in others)), CONTEXTS))
        for v in (probes[d.key][0], probes[d.key][-1]) if d.kind == "float" else probes[d.key]:
            refused: list[tuple[str, RLMergeError]] = []
            for ctx in contexts:
                values = {**dict(zip(others, ctx)), d.key: v}
                try:
                    space.candidate(values).id  # noqa: B018 - parses the parameters (the method's checks)
                    break
                except RLMergeError as e:
                    refused.append((" ".join([space.method, *(f"{k}={_text(x)}" for k, x in values.items())]), e))
            else:
                label, e = refused[0]
                seen.setdefault(e.render(), ConfigError(f"{where}: {label}: {e.render()}"))
    if not Candidate(space.method).random and any(d.key == "seed" and d.kind != "fixed" for d in space.dims):
        seen["seed"] = ConfigError(f"{where}: {space.method} draws nothing at random, so its seed changes nothing",
                                   hint="search seeds only for dare_ta, dare_ties, della, della_linear")
    return list(seen.values())


CONTEXTS = 256  # combinations of the other parameters a value is checked beside


def _probes(d: Dim) -> tuple[Any, ...]:
    """The values a parameter is checked at: a range's ends and middle (ints: rounded), or its values."""
    if d.kind == "float":
        mid = math.sqrt(d.lo * d.hi) if d.log else (d.lo + d.hi) / 2
        return (d.lo, mid, d.hi)
    if d.kind == "int":
        return tuple(dict.fromkeys((int(d.lo), (int(d.lo) + int(d.hi)) // 2, int(d.hi))))
    return d.values
