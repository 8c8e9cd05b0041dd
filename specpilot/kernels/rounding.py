"""Rounding as torch rounds, inside Triton kernels, also under the interpreter.

Triton's interpreter casts fp32 to bf16 by truncation, GPUs round to nearest even; kernels that
must match torch bit for bit round first (`round_bf16`, exact on both) when ROUND_BF16 is set
(bf16 under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32. The interpreter's fp32 -> bf16
    cast truncates; rounding first makes that cast exact, so interpreter runs round as GPUs do."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 x rounded to DTYPE (as torch's result in that dtype, nearest even), back in fp32."""
    if ROUND_BF16:
        x = round_bf16(x)
    return x.to(DTYPE).to(tl.float32)
