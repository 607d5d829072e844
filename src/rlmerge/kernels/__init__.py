"""Fused block kernels (numba): one pass per block reads the stored bytes and writes the output bytes.

The straightforward torch kernels (methods/ram.py, methods/task_arithmetic.py, stats.py) chain a dozen
whole-block operations, each a trip through memory; merging is memory-bound, so these kernels do the same
arithmetic element by element in one loop: decode bf16 → float32, τ_t = θ_t − θ₀, the mask |τ| > ε,
the merge rule, the statistics, and the rounding to the output dtype (_numba_fused.py: the loop is generated for
the number of agents, so it vectorises across elements). They are an optional fast path:
``pip install rlmerge[fast]`` adds numba; without it the torch kernels run. numba is imported (and the kernels
loaded from its on-disk cache, or compiled once) only when a merge takes the fast path. Every float32 operation is
the torch kernel's, in the same order, with no fast-math (no FMA contraction; only the statistics' sums of
products are reassociated), so the bytes written are identical (tests/test_fastpath.py checks it bit for bit).

Statistics are gathered as a histogram of a per-element *pattern code*: bit t set when agent t changed
the element, bit N + t when that change is negative. The 4^N bins give exactly the k-of-N counts, the
pairwise overlaps and the sign agreements (stats.TensorStats.add_patterns), instead of N bincounts and N²/2
sign products. Sums of squares and dot products are summed in float32 over a tile of 1024 elements and in
float64 across tiles; they differ from the torch path's float64 sums by ~1e-7 relative (counts are exact and
equal).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from .layout import (  # noqa: F401  re-exported: the engine's one door to the kernels
    GTA_NONFINITE_BIN,
    MAX_AGENTS,
    MODE_LINEAR,
    MODE_RAM,
    MODE_RAMPLUS,
    MODE_STATS,
    MODE_STOCK,
    MODE_TA,
    SUBHISTS,
    TILE,
    hist_shape,
)

HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def fused_range(mode: int, base: Any, agents: tuple[Any, ...], lo: int, hi: int, eps: Any, lam: Any, w: Any,
                normalize: bool, div: Any, scaling: Any, out: Any, hist: Any, gram: Any, exact: bool = False) -> bool:
    """Elements [lo, hi) of one block through the fused kernel of ``mode``; True when a τ is not finite.

    base [n] and each of the N agents [n]: uint16 (bfloat16 bits) or float32; lam, w [N] float32; eps, div,
    scaling float32 (div = 1 when not normalising); out [n] uint16 or float32 (ignored in MODE_STATS).
    hist [S, 4^N] int64 and gram [N, N] float64 (upper triangle) accumulate the statistics, or are both None:
    then nothing is gathered and no τ is checked (a statistics pass over the same bytes already did).
    ``exact``: gram from float64 products, for a method that merges with it (model_stock); else float32 sums
    over tiles.
    Compiled on first use for each (mode, N, dtypes), cached on disk.
    """
    from .fused import RANGES

    return bool(RANGES[mode](base, agents, lo, hi, eps, lam, w, normalize, div, scaling, out, hist, gram, exact))




def gta_hist_first(*args: Any) -> None:
    """Round 0 of the |τ| selection: hist[t, j % S, digit 0 of |τ_t|] += 1 over [lo, hi) (_numba_gta)."""
    from .select import hist_first

    hist_first(*args)


def gta_hist_next(*args: Any) -> None:
    """A later round: digit counts of the |τ| whose higher digits equal each query's prefix (_numba_gta)."""
    from .select import hist_next

    hist_next(*args)


def gta_merge_range(*args: Any) -> None:
    """The TIES / Breadcrumbs merge rule over [lo, hi) of one block (see _numba_gta.merge_range)."""
    from .select import merge_range

    merge_range(*args)
