"""An elementwise merge rule, written once and run by every backend (torch, numba; later CUDA).

A rule is a Python function of ``Terms``: the base value ``b``, each agent's task vector ``x[t]`` (θ_t − θ₀ in
float32) and the method's constants for the tensor (``k.eps``, per agent ``k.lam[t]``). It combines them with
``+ − × ÷``, ``abs``, comparisons, ``& | ~`` and ``where``. Tracing it for N agents gives a program: float32
operations in a fixed order, each operand computed before it is used. The numba backend writes the program into
its element loop; the torch backend applies each operation to whole blocks. Both perform the same IEEE float32
operations in the same order (no fast-math, no fused multiply-add), so they write the same bytes.

>>> def double(k): return k.b + (k.x[0] + k.x[0])
>>> trace(double, 1, (), ()).ops
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_BIN = {"add": "+", "sub": "-", "mul": "*", "div": "/", "gt": ">", "ge": ">=", "lt": "<", "le": "<=",
        "eq": "==", "ne": "!=", "and": "&", "or": "|"}
BOOL_OPS = {"gt", "ge", "lt", "le", "eq", "ne", "and", "or", "not"}


class Expr:
    """A value of the rule being traced (float32, or bool for comparisons)."""

    __slots__ = ("_prog", "ref")

    def __init__(self, prog: _Builder, ref: int) -> None:
        self._prog, self.ref = prog, ref

    def _op(self, name: str, *args: Any) -> Expr:
        return self._prog.op(name, self, *args)

    def __add__(self, o: Any) -> Expr: return self._op("add", o)
    def __radd__(self, o: Any) -> Expr: return self._prog.op("add", o, self)
    def __sub__(self, o: Any) -> Expr: return self._op("sub", o)
    def __rsub__(self, o: Any) -> Expr: return self._prog.op("sub", o, self)
    def __mul__(self, o: Any) -> Expr: return self._op("mul", o)
    def __rmul__(self, o: Any) -> Expr: return self._prog.op("mul", o, self)
    def __truediv__(self, o: Any) -> Expr: return self._op("div", o)
    def __rtruediv__(self, o: Any) -> Expr: return self._prog.op("div", o, self)
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

    def __bool__(self) -> bool:
        raise TypeError("a traced value has no truth value: use where(cond, a, b), not `if`")


@dataclass(frozen=True)
class Op:
    """One operation: ``name`` over ``args`` (indices of earlier ops, or ("lit", float32 value))."""

    name: str  # "base", "tau", "const", "agent_const", "lit", or an operation
    args: tuple[Any, ...] = ()


@dataclass
class Program:
    """A traced rule: operations in evaluation order; ``out`` indexes the merged value."""

    n: int
    ops: list[Op]
    out: int
    consts: tuple[str, ...]
    agent_consts: tuple[str, ...]

    def key(self) -> str:
        """A stable text of the program (for caching compiled kernels by content)."""
        return repr((self.n, self.consts, self.agent_consts, self.out, [(o.name, o.args) for o in self.ops]))


@dataclass
class _Builder:
    n: int
    ops: list[Op] = field(default_factory=list)
    _memo: dict[Op, int] = field(default_factory=dict)

    def leaf(self, name: str, *args: Any) -> Expr:
        return Expr(self, self._add(Op(name, args)))

    def _arg(self, a: Any) -> int:
        if isinstance(a, Expr):
            if a._prog is not self:
                raise ValueError("a value of another rule")
            return a.ref
        if isinstance(a, bool) or not isinstance(a, (int, float, np.floating)):
            raise TypeError(f"rules combine traced values and numbers, not {type(a).__name__}")
        return self._add(Op("lit", (float(np.float32(a)),)))

    def op(self, name: str, *args: Any) -> Expr:
        return Expr(self, self._add(Op(name, tuple(self._arg(a) for a in args))))

    def _add(self, op: Op) -> int:
        got = self._memo.get(op)  # the same operation on the same operands: computed once
        if got is None:
            got = self._memo[op] = len(self.ops)
            self.ops.append(op)
        return got


class Terms:
    """What a rule sees: ``b`` (base), ``x[t]`` (task vectors) and ``k`` (the method's constants)."""

    def __init__(self, prog: _Builder, consts: Sequence[str], agent_consts: Sequence[str]) -> None:
        self.n = prog.n
        self.b = prog.leaf("base")
        self.x = [prog.leaf("tau", t) for t in range(prog.n)]
        self.k = _Consts(prog, consts, agent_consts)
        self._prog = prog

    def where(self, cond: Expr, a: Any, b: Any) -> Expr:
        return self._prog.op("where", cond, a, b)


class _Consts:
    def __init__(self, prog: _Builder, consts: Sequence[str], agent_consts: Sequence[str]) -> None:
        for name in consts:
            setattr(self, name, prog.leaf("const", name))
        for name in agent_consts:
            setattr(self, name, [prog.leaf("agent_const", name, t) for t in range(prog.n)])


def trace(rule: Callable[[Terms], Expr], n: int, consts: Sequence[str], agent_consts: Sequence[str]) -> Program:
    prog = _Builder(n)
    out = rule(Terms(prog, consts, agent_consts))
    if not isinstance(out, Expr):
        raise TypeError("a rule returns the merged value (a traced expression)")
    if prog.ops[out.ref].name in BOOL_OPS:
        raise TypeError("a rule returns a number, not a comparison")
    return Program(n, prog.ops, out.ref, tuple(consts), tuple(agent_consts))


# -- backends ------------------------------------------------------------------------------------------------
def numba_lines(p: Program) -> tuple[list[str], list[str], str]:
    """(lines before the loop, lines in the loop, the merged value's name) for the numba source generator.

    In the loop, ``b`` and ``x{t}`` hold the element's base value and task vectors (float32).
    """
    pre, body, names = [], [], []
    for i, op in enumerate(p.ops):
        v = f"v{i}"
        a = [names[j] for j in op.args] if op.name not in ("lit", "const", "agent_const", "tau") else []
        if op.name == "base":
            v = "b"
        elif op.name == "tau":
            v = f"x{op.args[0]}"
        elif op.name == "lit":
            pre.append(f"    {v} = np.float32({op.args[0]!r})")
        elif op.name == "const":
            pre.append(f"    {v} = consts[{p.consts.index(op.args[0])}]")
        elif op.name == "agent_const":
            pre.append(f"    {v} = agent_consts[{p.agent_consts.index(op.args[0])}, {op.args[1]}]")
        elif op.name in _BIN:
            body.append(f"        {v} = {a[0]} {_BIN[op.name]} {a[1]}")
        elif op.name == "neg":
            body.append(f"        {v} = -{a[0]}")
        elif op.name == "not":
            body.append(f"        {v} = not {a[0]}")
        elif op.name == "abs":
            body.append(f"        {v} = abs({a[0]})")
        elif op.name == "where":
            body.append(f"        {v} = {a[1]} if {a[0]} else {a[2]}")
        else:
            raise ValueError(op.name)
        names.append(v)
    return pre, body, names[p.out]


def torch_eval(p: Program, base: Any, deltas: Any, consts: Sequence[float], agent_consts: Any) -> Any:
    """The program over whole blocks: base [n], deltas [N, n] float32 (torch); consts [C], agent_consts [A, N]."""
    import torch

    dev = base.device

    def scalar(v: float) -> torch.Tensor:
        return torch.tensor(np.float32(v), dtype=torch.float32, device=dev)

    vals: list[Any] = []
    for op in p.ops:
        a = [vals[j] for j in op.args] if op.name not in ("lit", "const", "agent_const", "tau") else []
        name = op.name
        if name == "base":
            r = base
        elif name == "tau":
            r = deltas[op.args[0]]
        elif name == "lit":
            r = scalar(op.args[0])
        elif name == "const":
            r = scalar(consts[p.consts.index(op.args[0])])
        elif name == "agent_const":
            r = scalar(agent_consts[p.agent_consts.index(op.args[0])][op.args[1]])
        elif name == "add":
            r = a[0] + a[1]
        elif name == "sub":
            r = a[0] - a[1]
        elif name == "mul":
            r = a[0] * a[1]
        elif name == "div":
            r = a[0] / a[1]
        elif name == "neg":
            r = -a[0]
        elif name == "abs":
            r = torch.abs(a[0])
        elif name in ("gt", "ge", "lt", "le", "eq", "ne"):
            r = {"gt": torch.gt, "ge": torch.ge, "lt": torch.lt, "le": torch.le, "eq": torch.eq,
                 "ne": torch.ne}[name](a[0], a[1])
        elif name == "and":
            r = a[0] & a[1]
        elif name == "or":
            r = a[0] | a[1]
        elif name == "not":
            r = ~a[0]
        elif name == "where":
            r = torch.where(a[0], a[1], a[2])
        else:
            raise ValueError(name)
        vals.append(r)
    out = vals[p.out]
    return out.expand_as(base) if out.dim() == 0 else out
