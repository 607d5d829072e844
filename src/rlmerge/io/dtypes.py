"""Stored dtypes, described without torch: the fast path plans, reads and writes without importing it.

A ``DType`` is what a safetensors header says about a tensor (its code, width, whether it is a float) and
how the two array libraries spell it. ``DType.torch`` imports torch on first use, for the torch path only.

>>> BF16.itemsize, BF16.is_floating_point, str(BF16)
(2, True, 'bfloat16')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DType:
    code: str  # safetensors' name: "BF16"
    name: str  # torch's attribute name: "bfloat16"
    itemsize: int
    is_floating_point: bool
    storage: str  # numpy dtype of the raw stored bits: bfloat16 is read as uint16

    def __str__(self) -> str:
        return self.name

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.name)

    @property
    def np_storage(self) -> np.dtype:
        """The numpy dtype a block of stored bytes is viewed as (uint16 for bfloat16)."""
        return np.dtype(self.storage)


F64 = DType("F64", "float64", 8, True, "float64")
F32 = DType("F32", "float32", 4, True, "float32")
F16 = DType("F16", "float16", 2, True, "float16")
BF16 = DType("BF16", "bfloat16", 2, True, "uint16")

# safetensors dtype names → DType (little-endian, as the format requires).
DTYPES: dict[str, DType] = {d.code: d for d in (
    F64, F32, F16, BF16,
    DType("I64", "int64", 8, False, "int64"), DType("I32", "int32", 4, False, "int32"),
    DType("I16", "int16", 2, False, "int16"), DType("I8", "int8", 1, False, "int8"),
    DType("U8", "uint8", 1, False, "uint8"), DType("BOOL", "bool", 1, False, "bool"),
    DType("F8_E4M3", "float8_e4m3fn", 1, True, "uint8"), DType("F8_E5M2", "float8_e5m2", 1, True, "uint8"),
    DType("U16", "uint16", 2, False, "uint16"), DType("U32", "uint32", 4, False, "uint32"),
    DType("U64", "uint64", 8, False, "uint64"),
)}
FLOAT_DTYPES = (F64, F32, F16, BF16)  # what a merge computes on; float8 tensors are copied
_BY_NAME = {d.name: d for d in DTYPES.values()}
ALIASES = {"bf16": BF16, "fp16": F16, "half": F16, "fp32": F32, "float": F32, "fp64": F64, "double": F64}


def from_torch(dtype: Any) -> DType:
    """The DType of a torch dtype (``torch.bfloat16`` → BF16)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_NAME:
        raise ValueError(f"no stored dtype for {dtype}")
    return _BY_NAME[name]


def by_name(name: str) -> DType | None:
    """'bfloat16', 'bf16', 'torch.float32', 'F16' → DType; None when unknown."""
    key = name.lower().removeprefix("torch.")
    return _BY_NAME.get(key) or ALIASES.get(key) or DTYPES.get(name.upper())
