"""The sparsify family: TIES, Breadcrumbs, DARE, DELLA (prune each task vector, then combine), with everything it
owns: its presets and parameters (``presets.py``), its statistics (``observer.py``: exact |τ| thresholds, L1
sums; the radix select it shares is ``methods/_select.py``), its random numbers (``rng.py``, ``l1.py``), its
declarations (``family.py``), and its numba backends (``fast_select.py``, ``fast_random.py``) with their kernels
(``kernels/``)."""

from __future__ import annotations

from .family import METHODS

__all__ = ["METHODS"]
