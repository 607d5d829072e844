"""Fused block kernels (numba): one pass per block reads the stored bytes and writes the output bytes.

The straightforward torch kernels (methods/ram.py, methods/task_arithmetic.py, stats.py) chain a dozen
whole-block operations, each a trip through memory; merging is memory-bound, so these kernels do the same
arithmetic element by element in one loop: decode bf16 → float32, τ_t = θ_t − θ₀, the mask |τ| > ε,
the merge rule, the statistics, and the rounding to the output dtype. They are an optional fast path:
``pip install rlmerge[fast]`` adds numba; without it the torch kernels run. numba is imported (and the kernels
loaded from its on-disk cache, or compiled once) only when a merge takes the fast path. Every float32 operation is
the torch kernel's, in the same order, with no fast-math (no FMA contraction; only the float64 statistics sums
are reassociated), so the bytes written are
identical (tests/test_fastpath.py checks it bit for bit).

Statistics are gathered as a histogram of a per-element *pattern code*: bit t set when agent t changed
the element, bit N + t when that change is negative. The 4^N bins give exactly the k-of-N counts, the
pairwise overlaps and the sign agreements (stats.TensorStats.add_patterns), instead of N bincounts and N²/2
sign products. Sums of squares and dot products are accumulated in float64 per element; they differ from
the torch path's BLAS summation order in the last bits only (counts are exact and equal).
"""

from __future__ import annotations

import importlib.util
from typing import Any

MODE_STATS, MODE_RAM, MODE_TA, MODE_LINEAR = 0, 1, 2, 3
MAX_AGENTS = 8  # 4^N histogram bins per thread: 65536 at N = 8
TILE = 1024  # elements per tile: the scratch of one tile stays in L1/L2
HAVE_NUMBA = importlib.util.find_spec("numba") is not None


def fused_range(*args: Any) -> bool:
    """Elements [lo, hi) of one block through the fused kernel; True when a τ is not finite.

    Arguments: base [n], agents [N, n] (uint16 = bfloat16 bits, or float32), lo, hi, eps, mode, lam [N],
    use_lam, w [N], normalize, div, scaling (float32 scalars), out [n] (uint16 or float32), collect,
    hist [4^N] int64, gram [N, N] float64 (upper triangle). Compiled on first use, cached on disk.
    """
    from ._numba_kernels import fused_range as kernel

    return bool(kernel(*args))


def gta_hist_hi(*args: Any) -> bool:
    """High-16-bit histogram of |τ_t| per agent over [lo, hi) (see _numba_gta.hist_hi); True if τ not finite."""
    from ._numba_gta import hist_hi

    return bool(hist_hi(*args))


def gta_hist_lo(*args: Any) -> None:
    """Low-16-bit histogram inside one high bin per query (see _numba_gta.hist_lo)."""
    from ._numba_gta import hist_lo

    hist_lo(*args)


def gta_merge_range(*args: Any) -> None:
    """The TIES / Breadcrumbs merge rule over [lo, hi) of one block (see _numba_gta.merge_range)."""
    from ._numba_gta import merge_range

    merge_range(*args)
