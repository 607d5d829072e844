"""torch's CPU random numbers without torch: at::mt19937 and ``torch.rand(n, dtype=float32)``, bit for bit.

``torch.Generator().manual_seed(s)`` seeds at::mt19937 (ATen/core/MT19937RNGEngine.h) with init_genrand on the
low 32 bits of ``s`` (``state[0] = seed & 0xffffffff``); ``torch.rand`` on the CPU is a serial loop of
``uniform_real_distribution<float>``: one 32-bit draw per element, ``(x & (2^24 − 1)) · 2^-24`` in float32
(ATen/core/TransformationHelper.h ``uniform_real``), exact, so never 1. tests/test_fastdare.py checks it against
torch for many seeds, lengths and offsets.

A stream is (state [624] uint32, index): index 624 means "twist before the next draw", as a fresh engine.
Everything is unsigned (np.uint64 indices): numba then emits no negative-index wraparound and the tempering
loop vectorises.
"""

from __future__ import annotations

import numpy as np
from numba import njit

STATE = 624
_N = np.uint64(STATE)
_M = 397
_MATRIX_A = np.uint32(0x9908B0DF)
_UMASK = np.uint32(0x80000000)
_LMASK = np.uint32(0x7FFFFFFF)
_LOW24 = np.uint32(0xFFFFFF)
_TWO_M24 = np.float32(2.0**-24)


@njit(nogil=True, cache=True)
def seed(state, s):  # type: ignore[no-untyped-def]
    """init_genrand(s): state [624] uint32 from a 32-bit seed; returns the index of a fresh engine (624)."""
    state[0] = np.uint32(s)
    for j in range(1, STATE):
        prev = np.uint64(state[j - 1])
        state[j] = np.uint32((np.uint64(1812433253) * (prev ^ (prev >> np.uint64(30))) + np.uint64(j))
                             & np.uint64(0xFFFFFFFF))
    return _N


@njit(nogil=True, cache=True)
def _twist(s):  # type: ignore[no-untyped-def]
    """mt19937's next_state: 624 new words (the Cokus/Bellew form torch uses)."""
    one = np.uint32(1)
    for j in range(STATE - _M):
        y = (s[j] & _UMASK) | (s[j + 1] & _LMASK)
        s[j] = s[j + _M] ^ (y >> one) ^ ((s[j + 1] & one) * _MATRIX_A)
    for j in range(STATE - _M, STATE - 1):
        y = (s[j] & _UMASK) | (s[j + 1] & _LMASK)
        s[j] = s[j + _M - STATE] ^ (y >> one) ^ ((s[j + 1] & one) * _MATRIX_A)
    y = (s[STATE - 1] & _UMASK) | (s[0] & _LMASK)
    s[STATE - 1] = s[_M - 1] ^ (y >> one) ^ ((s[0] & one) * _MATRIX_A)


@njit(nogil=True, cache=True)
def skip(state, idx, k):  # type: ignore[no-untyped-def]
    """Advance the stream by ``k`` draws without making them; returns the new index."""
    idx = np.uint64(idx)
    k = np.uint64(k)
    while k > np.uint64(0):
        if idx == _N:
            _twist(state)
            idx = np.uint64(0)
        step = min(_N - idx, k)
        idx += step
        k -= step
    return idx


@njit(nogil=True, cache=True)
def uniform(state, idx, out, m):  # type: ignore[no-untyped-def]
    """out[0:m] = the stream's next m ``torch.rand`` float32 values; returns the new index."""
    idx = np.uint64(idx)
    j = np.uint64(0)
    m = np.uint64(m)
    while j < m:
        if idx == _N:
            _twist(state)
            idx = np.uint64(0)
        run = min(_N - idx, m - j)
        for k in range(run):
            y = state[idx + k]
            y ^= y >> np.uint32(11)
            y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
            y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
            y ^= y >> np.uint32(18)
            out[j + k] = np.float32(np.uint32(y) & _LOW24) * _TWO_M24
        idx += run
        j += run
    return idx
