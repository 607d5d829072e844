"""Sizes the kernels and the engine agree on (no numba here: the engine imports this without compiling)."""

from __future__ import annotations

MAX_AGENTS = 8  # 4^N histogram bins per thread: 65536 at N = 8
TILE = 1024  # elements per tile: the scratch of one tile stays in L1/L2
SUBHISTS = 8  # sub-histograms per thread for the pattern codes (1 when 4^N bins would not stay in cache)


def hist_shape(n_agents: int) -> tuple[int, int]:
    bins = 4**n_agents
    return (SUBHISTS if bins <= 4096 else 1), bins
