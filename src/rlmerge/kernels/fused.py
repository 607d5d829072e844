"""The fused block kernel of kernels.py, compiled per number of agents (numba; imported on first use).

One loop over the elements of a tile does everything the torch path does in a dozen whole-block operations:
decode the stored bits, τ_t = θ_t − θ₀, the mask |τ_t| > ε, the merge rule, the rounding to the output dtype,
and (``hist``/``gram`` given) the statistics' pattern code. The agents arrive as a tuple of arrays, so the
number of agents N is part of the argument types: the loop body is generated for that N with the agents
unrolled (``_source``), and every value of an element stays in a register, where a loop over agents of
unknown length would keep the compiler from vectorising across elements (measured on the benchmark machine:
2.9 ns per element against 26 ns for the same rule with an agent loop). numba caches each (N, mode, dtypes)
specialisation on disk.

Every float32 operation is the torch kernel's, in the same order, with no fast-math, so the bytes written are
the torch path's. Only the statistics' Gram matrix is reassociated: float32 sums over a tile of products,
added to float64 sums (relative error ~1e-7; the counts are exact). A tile whose float32 sum of squares is
not finite is recomputed in float64, which is also where a non-finite τ is detected.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from .codec import _f32_as_u32, _u32_as_f32
from .layout import MODE_LINEAR, MODE_RAM, MODE_RAMPLUS, MODE_STATS, MODE_STOCK, MODE_TA, TILE

_BODY = '''
def tile(base, agents, lo, m, eps, lam, w, normalize, div, scaling, out, tau, code, mode):
    zero = np.float32(0.0)
    one = np.float32(1.0)
    two = np.float32(2.0)
{unpack}
    for j in range(m):
        i = lo + j
        b = {dec_base}
{agents}
{rule}
{codes}
'''
_CODES = '''
    for j in range(m):  # the statistics' pattern code, in its own loop: folded into the one above, the
        cd = zero       # compiler stops vectorising some rules (seen with task arithmetic)
{lines}
        code[j] = cd
'''
# Decoding and rounding are written into the loop's source rather than called: a call (or numba's IR
# inlining of one) keeps the loop from vectorising, or worse (miscompiled selects were seen with
# inline="always").
_DECODE = {"uint16": "_u32_as_f32(np.uint32({x}) << np.uint32(16))",  # bfloat16: the high half of a float32
           "float32": "{x}"}
_PUT = {  # float32 → the output dtype, as torch's .to(); one store of a select, never a branch
    "uint16": "        u = _f32_as_u32({v})\n"  # bfloat16: round to nearest, ties to even; NaN → 0x7FC0 (torch's)
              "        r = np.uint16((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))"
              " >> np.uint32(16))\n"
              "        out[i] = np.uint16(0x7FC0) if {v} != {v} else r",
    "float32": "        out[i] = {v}",
}


def _source(n: int, mode: int, collect: bool, base: str = "uint16", agent: str = "uint16",
            out: str = "uint16") -> str:
    """Python source of the tile loop for ``n`` agents (see _BODY); dtypes are the stored numpy names."""
    unpack = [f"    a{t} = agents[{t}]\n    l{t} = lam[{t}]\n    w{t} = w[{t}]" for t in range(n)]
    ram = mode in (MODE_RAM, MODE_RAMPLUS)
    lines = ["        c = zero", "        total = zero", "        uniq = zero"] if ram else []
    for t in range(n):
        lines.append(f"        x{t} = {_DECODE[agent].format(x=f'a{t}[i]')} - b")
        if collect:
            lines.append(f"        tau[{t}, j] = x{t}")
        if ram:  # agent order, as ram_kernel; +0 for an inactive agent changes no sum that has a nonzero term
            lines.append(f"        k{t} = abs(x{t}) > eps")
            lines.append(f"        c += one if k{t} else zero")
            lines.append(f"        total += x{t} if k{t} else zero")
            if mode == MODE_RAMPLUS:
                lines.append(f"        uniq += x{t} * l{t} if k{t} else zero")
        elif mode == MODE_TA:
            lines.append(f"        total {'=' if t == 0 else '+='} x{t} * w{t}")
        elif mode == MODE_LINEAR:
            lines.append(f"        total {'=' if t == 0 else '+='} (b + x{t}) * w{t}")
        elif mode == MODE_STOCK:  # Σ_t θ_t in agent order, as model_stock's merge
            lines.append(f"        total {'=' if t == 0 else '+='} b + x{t}")
    put = _PUT[out].format(v="v")
    rule = {
        MODE_STATS: "",
        MODE_RAM: "        mean = total / (c if c > one else one)\n"
                  "        v = b + (mean if c >= two else total)\n"
                  "        v = b if c == zero else v\n" + put,
        MODE_RAMPLUS: "        mean = total / (c if c > one else one)\n"
                      "        v = b + (mean if c >= two else uniq)\n"  # the single active agent's τ × λ
                      "        v = b if c == zero else v\n" + put,
        # div is 1 when not normalising: x / 1 is x exactly, and a branch here stops the loop vectorising
        MODE_TA: "        v = b + (total / div) * scaling\n" + put,
        MODE_LINEAR: "        v = total / div\n" + put,
        # scaling = the tensor's t, div = N: t · mean_t θ_t + (1 − t) · θ₀
        MODE_STOCK: "        v = scaling * (total / div) + (one - scaling) * b\n" + put,
    }[mode]
    codes = ""
    if collect:  # bit t: agent t changed the element (|τ| > ε); bit N + t: that change is negative
        codes = _CODES.format(lines="\n".join(
            f"        x = tau[{t}, j]\n"
            f"        cd += (np.float32({1 << t}) + (np.float32({1 << (n + t)}) if x < zero else zero))"
            f" if abs(x) > eps else zero" for t in range(n)))
    return _BODY.format(unpack="\n".join(unpack), dec_base=_DECODE[base].format(x="base[i]"),
                        agents="\n".join(lines), rule=rule, codes=codes)


def _tile(base, agents, lo, m, eps, lam, w, normalize, div, scaling, out, tau, code, mode):  # type: ignore[no-untyped-def]
    raise NotImplementedError


@overload(_tile)
def _tile_ov(base, agents, lo, m, eps, lam, w, normalize, div, scaling, out, tau, code, mode):  # type: ignore[no-untyped-def]
    if not isinstance(mode, types.IntegerLiteral) or not isinstance(agents, types.UniTuple):
        return None
    collect = not isinstance(tau, types.NoneType)
    src = _source(agents.count, mode.literal_value, collect, str(base.dtype), str(agents.dtype.dtype), str(out.dtype))
    scope = {"np": np, "_u32_as_f32": _u32_as_f32, "_f32_as_u32": _f32_as_u32}
    exec(src, scope)  # noqa: S102 source built above from constants
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
    For model_stock, which merges with it, and for the rare tile whose float32 sum of squares overflows."""
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
    of one code would otherwise serialise on one counter (measured: 2.1 → 0.9 ns per element at S = 8)."""
    j = 0
    if hist.shape[0] == 8:
        while j + 8 <= m:
            hist[0, np.int64(code[j])] += 1
            hist[1, np.int64(code[j + 1])] += 1
            hist[2, np.int64(code[j + 2])] += 1
            hist[3, np.int64(code[j + 3])] += 1
            hist[4, np.int64(code[j + 4])] += 1
            hist[5, np.int64(code[j + 5])] += 1
            hist[6, np.int64(code[j + 6])] += 1
            hist[7, np.int64(code[j + 7])] += 1
            j += 8
    while j < m:
        hist[0, np.int64(code[j])] += 1
        j += 1


@njit(nogil=True)
def _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, mode):  # type: ignore[no-untyped-def]
    """Elements [lo, hi) tile by tile; statistics into ``hist``/``gram`` unless they are None (compiled out).
    ``exact``: the Gram matrix from float64 products (a method's input, not only the report's)."""
    n_agents = len(agents)
    bad = False
    if hist is None:
        for start in range(lo, hi, TILE):
            m = np.uint64(min(TILE, hi - start))
            # unsigned offsets: indexing then needs no negative-index wraparound, and the loop vectorises
            _tile(base, agents, np.uint64(start), m, eps, lam, w, normalize, div, scaling, out, None, None, mode)
        return bad
    tau = np.empty((n_agents, TILE), dtype=np.float32)
    code = np.empty(TILE, dtype=np.float32)
    gram_t = np.zeros((n_agents, n_agents), dtype=np.float64)
    for start in range(lo, hi, TILE):
        m = np.uint64(min(TILE, hi - start))
        _tile(base, agents, np.uint64(start), m, eps, lam, w, normalize, div, scaling, out, tau, code, mode)
        _hist(code, m, hist)
        gram_t[:] = 0.0
        if exact:
            bad |= _gram64(tau, m, gram_t)
        elif _gram32(tau, m, gram_t):
            gram_t[:] = 0.0
            bad |= _gram64(tau, m, gram_t)
        gram += gram_t
    return bad


# One entry point per merge rule (the rule is compiled in); see kernels.fused_range for the arguments.
@njit(nogil=True, cache=True)
def stats_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_STATS)


@njit(nogil=True, cache=True)
def ram_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_RAM)


@njit(nogil=True, cache=True)
def ramplus_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_RAMPLUS)


@njit(nogil=True, cache=True)
def ta_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_TA)


@njit(nogil=True, cache=True)
def linear_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_LINEAR)


@njit(nogil=True, cache=True)
def stock_range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact):  # type: ignore[no-untyped-def]
    return _range(base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact, MODE_STOCK)


RANGES = {MODE_STATS: stats_range, MODE_RAM: ram_range, MODE_RAMPLUS: ramplus_range, MODE_TA: ta_range,
          MODE_LINEAR: linear_range, MODE_STOCK: stock_range}
