"""The fused block kernel: a method's elementwise rule (methods/rule.py), compiled per number of agents (numba).

One loop over a tile decodes the stored bits, computes τ_t, runs the rule's operations with the agents unrolled
(so it vectorises), rounds to the output dtype and (``hist``/``gram`` given) adds the statistics; with ``kept``
given, a second loop over the tile, still in cache, counts what the written values kept of a rescale of unique
elements (engine/survival.py). Each program is
compiled per dtypes and cached on disk under its content's key (``Program.key``): a changed rule is a new kernel,
never a stale one. Only the statistics' Gram sums are reassociated (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from numba import njit, types
from numba.extending import NativeValue, models, overload, register_model, typeof_impl, unbox

from ..methods.rule import BINARY, Program
from . import codec
from .codec import _f32_as_u32, _u32_as_f32, put_lines
from .layout import TILE

PROGRAMS: dict[int, Program] = {}  # Program.key → program, registered before its kernel is called
STATS_ONLY = 0  # the key of "no rule": the statistics pass's kernel
_FLUSH = 1 << 30  # elements whose pattern counts an int32 sub-histogram holds before they are added to the caller's


class ProgramKey:
    """A program's key as a kernel argument: its numba type carries the key, so the dispatcher picks the
    program's compiled specialisation from the argument types alone. (``numba.literally`` on an int did the
    same, but sent every call through the dispatcher's compile path: 3.3 ms per call, measured, which made a
    0.5B merge 2.4× slower.) ``tau``: the agents come as their float32 τ, not as stored values (a LoRA
    adapter supplies τ; stream/fast.py then gives every agent's)."""

    __slots__ = ("key", "tau")

    def __init__(self, key: int, tau: bool = False) -> None:
        self.key = key
        self.tau = tau


# The loop's source comes from this file and codec.py; numba's cache of a kernel that calls it (this file's, a
# family's own kernels') is keyed by the caller's file only. Both files' hash is part of the key's type, so an
# edited generator or rounding is a new specialisation, never a stale one.
_STAMP = hashlib.sha256(Path(__file__).read_bytes() + Path(codec.__file__).read_bytes()).hexdigest()[:12]


class ProgramKeyType(types.Opaque):
    def __init__(self, key: int, tau: bool) -> None:
        self.program = key
        self.tau = tau
        super().__init__(name=f"RuleProgram({key}, {'tau' if tau else 'stored'}, source {_STAMP})")


@typeof_impl.register(ProgramKey)
def _typeof_key(val, c):  # type: ignore[no-untyped-def]
    return ProgramKeyType(val.key, val.tau)


register_model(ProgramKeyType)(models.OpaqueModel)


@unbox(ProgramKeyType)
def _unbox_key(typ, obj, c):  # type: ignore[no-untyped-def]
    return NativeValue(c.context.get_dummy_value())  # nothing to pass: the type is the key

_BODY = '''
def tile(base, agents, lo, m, consts, agent_consts, out, tau, code, eps, rescaled, kept, key):
    zero = np.float32(0.0)
{unpack}
{hoisted}
    for j in range(m):
        i = lo + j
        b = {dec_base}
{agents}
{rule}
{codes}
{kept}
'''
# What the written tile kept of a rescale of unique elements (engine/survival.py; MethodSpec.unique_scale): the
# unrescaled value of an element only agent t changed is b + τ_t, the rule writes b + λ_t τ_t there. Where λ_t ≠ 1
# (rescaled[t]), count such elements (n_t) and those whose written value differs, as a value, from the unrescaled
# one rounded to the output dtype (k_t). The unrescaled value is the active agents' sum in order,
# b + (0 + Σ changed τ), which is b + τ_t where only agent t changed the element.
# Counts are int32 sums per tile (at most 1,024 elements; float32 sums would not vectorise without reassociation).
_KEPT = '''
{zeros}
    for j in range(m):  # in its own loop, like the codes: the rule's loop keeps vectorising
        i = lo + j
        b = {dec_base}
{agents}
{changed}
        one = np.int32(({count}) == 1)
{ram}
        differs = np.int32({dec_ram} != {dec_out})
{sums}
{stores}
'''
_CODES = '''
    for j in range(m):  # the statistics' pattern code, in its own loop: folded into the one above, the
        cd = np.int32(0)  # compiler stops vectorising some rules (seen with task arithmetic)
{lines}
        code[j] = cd
'''
# Decoding and rounding are written into the loop's source rather than called: a call (or numba's IR
# inlining of one) keeps the loop from vectorising, or worse (miscompiled selects were seen with
# inline="always"). The rounding's text is codec.PUT_SOURCE.
_DECODE = {"uint16": "_u32_as_f32(np.uint32({x}) << np.uint32(16))",  # bfloat16: the high half of a float32
           "float32": "{x}"}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/", "gt": ">", "ge": ">=", "lt": "<", "le": "<=",
           "eq": "==", "ne": "!=", "and": "&", "or": "|"}
_UNARY = {"neg": "-{}", "not": "not {}", "abs": "abs({})"}


def _f32_source(value: float) -> str:
    """Source for the float32 ``value`` exactly: its bit pattern, reinterpreted (``_u32_as_f32``), with the value in a
    comment. Python's repr of a float is not source for every value (``inf``, ``nan``)."""
    bits = int(np.array(value, dtype=np.float32).view(np.uint32))
    return f"_u32_as_f32(np.uint32({bits:#010x}))  # {float(np.float32(value))!r}"


def _program_lines(p: Program) -> tuple[list[str], list[str], str]:
    """(lines before the loop, lines in it, the merged value's variable): one line per program operation."""
    hoisted, body, names = [], [], []
    for i, op in enumerate(p.ops):
        v = f"v{i}"
        args = [names[j] for j in op.args] if op.name not in ("base", "tau", "lit", "const", "agent") else []
        if op.name == "base":
            v = "b"
        elif op.name == "tau":
            v = f"x{op.args[0]}"
        elif op.name == "lit":  # by its bits: exact for every float32, inf and nan too (repr would say `inf`)
            hoisted.append(f"    {v} = {_f32_source(op.args[0])}")
        elif op.name == "const":
            hoisted.append(f"    {v} = consts[{p.consts.index(op.args[0])}]")
        elif op.name == "agent":
            hoisted.append(f"    {v} = agent_consts[{p.agent_consts.index(op.args[0])}, {op.args[1]}]")
        elif op.name in BINARY:
            body.append(f"        {v} = {args[0]} {_SYMBOL[op.name]} {args[1]}")
        elif op.name in _UNARY:
            body.append(f"        {v} = {_UNARY[op.name].format(args[0])}")
        elif op.name == "where":  # a select, not a branch: both sides are computed
            body.append(f"        {v} = {args[1]} if {args[0]} else {args[2]}")
        else:
            raise ValueError(f"no numba form for the rule operation {op.name!r}")
        names.append(v)
    return hoisted, body, names[p.out]


def source(n: int, key: int, collect: bool, base: str = "uint16", agent: str = "uint16", out: str = "uint16",
           kept: bool = False, tau: bool = False) -> str:
    """Python source of the tile loop for ``n`` agents running program ``key`` (STATS_ONLY: none); dtypes are
    the stored numpy names; ``kept``: also count what the written tile kept of a rescale (_KEPT); ``tau``: the
    agents' arrays hold τ itself (float32), not stored values."""
    unpack = [f"    a{t} = agents[{t}]" for t in range(n)]
    lines = [f"        x{t} = a{t}[i]" if tau else f"        x{t} = {_DECODE[agent].format(x=f'a{t}[i]')} - b"
             for t in range(n)]
    if collect:
        lines += [f"        tau[{t}, j] = x{t}" for t in range(n)]
    hoisted: list[str] = []
    rule = ""
    if key != STATS_ONLY:
        hoisted, body, result = _program_lines(PROGRAMS[key])
        rule = "\n".join([*body, put_lines(out, result, "        ")])
    codes = ""
    if collect:  # bit t: agent t changed the element (|τ| > ε); bit N + t: that change is negative
        codes = _CODES.format(lines="\n".join(
            f"        x = tau[{t}, j]\n"
            f"        cd += (np.int32({1 << t}) + (np.int32({1 << (n + t)}) if x < zero else np.int32(0)))"
            f" if abs(x) > eps else np.int32(0)" for t in range(n)))
    counted = ""
    if kept and key != STATS_ONLY:
        ts = range(n)
        counted = _KEPT.format(
            zeros="\n".join(f"    r{t} = np.int32(rescaled[{t}])\n    n{t} = np.int32(0)\n    k{t} = np.int32(0)"
                            for t in ts),
            dec_base=_DECODE[base].format(x="base[i]"), agents="\n".join(lines[:n]),
            changed="\n".join(f"        c{t} = np.int32(abs(x{t}) > eps)" for t in ts),
            count=" + ".join(f"c{t}" for t in ts),
            ram="        v = b + (zero" + "".join(f" + (x{t} if c{t} else zero)" for t in ts) + ")\n"
                + put_lines(out, "v", "        ").replace("out[i] = ", "rv = "),
            dec_ram=_DECODE[out].format(x="rv"), dec_out=_DECODE[out].format(x="out[i]"),
            sums="\n".join(f"        o{t} = c{t} & one & r{t}\n        n{t} += o{t}\n"
                           f"        k{t} += o{t} & differs" for t in ts),
            stores="\n".join(f"    kept[{t}, 0] += np.int64(n{t})\n    kept[{t}, 1] += np.int64(k{t})" for t in ts))
    return _BODY.format(unpack="\n".join(unpack), hoisted="\n".join(hoisted), agents="\n".join(lines), rule=rule,
                        dec_base=_DECODE[base].format(x="base[i]"), codes=codes, kept=counted)


def rule_tile(base, agents, lo, m, consts, agent_consts, out, tau, code, eps, rescaled, kept, key):  # type: ignore[no-untyped-def]
    """Elements [lo, lo + m) through the program of ``key``: the generated loop (``source``), callable from any
    kernel. ``agents``: a tuple of N arrays, or with a τ-form key an [N, ≥ lo + m] float32 array (a family's kernel
    combining the τ it pruned, e.g. methods/sparsify's combine rule)."""
    raise NotImplementedError


@overload(rule_tile)
def _tile_ov(base, agents, lo, m, consts, agent_consts, out, tau, code, eps, rescaled, kept, key):  # type: ignore[no-untyped-def]
    if not isinstance(key, ProgramKeyType):
        return None
    if isinstance(agents, types.UniTuple):
        n, agent = agents.count, str(agents.dtype.dtype)
    elif isinstance(agents, types.Array) and agents.ndim == 2 and key.tau:
        n, agent = PROGRAMS[key.program].n, str(agents.dtype)
    else:
        return None
    if key.tau and agent != "float32":
        return None
    src = source(n, key.program, not isinstance(tau, types.NoneType), str(base.dtype), agent, str(out.dtype),
                 kept=not isinstance(kept, types.NoneType), tau=key.tau)
    scope = {"np": np, "_u32_as_f32": _u32_as_f32, "_f32_as_u32": _f32_as_u32}
    exec(src, scope)  # noqa: S102 source built above from a traced program
    return scope["tile"]


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _gram32(tau, m, gram):  # type: ignore[no-untyped-def]
    """gram[a, q] += Σ_j τ_a τ_q over the tile (a ≤ q); True when a sum of squares is not finite."""
    n_agents = tau.shape[0]
    bad = False
    for a in range(n_agents):
        for q in range(a, n_agents):
            acc = np.float32(0.0)
            for j in range(m):
                acc += tau[a, j] * tau[q, j]
            if a == q and not np.isfinite(acc):
                bad = True
            gram[a, q] += np.float64(acc)
    return bad


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _gram64(tau, m, gram):  # type: ignore[no-untyped-def]
    """The tile's Gram matrix from float64 products (exact: a product of two float32 is a float64), summed in
    a vectorised order; True if a τ is not finite (a float64 sum of finite float32 squares cannot overflow).
    For a method that merges with it (MethodSpec.exact_gram), and for the rare tile whose float32 sum of squares
    overflows."""
    n_agents = tau.shape[0]
    bad = False
    for a in range(n_agents):
        for q in range(a, n_agents):
            acc = 0.0
            for j in range(m):
                acc += np.float64(tau[a, j]) * np.float64(tau[q, j])
            if a == q and not np.isfinite(acc):
                bad = True
            gram[a, q] += acc
    return bad


@njit(nogil=True, cache=True)
def _hist(code, m, hist):  # type: ignore[no-untyped-def]
    """hist[k % S, code[k]] += 1 with S = hist.shape[0] sub-histograms (8, or 1 when 4^N bins are many): runs
    of one code would otherwise serialise on one counter (measured: 2.1 → 0.9 ns per element at S = 8). ``hist``
    holds int32 counts of int32 codes, small enough for L1 (fused_range adds them to the caller's int64 ones): with
    float32 codes counted into int64 the statistics kernel took 1.62 ns per element, now 1.38 (medians of five
    alternated runs of benchmarks/select_kernels.py: three agents, one thread, the 0.5B set's layer-3 down_proj)."""
    j = 0
    if hist.shape[0] == 8:
        while j + 8 <= m:
            hist[0, code[j]] += 1
            hist[1, code[j + 1]] += 1
            hist[2, code[j + 2]] += 1
            hist[3, code[j + 3]] += 1
            hist[4, code[j + 4]] += 1
            hist[5, code[j + 5]] += 1
            hist[6, code[j + 6]] += 1
            hist[7, code[j + 7]] += 1
            j += 8
    while j < m:
        hist[0, code[j]] += 1
        j += 1


@njit(nogil=True, cache=True)
def _flush(local, hist):  # type: ignore[no-untyped-def]
    """hist += local (int32 counts into the caller's int64 ones); local zeroed."""
    for s in range(local.shape[0]):
        for c in range(local.shape[1]):
            hist[s, c] += local[s, c]
            local[s, c] = 0


@njit(nogil=True, cache=True)
def fused_range(base, agents, lo, hi, eps, consts, agent_consts, out, hist, gram, exact, rescaled, kept,  # type: ignore[no-untyped-def]
                key):
    """Elements [lo, hi) of one block through the program of ``key`` (a ProgramKey: one specialisation each), tile
    by tile; statistics into ``hist``/``gram`` unless they are None (compiled out). ``exact``: the Gram matrix from
    float64 products (a method's input, not only the report's). ``kept`` [N, 2] (None: compiled out) with
    ``rescaled`` [N]: what the written values kept of a rescale (_KEPT). One function, not a cached wrapper around
    an uncached one: each level of calls is compiled and optimised again (six specialisations of the 0.5B-shaped
    example compiled in 29.4–32.3 s through the wrapper, 16.6–16.9 s as one; 2-core AMD EPYC, cold cache)."""
    n_agents = len(agents)
    bad = False
    if hist is None:
        for start in range(lo, hi, TILE):
            m = np.uint64(min(TILE, hi - start))
            # unsigned offsets: indexing then needs no negative-index wraparound, and the loop vectorises
            rule_tile(base, agents, np.uint64(start), m, consts, agent_consts, out, None, None, eps, rescaled, kept,
                      key)
        return bad
    tau = np.empty((n_agents, TILE), dtype=np.float32)
    code = np.empty(TILE, dtype=np.int32)
    local = np.zeros(hist.shape, dtype=np.int32)  # counted here, added to ``hist`` every 2^30 elements and at the end
    gram_t = np.zeros((n_agents, n_agents), dtype=np.float64)
    counted = 0
    for start in range(lo, hi, TILE):
        m = np.uint64(min(TILE, hi - start))
        rule_tile(base, agents, np.uint64(start), m, consts, agent_consts, out, tau, code, eps, rescaled, kept, key)
        _hist(code, m, local)
        counted += TILE
        if counted >= _FLUSH:
            _flush(local, hist)
            counted = 0
        gram_t[:] = 0.0
        if exact:
            bad |= _gram64(tau, m, gram_t)
        elif _gram32(tau, m, gram_t):
            gram_t[:] = 0.0
            bad |= _gram64(tau, m, gram_t)
        gram += gram_t
    _flush(local, hist)
    return bad
