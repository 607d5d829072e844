"""The sparsify family's numba kernels, as its backends call them (numba is imported only when one runs).

``select.py``: TIES / Breadcrumbs' exact |τ| thresholds (the radix select of methods/_select.py, one histogram
kernel per round, the gather of a bin that ends it early, the k-th value and the tie cut in that bin) and their
merge; ``dare.py``: DARE / DELLA's random drop (``mt.py``: torch's generator, bit for bit; ``della.py``: MagPrune's
ranks within a row), L1 lanes and merge.
Every kernel ends with the family's combine rule, compiled by the rule generator (rlmerge.kernels.fused.rule_tile).
tests/test_fastgta.py, test_fastdare.py and test_fastdella.py hold them to the torch reference, byte for byte.
"""

from __future__ import annotations

import importlib
from typing import Any

NONFINITE_BIN = 0x7F800000 >> 20  # round-0 bins of |τ| patterns at or above inf (exponent all ones)

# Entry points, as the backends call them: (module, function), imported on first use.
_ENTRIES = {"hist_first": ("select", "hist_first"), "hist_next": ("select", "hist_next"),
            "select_merge_range": ("select", "merge_range"),
            "tie_scan": ("select", "tie_scan"), "gather_bin": ("select", "gather_bin"),
            "bin_kth": ("select", "bin_kth"), "bin_tie": ("select", "bin_tie"),
            "dare_merge_range": ("dare", "merge_range"),
            "dare_l1_range": ("dare", "l1_range"), "dare_fold": ("dare", "fold")}


def __getattr__(name: str) -> Any:
    """A kernel of ``_ENTRIES`` (select.py: the radix-select rounds and merge; dare.py: DARE / DELLA's merge, L1
    lanes and their fold), compiled on first use; it then stays a module attribute."""
    if name not in _ENTRIES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _ENTRIES[name]
    fn = globals()[name] = getattr(importlib.import_module(f".{module}", __name__), attr)
    return fn
