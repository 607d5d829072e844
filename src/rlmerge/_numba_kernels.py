"""The numba implementation of kernels.py (imported on first use: numba costs a second and ~50 MB to import)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .kernels import MODE_LINEAR, MODE_RAM, MODE_TA, TILE


@intrinsic
def _u32_as_f32(typingctx, x):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen

@intrinsic
def _f32_as_u32(typingctx, x):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen

def _dec(v):  # type: ignore[no-untyped-def]  # stored value → float32
    raise NotImplementedError

@overload(_dec)
def _dec_ov(v):  # type: ignore[no-untyped-def]
    if v == types.uint16:  # bfloat16: the high half of a float32
        return lambda v: _u32_as_f32(np.uint32(np.uint32(v) << np.uint32(16)))
    if v == types.float32:
        return lambda v: v
    return None

def _put(out, i, v):  # type: ignore[no-untyped-def]  # float32 → output dtype, as torch's .to()
    raise NotImplementedError

@overload(_put)
def _put_ov(out, i, v):  # type: ignore[no-untyped-def]
    if out.dtype == types.uint16:
        def put_bf16(out, i, v):  # type: ignore[no-untyped-def]
            if v != v:
                out[i] = np.uint16(0x7FC0)  # torch's canonical bf16 NaN
            else:  # round to nearest, ties to even (c10::BFloat16 round_to_nearest_even)
                u = np.int64(_f32_as_u32(v))
                out[i] = np.uint16((u + ((u >> 16) & 1) + 0x7FFF) >> 16)
        return put_bf16
    if out.dtype == types.float32:
        def put_f32(out, i, v):  # type: ignore[no-untyped-def]
            out[i] = v
        return put_f32
    return None

@njit(nogil=True, cache=True, fastmath=True)
def _gram(tau, m, gram):  # type: ignore[no-untyped-def]
    """gram[a, q] += Σ_j τ_a τ_q over the tile (a ≤ q), float64; reassociated (fast-math) for SIMD."""
    n_agents = tau.shape[0]
    for a in range(n_agents):
        for q in range(a, n_agents):
            acc = 0.0
            for j in range(m):
                acc += np.float64(tau[a, j]) * np.float64(tau[q, j])
            gram[a, q] += acc

@njit(nogil=True, cache=True)
def _tile(base, agents, lo, m, eps, mode, lam, use_lam, w, normalize, div, scaling, out,  # type: ignore[no-untyped-def]
          collect, hist, gram, tau, b32, cnt, code, total, uniq):
    """Elements [lo, lo + m) in stages over the tile, each a loop the compiler vectorises. True if non-finite τ."""
    n_agents = agents.shape[0]
    zero = np.float32(0.0)
    bad = False
    for j in range(m):
        b32[j] = _dec(base[lo + j])
        cnt[j] = 0
        code[j] = 0
        total[j] = zero
        uniq[j] = zero
    none = np.int32(0)
    for t in range(n_agents):
        lt = lam[t]
        changed, negative = np.int32(1 << t), np.int32(1 << (n_agents + t))
        for j in range(m):
            x = _dec(agents[t, lo + j]) - b32[j]
            tau[t, j] = x
            bad |= not np.isfinite(x)
            act = abs(x) > eps
            cnt[j] += np.int32(act)
            # selects of constant bits, not int32 << int64 shifts: the loop vectorises (measured 1.7x)
            code[j] = code[j] | (changed if act else none) | (negative if (act & (x < zero)) else none)
            # agent order, as ram_kernel; +0 for an inactive agent changes no sum that has a nonzero term
            total[j] += x if act else zero
            uniq[j] += x * lt if act else zero
    if collect:
        for j in range(m):
            hist[code[j]] += 1
        _gram(tau, m, gram)
    if mode == MODE_RAM:
        for j in range(m):
            c = cnt[j]
            b = b32[j]
            mean = total[j] / np.float32(max(c, 1))
            one = uniq[j] if use_lam else total[j]  # the single active agent's τ (× λ)
            v = b + (mean if c >= 2 else one)
            _put(out, lo + j, b if c == 0 else v)
    elif mode == MODE_TA:
        for j in range(m):
            total[j] = tau[0, j] * w[0]
        for t in range(1, n_agents):
            wt = w[t]
            for j in range(m):
                total[j] += tau[t, j] * wt
        for j in range(m):
            mixed = total[j] / div if normalize else total[j]
            _put(out, lo + j, b32[j] + mixed * scaling)
    elif mode == MODE_LINEAR:
        for j in range(m):
            total[j] = (b32[j] + tau[0, j]) * w[0]
        for t in range(1, n_agents):
            wt = w[t]
            for j in range(m):
                total[j] += (b32[j] + tau[t, j]) * wt
        for j in range(m):
            _put(out, lo + j, total[j] / div if normalize else total[j])
    return bad

@njit(nogil=True, cache=True)
def fused_range(base, agents, lo, hi, eps, mode, lam, use_lam, w, normalize, div, scaling, out,  # type: ignore[no-untyped-def]
                collect, hist, gram):
    """Elements [lo, hi) of one block: base [n], agents [N, n] stored values; out [n] merged (mode ≠ STATS).

    Runs without the GIL, so threads run ranges of a block in parallel. hist [4^N] int64 and
    gram [N, N] float64 accumulate when ``collect``. Returns True when a τ is not finite.
    """
    n_agents = agents.shape[0]
    tau = np.empty((n_agents, TILE), dtype=np.float32)
    b32 = np.empty(TILE, dtype=np.float32)
    cnt = np.empty(TILE, dtype=np.int32)
    code = np.empty(TILE, dtype=np.int32)
    total = np.empty(TILE, dtype=np.float32)
    uniq = np.empty(TILE, dtype=np.float32)
    bad = False
    for start in range(lo, hi, TILE):
        m = min(TILE, hi - start)
        # unsigned offsets: indexing then needs no negative-index wraparound, and the loops vectorise
        bad |= _tile(base, agents, np.uint64(start), np.uint64(m), eps, mode, lam, use_lam, w, normalize, div,
                     scaling, out, collect, hist, gram, tau, b32, cnt, code, total, uniq)
    return bad
