"""``torch``, imported on first use.

Importing torch costs about 2 s of a merge's wall time (measured on the benchmark machine: 2.2 s, where the
whole fused-kernel merge of a 0.5B model takes a few seconds). The fast path (fused numba kernels on raw
safetensors blocks) never touches torch, so modules that the fast path imports write
``from ._torch import torch`` and use it as usual inside functions: the real import happens the first time
an attribute is looked up, i.e. only when a merge, method or reader actually runs on torch.
"""

from __future__ import annotations

from typing import Any


class _LazyTorch:
    def __getattr__(self, name: str) -> Any:
        import torch as _real

        return getattr(_real, name)

    def __repr__(self) -> str:
        return "<torch, imported on first use>"


torch: Any = _LazyTorch()
