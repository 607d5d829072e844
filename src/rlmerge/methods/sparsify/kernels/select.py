"""numba kernels for the sparsify-then-combine baselines (TIES, Breadcrumbs; engine/fast_select.py runs them).

Two histogram kernels give the exact order statistics of |τ| (the same radix select as methods/_select.py:
one digit of the float32 pattern per round, later rounds inside the bin the earlier ones fixed), and one
kernel does the merge of methods/gta.py element by element: keep window and weights, then the combine rule
(sign election, disjoint mean, scaling, rounding). Every float32 operation is the torch path's, in the same
order, with no fast-math, so the bytes written are identical (tests/test_fastgta.py). ``tau``: None, or the
agents come as their float32 τ (a LoRA adapter among them; codec._tau).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ....kernels.codec import _dec, _f32_as_u32, _tau
from ....kernels.fused import rule_tile
from ....kernels.layout import TILE

_ABS = np.uint32(0x7FFFFFFF)


_CHUNK = 1 << 30  # elements counted in int32 before they are added to the caller's int64 histogram


@njit(nogil=True, cache=True)
def hist_first(base, agents, lo, hi, hist, tau):  # type: ignore[no-untyped-def]
    """hist[t, bits 30–20 of |τ_t|] += 1 over elements [lo, hi), exact zeros in column BINS[0] instead (round 0
    of methods/_select.py). A non-finite τ lands at or above kernels.NONFINITE_BIN.

    A tile at a time: every agent's keys in a loop that vectorises (the base read once per tile), then counted
    with three agents' increments interleaved, into int32 counts small enough for L1 (2,057 per agent) that are
    added to ``hist`` at the end. A run of zeros (a sparse agent's) would serialise on one counter: its keys go
    round eight spare columns, added to the zeros' column. Measured on a 4.4 M-element ``down_proj`` of the 0.5B
    set, one thread (benchmarks/select_kernels.py): 1.7 ns per element for three agents, where sub-histograms of
    int64 counted agent by agent took 2.5 (docs/benchmarks.md).
    """
    n = len(agents)
    bins = hist.shape[1] - 1
    zero0 = np.uint32(bins)
    local = np.zeros((n, bins + 8), dtype=np.int32)
    keys = np.empty((n, TILE), dtype=np.uint32)
    for chunk in range(np.uint64(lo), np.uint64(hi), np.uint64(_CHUNK)):
        end = min(np.uint64(hi), chunk + np.uint64(_CHUNK))
        for start in range(chunk, end, np.uint64(TILE)):
            m = min(np.uint64(TILE), end - start)
            for t in range(n):
                a = agents[t]
                k = keys[t]
                for j in range(m):
                    u = _f32_as_u32(_tau(a, start + j, _dec(base[start + j]), tau)) & _ABS
                    k[j] = (zero0 + (np.uint32(j) & np.uint32(7))) if u == np.uint32(0) else u >> np.uint32(20)
            t = 0
            while t + 3 <= n:
                _count3(local[t], local[t + 1], local[t + 2], keys[t], keys[t + 1], keys[t + 2], m)
                t += 3
            if t + 2 <= n:
                _count3(local[t], local[t + 1], local[t + 1], keys[t], keys[t + 1], keys[t + 1][:0], m)
            elif t < n:
                _count3(local[t], local[t], local[t], keys[t], keys[t][:0], keys[t][:0], m)
        for t in range(n):
            for b in range(bins):
                hist[t, b] += local[t, b]
            for b in range(bins, bins + 8):
                hist[t, bins] += local[t, b]
        local[:] = 0


@njit(nogil=True, cache=True)
def _count3(h0, h1, h2, k0, k1, k2, m):  # type: ignore[no-untyped-def]
    """h_i[k_i[j]] += 1 for j < m, three streams interleaved; a stream with an empty k_i is skipped."""
    if k2.shape[0]:
        for j in range(m):
            h0[k0[j]] += 1
            h1[k1[j]] += 1
            h2[k2[j]] += 1
    elif k1.shape[0]:
        for j in range(m):
            h0[k0[j]] += 1
            h1[k1[j]] += 1
    else:
        for j in range(m):
            h0[k0[j]] += 1


@njit(nogil=True, cache=True)
def hist_next(base, agents, lo, hi, streams, prefix, active, shift, width, hist, tau):  # type: ignore[no-untyped-def]
    """hist[q, digit of |τ_t| at ``shift``, ``width`` bits] += 1 for the elements whose bits above that digit
    equal prefix[q] (t = streams[q]), for the active queries: a later round of methods/_select.py.

    Keys a tile at a time, then counted; the elements outside the query's bin go to 8 spare columns past the
    digit's (hist [Q, 2^width + 8] at least), which keeps the counting loop free of branches.
    """
    mask = np.uint32((1 << width) - 1)
    above = np.uint32(shift + width)
    sh = np.uint32(shift)
    spare = np.uint32(1 << width)
    keys = np.empty(TILE, dtype=np.uint32)
    for q in range(streams.shape[0]):
        if not active[q]:
            continue
        a = agents[streams[q]]
        target = np.uint32(prefix[q])
        h = hist[q]
        for start in range(np.uint64(lo), np.uint64(hi), np.uint64(TILE)):
            m = min(np.uint64(TILE), np.uint64(hi) - start)
            for j in range(m):
                u = _f32_as_u32(_tau(a, start + j, _dec(base[start + j]), tau)) & _ABS
                keys[j] = ((u >> sh) & mask) if (u >> above) == target else spare + (np.uint32(j) & np.uint32(7))
            for j in range(m):
                h[keys[j]] += 1


@njit(nogil=True, cache=True)
def gather_bin(base, agents, lo, hi, offset, streams, prefix, active, above, starts, ends, fill, bits, index, tau):  # type: ignore[no-untyped-def]
    """Append to query q's part of ``bits``/``index`` ([starts[q], ends[q])) the |τ_t| patterns and flat indices
    (``offset`` + element) of the elements [lo, hi) in its bin (pattern >> ``above`` equal to prefix[q], t =
    streams[q]), for the active queries; fill[q] counts what was found, also past ends[q], which is never written.
    What methods/_select.KthLargest.finish ends a selection with instead of its remaining rounds."""
    sh = np.uint32(above)
    keys = np.empty(TILE, dtype=np.uint32)
    for q in range(streams.shape[0]):
        if not active[q]:
            continue
        a = agents[streams[q]]
        target = np.uint32(prefix[q])
        at = starts[q] + fill[q]
        end = ends[q]
        for start in range(np.uint64(lo), np.uint64(hi), np.uint64(TILE)):
            m = min(np.uint64(TILE), np.uint64(hi) - start)
            for j in range(m):  # the patterns a tile at a time, in a loop that vectorises (as hist_next)
                keys[j] = _f32_as_u32(_tau(a, start + j, _dec(base[start + j]), tau)) & _ABS
            for j in range(m):
                u = keys[j]
                if (u >> sh) == target:
                    if at < end:
                        bits[at] = u
                        index[at] = np.int64(offset) + np.int64(start + j)
                    at += 1
        fill[q] = at - starts[q]


@njit(nogil=True, cache=True)
def bin_kth(bits, start, fill, rank, prefix, above):  # type: ignore[no-untyped-def]
    """(pattern, greater, equal) of the ``rank``-th largest (1 = largest) of a gathered bin: uint32 |τ| patterns whose
    bits from ``above`` up equal ``prefix``, part k (a compute thread's) in bits[k, start:start + fill[k]]. The rounds
    of methods/_select.py that the gather replaced, run on the bin in memory, one 10-bit digit per pass (``above``
    is 20 or 10), with how many of the bin's values exceed the answer and how many equal it: _select.GatheredBins'
    answer (a partition there)."""
    hist = np.zeros(1 << 10, dtype=np.int64)
    value = np.int64(prefix) << above
    greater = np.int64(0)
    left = np.int64(rank)
    digit = 0
    shift = above - 10
    while shift >= 0:
        hist[:] = 0
        fixed = value >> (shift + 10)
        for k in range(len(fill)):
            for j in range(start, start + fill[k]):
                x = np.int64(bits[k, j])
                if (x >> (shift + 10)) == fixed:
                    hist[(x >> shift) & 1023] += 1
        digit = 1023
        while digit > 0 and hist[digit] < left:  # the first digit from the top whose count reaches the rank
            left -= hist[digit]
            greater += hist[digit]
            digit -= 1
        value |= np.int64(digit) << shift
        shift -= 10
    return value, greater, hist[digit]


@njit(nogil=True, cache=True)
def bin_tie(bits, index, start, fill, pattern, left):  # type: ignore[no-untyped-def]
    """(count, at): how many values of a gathered bin (parts as in ``bin_kth``, flat indices beside them in
    ``index``) equal ``pattern``, and the flat index of the ``left``-th of them in flat order (−1 when left ≤ 0 or
    fewer are there): _select.GatheredBins.tie.

    A tensor of one block is gathered in flat order (part k is the block's k-th slice): its ties are met in
    order, and the left-th is the left-th met, with no partition of their indices (the main thread waits for
    this). Parts in another order (a tensor of several blocks) gather the ties' indices and take the left-th
    smallest of them (``_kth_smallest``)."""
    count = 0
    ordered = True
    last = np.int64(-1)
    for k in range(len(fill)):
        for j in range(start, start + fill[k]):
            if bits[k, j] == pattern:
                count += 1
                ordered = ordered and index[k, j] > last
                last = index[k, j]
    if left <= 0 or count < left:
        return count, np.int64(-1)
    if ordered:
        seen = 0
        for k in range(len(fill)):
            for j in range(start, start + fill[k]):
                if bits[k, j] == pattern:
                    seen += 1
                    if seen == left:
                        return count, index[k, j]
    ties = np.empty(count, dtype=np.int64)
    at = 0
    for k in range(len(fill)):
        for j in range(start, start + fill[k]):
            if bits[k, j] == pattern:
                ties[at] = index[k, j]
                at += 1
    return count, _kth_smallest(ties, left)


@njit(nogil=True, cache=True)
def _kth_smallest(values, k):  # type: ignore[no-untyped-def]
    """The k-th smallest (1 ≤ k ≤ len) of int64 ``values``: the least v with at least k values ≤ v, by bisecting
    the values' range (≤ 64 counting passes). np.partition gives the same value, but numba compiled it (and the
    np.unique its argument check calls) in ~10 s, half of a TIES merge's first compile (2-core AMD EPYC)."""
    lo = values[0]
    hi = values[0]
    for v in values:
        lo = min(lo, v)
        hi = max(hi, v)
    while lo < hi:
        mid = lo + (hi - lo) // 2  # no overflow: hi − lo ≥ 0 fits, the indices being ≥ 0
        count = 0
        for v in values:
            count += v <= mid
        if count >= k:
            hi = mid
        else:
            lo = mid + 1
    return lo


@njit(nogil=True, cache=True)
def tie_scan(base, agents, lo, hi, t, thr, left, tau):  # type: ignore[no-untyped-def]
    """(count, index) over elements [lo, hi) of agent t, in flat order: the values with |τ_t| = thr counted until
    the ``left``-th is met, and that one's index (−1: fewer than ``left`` here, ``count`` of them).
    methods/_select.TieCut.feed's scan, without decoding the block into float32 copies."""
    a = agents[t]
    count = np.int64(0)
    if left <= 0:  # nothing more to keep
        return count, np.int64(-1)
    for j in range(np.uint64(lo), np.uint64(hi)):
        if abs(_tau(a, j, _dec(base[j]), tau)) == thr:
            count += 1
            if count == left:
                return count, np.int64(j)
    return count, np.int64(-1)


@njit(nogil=True, cache=True)
def _tile(base, agents, lo, m, keep_lo, keep_hi, cut, offset, w, consts, agent_consts, key, out, wtd, b32, tau):  # type: ignore[no-untyped-def]
    zero = np.float32(0.0)
    one = np.float32(1.0)
    for j in range(m):
        b32[j] = _dec(base[lo + j])
    for t in range(len(agents)):  # prune_block, then · w_t: τ · keep · w_t (× 0.0 keeps the sign of zero)
        lt, ht, wt = keep_lo[t], keep_hi[t], w[t]
        at = agents[t]
        row = wtd[t]
        # |τ| = lt is kept at flat indices below cut[t] (exact k; NO_CUT: always): the tile's elements before
        # ``split``. Two loops with no index test in them: the kernel took 2.48 ns an element where one loop
        # testing the index took 2.92 (layer 3's down_proj of the 0.5B set, 3 agents, one thread)
        split = np.int64(min(max(cut[t] - (np.int64(offset) + np.int64(lo)), np.int64(0)), np.int64(m)))
        for j in range(split):
            x = _tau(at, lo + np.uint64(j), b32[j], tau)
            a = abs(x)
            row[j] = (x * (one if (a >= lt) & (a <= ht) else zero)) * wt
        for j in range(split, np.int64(m)):
            x = _tau(at, lo + np.uint64(j), b32[j], tau)
            a = abs(x)
            row[j] = (x * (one if (a > lt) & (a <= ht) else zero)) * wt
    combine(b32, wtd, m, consts, agent_consts, key, out[lo:lo + m])


@njit(nogil=True, cache=True)
def combine(b32, wtd, m, consts, agent_consts, key, out):  # type: ignore[no-untyped-def]
    """out[:m] = the combine step (gta.combine_rule: sign election, (disjoint) mean, scaling, rounding) of the
    base b32 and the pruned, rescaled, weighted τ wtd [N, ≥ m], through the rule's generated loop (``key``: its
    τ-form fused.ProgramKey; consts, agent_consts: ``Program.arrays``). Shared with dare.py."""
    rule_tile(b32, wtd, np.uint64(0), np.uint64(m), consts, agent_consts, out, None, None, np.float32(0.0), None,
              None, key)


@njit(nogil=True, cache=True)
def merge_range(base, agents, lo, hi, keep_lo, keep_hi, cut, offset, w, consts, agent_consts, key, out, tau):  # type: ignore[no-untyped-def]
    """Elements [lo, hi) of one block: θ₀ + combine(prune(τ) · w) into out [n]; see gta.py. ``agents``: a tuple
    of N arrays [n]; cut [N] int64 and ``offset`` (the block's first flat index in its tensor): TIES' exact k
    (methods/_select.TieCut); consts, agent_consts, key: the combine step's (``combine``)."""
    wtd = np.empty((len(agents), TILE), dtype=np.float32)
    b32 = np.empty(TILE, dtype=np.float32)
    for start in range(lo, hi, TILE):
        m = min(TILE, hi - start)
        _tile(base, agents, np.uint64(start), np.uint64(m), keep_lo, keep_hi, cut, np.int64(offset), w, consts,
              agent_consts, key, out, wtd, b32, tau)
