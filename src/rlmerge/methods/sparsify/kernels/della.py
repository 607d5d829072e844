"""numba kernels for DELLA's MagPrune: the rank of |τ| in its row and each element's keep probability, as
methods/_ops.row_ranks and methods/gta.prune_block compute them.

A stable ascending rank (ties by position); zeros rank first without sorting, the nonzeros by a counting sort on a
coarse digit of their bits and an insertion sort per bin, or an LSD radix sort when one bin would hold too much.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ....kernels.codec import _dec, _f32_as_u32, _tau

MIN_BINS = 256  # counting-sort bins at least (a sparse row with a wide range of |τ| gets this many)
_ABS = np.uint32(0x7FFFFFFF)
_U0 = np.uint64(0)
_U1 = np.uint64(1)
_BYTE = np.uint32(255)


@njit(nogil=True, cache=True)
def scratch(row):  # type: ignore[no-untyped-def]
    """(work [5, row], hist) uint32: rank_row's scratch for rows of ``row`` elements."""
    return np.empty((5, row), dtype=np.uint32), np.empty(max(2 * row, MIN_BINS) + 1, dtype=np.uint32)


@njit(nogil=True, cache=True)
def _radix(sk, si, tk, ti, nz, hist):  # type: ignore[no-untyped-def]
    """Stable LSD radix sort of (sk, si)[0:nz] by sk, 8 bits a pass; the result ends in sk/si (tk/ti: scratch)."""
    for d in range(4):
        sh = np.uint32(8 * d)
        for v in range(256):
            hist[v] = 0
        for j in range(nz):
            hist[(sk[j] >> sh) & _BYTE] += 1
        if hist[(sk[0] >> sh) & _BYTE] == nz:  # every key has this digit: the pass would change nothing
            continue
        acc = np.uint32(0)
        for v in range(256):
            c = hist[v]
            hist[v] = acc
            acc += c
        for j in range(nz):
            k = sk[j]
            v = (k >> sh) & _BYTE
            p = hist[v]
            tk[p] = k
            ti[p] = si[j]
            hist[v] = p + np.uint32(1)
        for j in range(nz):
            sk[j] = tk[j]
            si[j] = ti[j]


@njit(nogil=True, cache=True)
def _insertion(sk, si, nz, budget):  # type: ignore[no-untyped-def]
    """Stable insertion sort of (sk, si)[0:nz] by sk; False (arrays left a permutation, equal keys still in
    position order) when it would move more than ``budget`` elements."""
    moves = _U0
    for j in range(_U1, nz):
        k = sk[j]
        if k < sk[j - _U1]:
            i = si[j]
            q = j
            while q > _U0 and sk[q - _U1] > k:
                sk[q] = sk[q - _U1]
                si[q] = si[q - _U1]
                q -= _U1
            sk[q] = k
            si[q] = i
            moves += j - q
            if moves > budget:
                return False
    return True


@njit(nogil=True, cache=True)
def rank_row(a, b, lo, row, ranks, off, work, hist, tau):  # type: ignore[no-untyped-def]
    """ranks[off + i] = the rank (0 = smallest) of |dec(a[lo + i]) − dec(b[lo + i])| (``tau`` not None: |a[lo + i]|)
    among the row's ``row`` elements, ties by position: methods/_ops.row_ranks before its division. work, hist:
    ``scratch(row)``."""
    row = np.uint64(row)
    lo = np.uint64(lo)
    off = np.uint64(off)
    keys, nzk, nzi, sk, si = work[0], work[1], work[2], work[3], work[4]
    for i in range(row):  # the keys, in a loop of its own: it vectorises
        keys[i] = _f32_as_u32(_tau(a, lo + i, _dec(b[lo + i]), tau)) & _ABS
    z = _U0
    nz = _U0
    for i in range(row):  # zeros ranked by position; the nonzeros compacted (no branch)
        k = keys[i]
        ranks[off + i] = np.uint32(z)
        nzk[nz] = k
        nzi[nz] = np.uint32(i)
        isz = np.uint64(k == np.uint32(0))
        nz += _U1 - isz
        z += isz
    if nz == _U0:
        return
    kmin = np.uint32(0xFFFFFFFF)
    kmax = np.uint32(0)
    for j in range(nz):
        kmin = min(kmin, nzk[j])
        kmax = max(kmax, nzk[j])
    span = kmax - kmin
    limit = max(np.uint32(2) * np.uint32(nz), np.uint32(MIN_BINS))
    s = np.uint32(0)
    while (span >> s) >= limit:
        s += np.uint32(1)
    bins = np.uint64(span >> s) + _U1
    for v in range(bins):
        hist[v] = 0
    for j in range(nz):
        hist[(nzk[j] - kmin) >> s] += 1
    acc = np.uint32(0)
    for v in range(bins):
        c = hist[v]
        hist[v] = acc
        acc += c
    for j in range(nz):  # counting sort by the coarse digit: stable
        k = nzk[j]
        v = (k - kmin) >> s
        p = hist[v]
        sk[p] = k
        si[p] = nzi[j]
        hist[v] = p + np.uint32(1)
    if not _insertion(sk, si, nz, np.uint64(8) * nz + np.uint64(64)):
        _radix(sk, si, nzk, nzi, nz, hist)
    for j in range(nz):
        ranks[off + si[j]] = np.uint32(z + j)


@njit(nogil=True, cache=True)
def rank_span(base, agents, lo, hi, row, ranks, work, hist, tau):  # type: ignore[no-untyped-def]
    """ranks[t, 0:hi − lo] for the whole rows in [lo, hi) of a block, every agent t."""
    for t in range(len(agents)):
        a = agents[t]
        rt = ranks[t]
        for r0 in range(lo, hi, row):
            rank_row(a, base, r0, row, rt, r0 - lo, work, hist, tau)


@njit(nogil=True, cache=True)
def probs(ranks, off, m, row, plo, p2e, prob):  # type: ignore[no-untyped-def]
    """prob[t, 0:m] = plo[t] + (ranks[t, off:off + m] / (row − 1)) · p2e[t], each step in float32 (plo = density
    − ε and p2e = 2ε, float32): gta.prune_block's MagPrune probability. A row of one element has rank 0."""
    zero = np.float32(0.0)
    rm1 = np.float32(row - 1)
    for t in range(ranks.shape[0]):
        lo_t, e2 = plo[t], p2e[t]
        rt = ranks[t]
        pt = prob[t]
        if row == 1:
            for j in range(m):
                pt[j] = lo_t + zero * e2
        else:
            for j in range(m):
                pt[j] = lo_t + (np.float32(rt[off + j]) / rm1) * e2
