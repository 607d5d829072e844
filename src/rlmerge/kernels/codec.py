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

# inline="always" (numba inlines the IR): a call in a loop keeps it from vectorising (measured: a rule calling the
# rounding as a function 24 ns/element, inlined 2.7). Safe only for bodies without control flow: numba's IR inliner
# miscompiled a conditional expression inside an inlined function, so these use arithmetic, not `if`.
@overload(_dec, inline="always")
def _dec_ov(v):  # type: ignore[no-untyped-def]
    if v == types.uint16:  # bfloat16: the high half of a float32
        return lambda v: _u32_as_f32(np.uint32(np.uint32(v) << np.uint32(16)))
    if v == types.float32:
        return lambda v: v
    return None

def _tau(a, k, b, tau):  # type: ignore[no-untyped-def]  # τ of element k (see the overload)
    raise NotImplementedError


@overload(_tau, inline="always")
def _tau_ov(a, k, b, tau):  # type: ignore[no-untyped-def]
    """τ of element k of agent array ``a``: its stored value decoded minus the base's ``b`` (float32), or with
    ``tau`` not None a[k] itself (the agents come as their float32 τ: stream/fast.reads_tau). Decided from the
    type of ``tau`` when the kernel compiles: no branch in the loop."""
    if isinstance(tau, types.NoneType):
        return lambda a, k, b, tau: _dec(a[k]) - b
    return lambda a, k, b, tau: a[k]

# float32 → the stored output dtype, as torch's .to(), as source: the fused kernel writes it into its generated loop
# (fused.py), which every kernel that writes merged values runs. bfloat16: round to nearest, ties to even
# (c10::BFloat16 round_to_nearest_even); NaN → torch's canonical 0x7FC0. Arithmetic, not ``if``: numba's IR
# inliner miscompiled a conditional expression inside an inlined function.
PUT_SOURCE = {
    "uint16": ("u = _f32_as_u32({v})\n"
               "r = (u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16)\n"
               "nan = np.uint32({v} != {v})\n"
               "out[i] = np.uint16(r * (np.uint32(1) - nan) + np.uint32(0x7FC0) * nan)"),
    "float32": "out[i] = {v}",
}


def put_lines(out_dtype: str, value: str, indent: str) -> str:
    """``PUT_SOURCE`` for ``out_dtype`` storing ``value`` into ``out[i]``, indented."""
    return "\n".join(indent + line for line in PUT_SOURCE[out_dtype].format(v=value).splitlines())

