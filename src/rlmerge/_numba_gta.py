"""numba kernels for the sparsify-then-combine baselines (TIES, Breadcrumbs; see kernels.py and fastgta.py).

Two histogram kernels give the exact order statistics of |τ| (the same two-level radix select as
methods/_select.py: high 16 bits of the float32 pattern, then the low 16 bits inside one bin), and one
kernel does the merge rule of methods/gta.py element by element: keep window, weights, sign election,
disjoint mean, scaling, rounding. Every float32 operation is the torch path's, in the same order, with no
fast-math, so the bytes written are identical (tests/test_fastgta.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._numba_kernels import _dec, _f32_as_u32, _put
from .kernels import TILE

_ABS = np.uint32(0x7FFFFFFF)
_SIXTEEN = np.uint32(16)
_LOW = np.uint32(0xFFFF)


@njit(nogil=True, cache=True)
def hist_hi(base, agents, lo, hi, hist):  # type: ignore[no-untyped-def]
    """hist[t, high 16 bits of |τ_t|] += 1 over elements [lo, hi); True when a τ is not finite."""
    bad = False
    for t in range(agents.shape[0]):
        row = hist[t]
        for j in range(lo, hi):
            x = _dec(agents[t, j]) - _dec(base[j])
            bad |= not np.isfinite(x)
            row[(_f32_as_u32(x) & _ABS) >> _SIXTEEN] += 1
    return bad


@njit(nogil=True, cache=True)
def hist_lo(base, agents, lo, hi, streams, bins, hist):  # type: ignore[no-untyped-def]
    """hist[q, low 16 bits of |τ_t|] += 1 for the elements whose high bits are bins[q] (t = streams[q])."""
    for q in range(streams.shape[0]):
        t = streams[q]
        target = np.uint32(bins[q])
        row = hist[q]
        for j in range(lo, hi):
            u = _f32_as_u32(_dec(agents[t, j]) - _dec(base[j])) & _ABS
            if (u >> _SIXTEEN) == target:
                row[u & _LOW] += 1


@njit(nogil=True, cache=True)
def _tile(base, agents, lo, m, keep_lo, keep_hi, w, elect, normalize, div, scaling, apply_scaling, out,  # type: ignore[no-untyped-def]
          wtd, b32, total, den, sgn):
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for j in range(m):
        b32[j] = _dec(base[lo + j])
    for t in range(agents.shape[0]):  # prune_block, then · w_t: τ · keep · w_t (× 0.0 keeps the sign of zero)
        lt, ht, wt = keep_lo[t], keep_hi[t], w[t]
        for j in range(m):
            x = _dec(agents[t, lo + j]) - b32[j]
            a = abs(x)
            wtd[t, j] = (x * (one if (a >= lt and a <= ht) else zero)) * wt
    combine_tile(wtd, b32, lo, m, w, elect, normalize, div, scaling, apply_scaling, out, total, den, sgn)


@njit(nogil=True, cache=True)
def combine_tile(wtd, b32, lo, m, w, elect, normalize, div, scaling, apply_scaling, out,  # type: ignore[no-untyped-def]
                 total, den, sgn):
    """out[lo:lo + m] = θ₀ + scaling · combine(u) from u = wtd [N, m] (pruned, rescaled, weighted τ): the sign
    election, (disjoint) mean, scaling and rounding of methods/gta.py ``_merge``. Shared with _numba_dare.py."""
    n_agents = wtd.shape[0]
    zero = np.float32(0.0)
    one = np.float32(1.0)
    if elect:  # elect_sign: +1 where Σ_t w_t τ_t ≥ 0; agree: sign(w_t τ_t) equals it
        for j in range(m):
            sgn[j] = wtd[0, j]
        for t in range(1, n_agents):
            for j in range(m):
                sgn[j] += wtd[t, j]
        for j in range(m):
            sgn[j] = one if sgn[j] >= zero else -one
        for t in range(n_agents):  # agent 0 assigns (0 + v would turn a −0 into +0), the others add
            wt = w[t]
            for j in range(m):
                v = wtd[t, j]
                s = sgn[j]
                mt = one if ((v > zero) & (s > zero)) | ((v < zero) & (s < zero)) else zero  # no branch
                total[j] = v * mt if t == 0 else total[j] + v * mt
                den[j] = wt * mt if t == 0 else den[j] + wt * mt
        if normalize:  # disjoint mean; no agent kept divides by 1
            for j in range(m):
                total[j] = total[j] / (one if den[j] == zero else den[j])
    else:
        for j in range(m):
            total[j] = wtd[0, j]
        for t in range(1, n_agents):
            for j in range(m):
                total[j] += wtd[t, j]
        if normalize:
            for j in range(m):
                total[j] = total[j] / div
    for j in range(m):
        mixed = total[j] * scaling if apply_scaling else total[j]
        _put(out, lo + j, b32[j] + mixed)


@njit(nogil=True, cache=True)
def merge_range(base, agents, lo, hi, keep_lo, keep_hi, w, elect, normalize, div, scaling,  # type: ignore[no-untyped-def]
                apply_scaling, out):
    """Elements [lo, hi) of one block: θ₀ + scaling · combine(prune(τ) · w) into out [n]; see gta.py."""
    n_agents = agents.shape[0]
    wtd = np.empty((n_agents, TILE), dtype=np.float32)
    b32 = np.empty(TILE, dtype=np.float32)
    total = np.empty(TILE, dtype=np.float32)
    den = np.empty(TILE, dtype=np.float32)
    sgn = np.empty(TILE, dtype=np.float32)
    for start in range(lo, hi, TILE):
        m = min(TILE, hi - start)
        _tile(base, agents, np.uint64(start), np.uint64(m), keep_lo, keep_hi, w, elect, normalize, div, scaling,
              apply_scaling, out, wtd, b32, total, den, sgn)
