"""numba building blocks of the fused kernels: bfloat16 bits ↔ float32, decoding and rounding as torch does.

Imported on first use: numba costs a second and ~50 MB to import."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def _u32_as_f32(typingctx, x):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen

@intrinsic
def _f32_as_u32(typingctx, x):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen

def _dec(v):  # type: ignore[no-untyped-def]  # stored value → float32
    raise NotImplementedError

@overload(_dec)
def _dec_ov(v):  # type: ignore[no-untyped-def]
    if v == types.uint16:  # bfloat16: the high half of a float32
        return lambda v: _u32_as_f32(np.uint32(np.uint32(v) << np.uint32(16)))
    if v == types.float32:
        return lambda v: v
    return None

def _put(out, i, v):  # type: ignore[no-untyped-def]  # float32 → output dtype, as torch's .to()
    raise NotImplementedError

@overload(_put)
def _put_ov(out, i, v):  # type: ignore[no-untyped-def]
    if out.dtype == types.uint16:
        def put_bf16(out, i, v):  # type: ignore[no-untyped-def]
            # round to nearest, ties to even (c10::BFloat16 round_to_nearest_even); NaN → torch's canonical
            # 0x7FC0; one store of a select rather than a branch with two stores
            u = np.int64(_f32_as_u32(v))
            r = np.uint16((u + ((u >> 16) & 1) + 0x7FFF) >> 16)
            out[i] = np.uint16(0x7FC0) if v != v else r
        return put_bf16
    if out.dtype == types.float32:
        def put_f32(out, i, v):  # type: ignore[no-untyped-def]
            out[i] = v
        return put_f32
    return None
