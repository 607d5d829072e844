"""How much of RAM+'s rescale the output dtype kept: a count over one block, after the fused kernel wrote it.

An element changed by exactly one agent t (|τ_t| > ε) is ``b + τ_t`` in RAM and ``b + λ_t·τ_t`` in RAM+
(methods/ram.py). Where agent t is rescaled in this tensor (λ_t ≠ 1), the element counts as rescaled, and as
kept when the written value differs from RAM's value rounded the same way (compared as values). In bfloat16 a
one-step update × 1.2 often rounds back to RAM's value; in float32 it almost never does.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .codec import _dec, _put


@njit(nogil=True, cache=True)
def survival_range(base, agents, lo, hi, eps, rescaled, out, counts):  # type: ignore[no-untyped-def]
    """counts[t, 0] += agent t's unique elements in [lo, hi) where ``rescaled[t]``; counts[t, 1] += those whose
    ``out`` differs from RAM's value ``b + τ_t`` in out's dtype. base, each agent, out: uint16 (bfloat16 bits)
    or float32; rescaled [N] bool; counts [N, 2] int64."""
    n_agents = len(agents)
    ram = np.empty(1, dtype=out.dtype)
    for i in range(lo, hi):
        b = _dec(base[i])
        who = -1
        x_who = np.float32(0.0)
        for t in range(n_agents):
            x = _dec(agents[t][i]) - b
            if abs(x) > eps:
                who = t if who == -1 else -2
                x_who = x
        if who >= 0 and rescaled[who]:
            counts[who, 0] += 1
            _put(ram, 0, b + x_who)
            if _dec(ram[0]) != _dec(out[i]):  # values, as torch compares them (−0 = +0)
                counts[who, 1] += 1
