"""numba kernels for DARE and DELLA: the random drop (mt.py's streams, per chunk), the L1 sums, the merge rule.

Every float32 operation is the torch path's, in its order, with no fast-math (tests/test_fastdare.py and
test_fastdella.py compare the bytes). ``row`` > 0 asks for DELLA's keep probability from the rank of |τ| in its
row (della.py); 0 is DARE. ``tau``: None, or the agents come as their float32 τ (a LoRA adapter among them;
codec._tau).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ....kernels.codec import _dec, _tau
from ....kernels.layout import TILE
from ..rng import RNG_CHUNK as CHUNK
from . import mt
from .della import probs, rank_span, scratch
from .select import combine

RESCALE_NONE, RESCALE_INVERSE, RESCALE_L1 = 0, 1, 2
_CHUNK = np.uint64(CHUNK)
_SEVEN = np.uint64(7)
_U0 = np.uint64(0)
_U1 = np.uint64(1)


@njit(nogil=True, cache=True)
def _start_piece(states, idx, seeds, c, off):  # type: ignore[no-untyped-def]
    """Each agent's stream for chunk c, advanced to element ``off`` of the chunk."""
    for t in range(states.shape[0]):
        idx[t] = mt.skip(states[t], mt.seed(states[t], seeds[t, c]), off)


@njit(nogil=True, cache=True)
def _draw(states, idx, u, m):  # type: ignore[no-untyped-def]
    for t in range(states.shape[0]):
        idx[t] = mt.uniform(states[t], idx[t], u[t], m)


@njit(nogil=True, cache=True)
def _prune_tile(base, agents, lo, m, u, prob, rescale, factor, w, b32, wtd, tau):  # type: ignore[no-untyped-def]
    """wtd[t] = prune_block's τ · keep (keep: u < p, p = prob[t, j]), rescaled (÷ p, or × ``factor``: the L1
    factor, 1 without a rescale, which is exact), · w_t (gta.py ``_merge``). True: τ not finite."""
    zero = np.float32(0.0)
    one = np.float32(1.0)
    bad = False
    for j in range(m):
        b32[j] = _dec(base[lo + j])
    for t in range(len(agents)):
        f, wt = factor[t], w[t]
        ut = u[t]
        pt = prob[t]
        row = wtd[t]
        a = agents[t]
        if rescale == RESCALE_INVERSE:
            for j in range(m):
                x = _tau(a, lo + j, b32[j], tau)
                bad |= not np.isfinite(x)
                row[j] = ((x * (one if ut[j] < pt[j] else zero)) / pt[j]) * wt
        else:
            for j in range(m):
                x = _tau(a, lo + j, b32[j], tau)
                bad |= not np.isfinite(x)
                row[j] = ((x * (one if ut[j] < pt[j] else zero)) * f) * wt
    return bad


@njit(nogil=True, cache=True)
def _scratch(n_agents, row, plo):  # type: ignore[no-untyped-def]
    """(span [2], ranks [N, span], work, hist, prob [N, TILE]; the agents' mt19937 states [N, 624], their indices
    [N] and uniforms u [N, TILE]) for a kernel call; DARE (row 0): prob = plo."""
    size = row * max(1, TILE // row) if row > 0 else 1
    work, hist = scratch(max(row, 1))
    prob = np.empty((n_agents, TILE), dtype=np.float32)
    if row == 0:
        for t in range(n_agents):
            prob[t, :] = plo[t]
    span = np.zeros(2, dtype=np.uint64)  # [lo, hi) of the block whose ranks are held; none yet
    return (span, np.empty((n_agents, size), dtype=np.uint32), work, hist, prob,
            np.empty((n_agents, mt.STATE), dtype=np.uint32), np.empty(n_agents, dtype=np.uint64),
            np.empty((n_agents, TILE), dtype=np.float32))


@njit(nogil=True, cache=True)
def _tile(base, agents, pos, end, row, plo, p2e, span, ranks, work, hist, prob, tau):  # type: ignore[no-untyped-def]
    """The length of the tile at ``pos`` (up to ``end``, inside one span) with its keep probabilities in prob;
    DELLA: ranks the span's rows first when ``pos`` is outside the span held."""
    m = min(np.uint64(TILE), end - pos)
    if row == 0:
        return m
    if pos < span[0] or pos >= span[1]:
        size = np.uint64(row * max(1, TILE // row))
        lo = pos // size * size
        hi = min(lo + size, np.uint64(base.shape[0]))
        rank_span(base, agents, lo, hi, row, ranks, work, hist, tau)
        span[0] = lo
        span[1] = hi
    m = min(m, span[1] - pos)
    probs(ranks, pos - span[0], m, row, plo, p2e, prob)
    return m


@njit(nogil=True, cache=True)
def _setbit(bits, e, v):  # type: ignore[no-untyped-def]
    i = e >> np.uint64(3)
    k = e & _SEVEN
    bits[i] = (bits[i] & ~(np.uint8(1) << k)) | (np.uint8(v) << k)


@njit(nogil=True, cache=True)
def _pack(bits, g, kb, m):  # type: ignore[no-untyped-def]
    """Keep bits of elements [g, g + m) of a tensor from kb[0:m] (0 or 1): element e is bit e & 7 of byte e >> 3.
    Whole bytes are stored, the partial ones at either end set bit by bit (a thread's pieces end at chunk
    boundaries, so no two threads share a byte)."""
    g = np.uint64(g)
    m = np.uint64(m)
    j = _U0
    while j < m and ((g + j) & _SEVEN) != _U0:
        _setbit(bits, g + j, kb[j])
        j += _U1
    while j + np.uint64(8) <= m:
        bits[(g + j) >> np.uint64(3)] = (kb[j] | (kb[j + 1] << 1) | (kb[j + 2] << 2) | (kb[j + 3] << 3)
                                        | (kb[j + 4] << 4) | (kb[j + 5] << 5) | (kb[j + 6] << 6) | (kb[j + 7] << 7))
        j += np.uint64(8)
    while j < m:
        _setbit(bits, g + j, kb[j])
        j += _U1


@njit(nogil=True, cache=True)
def _unpack(mask, g, m, u):  # type: ignore[no-untyped-def]
    """u[t, 0:m] = 0 where agent t kept element g + j (the bits ``_pack`` stored), 1 where it dropped it: u < p then
    replays the keep test (0 < p ≤ 1)."""
    one = np.float32(1.0)
    g = np.uint64(g)
    for t in range(mask.shape[0]):
        bt = mask[t]
        ut = u[t]
        for j in range(np.uint64(m)):
            e = g + j
            ut[j] = one - np.float32((bt[e >> np.uint64(3)] >> (e & _SEVEN)) & np.uint8(1))


@njit(nogil=True, cache=True)
def merge_range(base, agents, lo, hi, start, row, seeds, plo, p2e, rescale, factor, w, consts, agent_consts, key,  # type: ignore[no-untyped-def]
                out, mask, tau):
    """Elements [lo, hi) of a block that starts at element ``start`` of its tensor, cut at chunk boundaries.

    base [n], agents [N, n] stored values (``tau``: τ); seeds [N, chunks of the tensor] uint32 (the low 32 bits of
    _ops.chunk_seed: all that manual_seed keeps); plo, p2e, factor, w [N] float32; consts, agent_consts, key: the
    combine step's (select.combine); out [n]. The keep probability:
    DARE (row 0) plo, the density; DELLA (rows of ``row`` elements, whole rows in the block) plo + ρ̂ · p2e, with
    plo = density − ε and p2e = 2ε. ``mask`` [N, ⌈numel / 8⌉] uint8: the keep bits l1_range stored, used instead
    of drawing and ranking again (only for ``l1``, which needs no p); [N, 0]: none. True: τ not finite.
    """
    n_agents = len(agents)
    stored = mask.shape[1] > 0
    row = 0 if stored else row
    span, ranks, work, hist, prob, states, idx, u = _scratch(n_agents, row, plo)
    wtd = np.empty((n_agents, TILE), dtype=np.float32)
    b32 = np.empty(TILE, dtype=np.float32)
    bad = False
    start = np.uint64(start)
    pos = np.uint64(lo)
    hi = np.uint64(hi)
    while pos < hi:
        c = (start + pos) // _CHUNK
        end = min(hi, (c + np.uint64(1)) * _CHUNK - start)
        if not stored:
            _start_piece(states, idx, seeds, c, start + pos - c * _CHUNK)
        while pos < end:
            m = _tile(base, agents, pos, end, row, plo, p2e, span, ranks, work, hist, prob, tau)
            if stored:
                _unpack(mask, start + pos, m, u)
            else:
                _draw(states, idx, u, m)
            bad |= _prune_tile(base, agents, pos, m, u, prob, rescale, factor, w, b32, wtd, tau)
            combine(b32, wtd, m, consts, agent_consts, key, out[pos:pos + m])
            pos += m
    return bad


@njit(nogil=True, cache=True)
def _lanes_add(v, n, lanes, lane0):  # type: ignore[no-untyped-def]
    """lanes[(lane0 + j) mod 8] += v[j] for j in [0, n), in order: methods/_l1.py's sequential lanes."""
    j = np.uint64(0)
    n = np.uint64(n)
    lane = np.uint64(lane0)
    while j < n and lane != np.uint64(0):  # up to the next multiple of 8
        lanes[lane] += v[j]
        j += np.uint64(1)
        lane = (lane + np.uint64(1)) & _SEVEN
    a0, a1, a2, a3, a4, a5, a6, a7 = lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5], lanes[6], lanes[7]
    while j + np.uint64(8) <= n:  # eight independent chains
        a0 += v[j]
        a1 += v[j + np.uint64(1)]
        a2 += v[j + np.uint64(2)]
        a3 += v[j + np.uint64(3)]
        a4 += v[j + np.uint64(4)]
        a5 += v[j + np.uint64(5)]
        a6 += v[j + np.uint64(6)]
        a7 += v[j + np.uint64(7)]
        j += np.uint64(8)
    lanes[0], lanes[1], lanes[2], lanes[3], lanes[4], lanes[5], lanes[6], lanes[7] = a0, a1, a2, a3, a4, a5, a6, a7
    lane = np.uint64(0)
    while j < n:
        lanes[lane] += v[j]
        j += np.uint64(1)
        lane += np.uint64(1)


@njit(nogil=True, cache=True)
def l1_range(base, agents, lo, hi, start, row, seeds, plo, p2e, carry, part, mask, tau):  # type: ignore[no-untyped-def]
    """The L1 sums of elements [lo, hi) of a block (cut as for merge_range), per piece, in float64 lanes.

    part [2, N, pieces of the block, 8]: the lanes of Σ|τ_t| (row 0) and Σ|τ_t · keep_t| (row 1) of each
    piece; the block's first piece starts from ``carry`` [2, N, 8] (a chunk begun in the previous block).
    ``fold`` then adds the finished chunks in order. ``row``, plo, p2e: as merge_range; the keep bits go to
    ``mask`` unless it has no columns (as merge_range's). True: τ not finite.
    """
    n_agents = len(agents)
    span, ranks, work, hist, prob, states, idx, u = _scratch(n_agents, row, plo)
    b32 = np.empty(TILE, dtype=np.float32)
    va = np.empty(TILE, dtype=np.float64)
    vk = np.empty(TILE, dtype=np.float64)
    kb = np.empty(TILE, dtype=np.uint8)
    store = mask.shape[1] > 0
    zero = np.float64(0.0)
    bad = False
    start = np.uint64(start)
    pos = np.uint64(lo)
    hi = np.uint64(hi)
    first = start // _CHUNK
    while pos < hi:
        c = (start + pos) // _CHUNK
        end = min(hi, (c + np.uint64(1)) * _CHUNK - start)
        piece = c - first
        for r in range(2):
            for t in range(n_agents):
                for k in range(8):
                    part[r, t, piece, k] = carry[r, t, k] if piece == np.uint64(0) else zero
        _start_piece(states, idx, seeds, c, start + pos - c * _CHUNK)
        while pos < end:
            m = _tile(base, agents, pos, end, row, plo, p2e, span, ranks, work, hist, prob, tau)
            _draw(states, idx, u, m)
            for j in range(m):
                b32[j] = _dec(base[pos + j])
            lane0 = (start + pos) & _SEVEN
            for t in range(n_agents):
                pt = prob[t]
                ut = u[t]
                at = agents[t]
                for j in range(m):
                    x = _tau(at, pos + j, b32[j], tau)
                    bad |= not np.isfinite(x)
                    a = np.float64(abs(x))
                    va[j] = a
                    keep = ut[j] < pt[j]
                    vk[j] = a if keep else zero  # |τ · keep|: τ · 0.0 is ±0
                    kb[j] = np.uint8(keep)
                if store:
                    _pack(mask[t], start + pos, kb, m)
                _lanes_add(va, m, part[0, t, piece], lane0)
                _lanes_add(vk, m, part[1, t, piece], lane0)
            pos += m
    return bad


@njit(nogil=True, cache=True)
def fold(part, carry, total, start, stop, numel):  # type: ignore[no-untyped-def]
    """Add the block's finished chunks to total [2, N] in chunk order; an unfinished last chunk's lanes go to
    ``carry`` (zero otherwise). Each chunk: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), as methods/_l1.py."""
    first = start // CHUNK
    last = (stop - 1) // CHUNK
    carry[:] = 0.0
    for c in range(first, last + 1):
        p = c - first
        chunk_end = min((c + 1) * CHUNK, numel)
        for r in range(2):
            for t in range(part.shape[1]):
                ln = part[r, t, p]
                if min(chunk_end, stop) == chunk_end:
                    total[r, t] += ((ln[0] + ln[1]) + (ln[2] + ln[3])) + ((ln[4] + ln[5]) + (ln[6] + ln[7]))
                else:
                    carry[r, t] = ln
