"""An elementwise merge rule, written once and run by every backend (the torch reference, the numba kernels).

A rule is a function ``rule(t, params)`` of ``Terms``: the element's base value ``t.b``, each agent's task
vector ``t.x[i]`` (θ_i − θ₀, float32), the method's per-tensor constants ``t.const.NAME`` and per-agent constants
``t.agent.NAME[i]``, and literals ``t.lit(v)`` (any float32, ±inf included). It combines them with ``+ − × ÷``,
``abs``, comparisons (``.eq`` for ``==``), ``& | ~`` and ``t.where(cond, a, b)``, and returns the merged value.
Built from those: ``t.count(conds)``, ``t.sort(values, where)`` (a sorting network over the agents, those outside
``where`` last) and ``t.kth(values, k, where)`` (an order statistic over the agents a predicate selects).

Tracing it for N agents gives a ``Program``: float32 operations in a fixed order, each operand computed before it
is used, the same operation on the same operands computed once. The numba backend writes the program into its
element loop (kernels/fused.py); ``torch_eval`` applies it to whole blocks. Both perform the same IEEE float32
operations in the same order (no fast-math, no fused multiply-add), so both write the same bytes. A sum is
written as the additions it is, in the order it is written: ``t.lit(0) + a + b`` is not ``a + b`` when a is −0.

>>> def double(t, p):
...     return t.b + (t.x[0] + t.x[0])
>>> [op.name for op in trace(double, None, 1).ops]
['base', 'tau', 'add', 'add']
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

BINARY = ("add", "sub", "mul", "div", "gt", "ge", "lt", "le", "eq", "ne", "and", "or")
COMPARE = ("gt", "ge", "lt", "le", "eq", "ne")
BOOLEAN = (*COMPARE, "and", "or", "not")
LEAVES = ("base", "tau", "const", "agent", "lit")


class Expr:
    """A value of a rule being traced: float32, or a bool from a comparison."""

    __slots__ = ("_b", "ref")

    def __init__(self, builder: _Builder, ref: int) -> None:
        self._b, self.ref = builder, ref

    def _op(self, name: str, *others: Any) -> Expr:
        return self._b.op(name, self, *others)

    def _rop(self, name: str, other: Any) -> Expr:
        return self._b.op(name, other, self)

    def __add__(self, o: Any) -> Expr: return self._op("add", o)
    def __radd__(self, o: Any) -> Expr: return self._rop("add", o)
    def __sub__(self, o: Any) -> Expr: return self._op("sub", o)
    def __rsub__(self, o: Any) -> Expr: return self._rop("sub", o)
    def __mul__(self, o: Any) -> Expr: return self._op("mul", o)
    def __rmul__(self, o: Any) -> Expr: return self._rop("mul", o)
    def __truediv__(self, o: Any) -> Expr: return self._op("div", o)
    def __rtruediv__(self, o: Any) -> Expr: return self._rop("div", o)
    def __neg__(self) -> Expr: return self._op("neg")
    def __abs__(self) -> Expr: return self._op("abs")
    def __gt__(self, o: Any) -> Expr: return self._op("gt", o)
    def __ge__(self, o: Any) -> Expr: return self._op("ge", o)
    def __lt__(self, o: Any) -> Expr: return self._op("lt", o)
    def __le__(self, o: Any) -> Expr: return self._op("le", o)
    def __and__(self, o: Any) -> Expr: return self._op("and", o)
    def __or__(self, o: Any) -> Expr: return self._op("or", o)
    def __invert__(self) -> Expr: return self._op("not")

    def eq(self, o: Any) -> Expr:
        return self._op("eq", o)

    def ne(self, o: Any) -> Expr:
        return self._op("ne", o)

    def __bool__(self) -> bool:
        raise TypeError("a traced value has no truth value: write t.where(cond, a, b), not `if`")


@dataclass(frozen=True)
class Op:
    """One operation: ``name`` over ``args`` (indices of earlier ops; for a leaf, its index or name or value)."""

    name: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Program:
    """A traced rule for ``n`` agents: operations in evaluation order; ``out`` indexes the merged value.

    ``consts`` and ``agent_consts`` name the constants it reads, in the order the backends pass them."""

    n: int
    ops: tuple[Op, ...]
    out: int
    consts: tuple[str, ...]
    agent_consts: tuple[str, ...]

    @functools.cached_property
    def key(self) -> int:
        """A stable 62-bit number for the program's content (compiled kernels are cached by it)."""
        text = repr((self.n, self.consts, self.agent_consts, self.out, [(o.name, o.args) for o in self.ops]))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2

    @functools.cached_property
    def last_use(self) -> list[int]:
        """For each operation, the index of the last operation that reads it (the result: past the end)."""
        last = list(range(len(self.ops)))
        for i, op in enumerate(self.ops):
            if op.name not in LEAVES:
                for j in op.args:
                    last[j] = i
        last[self.out] = len(self.ops)
        return last

    def arrays(self, values: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """The constants as the backends take them: scalars [C] and per-agent values [A, N], float32."""
        missing = [k for k in (*self.consts, *self.agent_consts) if k not in values]
        if missing:
            raise KeyError(f"the rule reads constants the method does not give: {missing}")
        scalars = np.array([np.float32(values[k]) for k in self.consts], dtype=np.float32)
        per_agent = np.array([np.asarray(values[k], dtype=np.float32).reshape(self.n) for k in self.agent_consts],
                             dtype=np.float32).reshape(len(self.agent_consts), self.n)
        return scalars, per_agent


@dataclass
class _Builder:
    n: int
    ops: list[Op] = field(default_factory=list)
    consts: list[str] = field(default_factory=list)
    agent_consts: list[str] = field(default_factory=list)
    _memo: dict[Op, int] = field(default_factory=dict)

    def add(self, op: Op) -> Expr:
        ref = self._memo.get(op)  # the same operation on the same operands is computed once
        if ref is None:
            ref = self._memo[op] = len(self.ops)
            self.ops.append(op)
        return Expr(self, ref)

    def arg(self, a: Any) -> int:
        if isinstance(a, Expr):
            if a._b is not self:
                raise ValueError("a value of another rule")
            return a.ref
        if isinstance(a, bool) or not isinstance(a, (int, float, np.floating, np.integer)):
            raise TypeError(f"a rule combines traced values and numbers, not {type(a).__name__}")
        return self.lit(a).ref

    def lit(self, v: Any) -> Expr:
        return self.add(Op("lit", (float(np.float32(v)),)))

    def op(self, name: str, *args: Any) -> Expr:
        return self.add(Op(name, tuple(self.arg(a) for a in args)))


class _Named:
    """``t.const.NAME`` (a scalar) or ``t.agent.NAME[i]`` (one per agent), recorded as they are first read."""

    def __init__(self, builder: _Builder, per_agent: bool) -> None:
        self._builder, self._per_agent = builder, per_agent

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        b = self._builder
        if not self._per_agent:
            if name not in b.consts:
                b.consts.append(name)
            return b.add(Op("const", (name,)))
        if name not in b.agent_consts:
            b.agent_consts.append(name)
        return [b.add(Op("agent", (name, i))) for i in range(b.n)]


class Terms:
    """What a rule sees: ``b``, ``x[i]``, ``const``, ``agent``, ``lit`` and ``where``."""

    def __init__(self, builder: _Builder) -> None:
        self.n = builder.n
        self.b = builder.add(Op("base"))
        self.x = [builder.add(Op("tau", (i,))) for i in range(builder.n)]
        self.const = _Named(builder, per_agent=False)
        self.agent = _Named(builder, per_agent=True)
        self._builder = builder

    def lit(self, v: float) -> Expr:
        return self._builder.lit(v)

    def where(self, cond: Expr, a: Any, b: Any) -> Expr:
        return self._builder.op("where", cond, a, b)

    def count(self, conds: Sequence[Expr]) -> Expr:
        """How many of ``conds`` hold: 0 + [c₀] + [c₁] + …, in order (an exact small integer in float32)."""
        zero, one = self.lit(0.0), self.lit(1.0)
        total = zero
        for c in conds:
            total = total + self.where(c, one, zero)
        return total

    def sort(self, values: Sequence[Any], where: Sequence[Expr] | None = None) -> list[Expr]:
        """``values`` in ascending order, by a sorting network (``network``: compare-exchanges, each two selects).
        With ``where`` (one condition per value), the values whose condition fails are +inf and come last. Ties keep
        their order; a NaN compares false and stays where the network leaves it (the same on every backend)."""
        inf = self.lit(math.inf)
        vals = [v if where is None else self.where(w, v, inf) for v, w in zip(values, where or values)]
        for i, j in network(len(vals)):
            a, b = vals[i], vals[j]
            swap = b < a
            vals[i], vals[j] = self.where(swap, b, a), self.where(swap, a, b)
        return vals

    def kth(self, values: Sequence[Any], k: Expr | int, where: Sequence[Expr] | None = None) -> Expr:
        """The k-th smallest (0-based) of ``values`` over those whose ``where`` condition holds (every one without
        ``where``): +inf when k reaches their count. ``k``: an int, or an integer-valued expression in [0, N)
        (e.g. from ``count``), chosen per element by selects."""
        ordered = self.sort(values, where)
        if isinstance(k, int):
            return ordered[k]
        out = ordered[-1]
        for j in range(len(ordered) - 2, -1, -1):
            out = self.where(k.eq(float(j)), ordered[j], out)
        return out


def network(n: int) -> list[tuple[int, int]]:
    """The compare-exchanges (i, j), i < j, of Batcher's merge-exchange sort of ``n`` values (Knuth, TAOCP vol. 3,
    5.2.2, Algorithm M): after them, in order, position i holds the i-th smallest. 3 for n = 3, 19 for n = 8."""
    pairs: list[tuple[int, int]] = []
    if n < 2:
        return pairs
    t = (n - 1).bit_length()
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while d > 0:
            pairs += [(i, i + d) for i in range(n - d) if i & p == r]
            d, q, r = q - p, q >> 1, p
        p >>= 1
    return pairs


Rule = Callable[[Terms, Any], Expr]


def trace(rule: Rule, params: Any, n: int) -> Program:
    """The program of ``rule`` with ``params`` for ``n`` agents."""
    builder = _Builder(n)
    out = rule(Terms(builder), params)
    if not isinstance(out, Expr):
        raise TypeError("a rule returns the merged value (a traced expression)")
    if builder.ops[out.ref].name in BOOLEAN:
        raise TypeError("a rule returns a number, not a comparison")
    return Program(n, tuple(builder.ops), out.ref, tuple(builder.consts), tuple(builder.agent_consts))


@functools.lru_cache(maxsize=256)
def program(rule: Rule, params: Any, n: int) -> Program:
    """``trace``, once per (rule, parameters, number of agents)."""
    return trace(rule, params, n)


def torch_eval(p: Program, base: Any, deltas: Any, values: Mapping[str, Any]) -> Any:
    """The program over a block: base [n] and deltas [N, n] float32 (torch, any device) → merged [n] float32.

    The torch reference of every elementwise method: one whole-block operation per program operation, each the
    float32 operation the numba kernel does per element.
    """
    import torch

    scalars, per_agent = p.arrays(values)
    dev = base.device

    def scalar(v: np.float32) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32, device=dev)

    fns: dict[str, Callable[..., Any]] = {
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg, "abs": torch.abs,
        "gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq, "ne": torch.ne,
        "and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not, "where": torch.where}
    last = p.last_use
    vals: list[Any] = []
    for i, op in enumerate(p.ops):
        if op.name == "base":
            v = base
        elif op.name == "tau":
            v = deltas[op.args[0]]
        elif op.name == "lit":
            v = scalar(np.float32(op.args[0]))
        elif op.name == "const":
            v = scalar(scalars[p.consts.index(op.args[0])])
        elif op.name == "agent":
            v = scalar(per_agent[p.agent_consts.index(op.args[0]), op.args[1]])
        else:
            v = fns[op.name](*(vals[j] for j in op.args))
            for j in op.args:  # a block-sized temporary lives only until its last use
                if last[j] == i:
                    vals[j] = None
        vals.append(v)
    out = vals[p.out]
    return out.expand_as(base).clone() if out.dim() == 0 else out
