"""bf16 rows read as int64 words of 4: the loads of the GEMV kernels (fused_linear's, u12's).

One 8-byte load brings 4 bf16 values, split into fp32 in registers by shifts and masks (exact),
so a thread's x (and a bf16 weight's) loads are as wide as its u12 word loads. The rows must have
unit stride along K, a row stride % 4 == 0 and an 8-byte aligned start (`aligned_rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def bf16x4_to_fp32(v):
    """An int64 word of 4 bf16 (little-endian: element j in bits 16 j..16 j + 15) as 4 fp32 values."""
    lo = v.to(tl.int32)
    hi = (v >> 32).to(tl.int32)
    return ((lo << 16).to(tl.float32, bitcast=True), (lo & -0x10000).to(tl.float32, bitcast=True),
            (hi << 16).to(tl.float32, bitcast=True), (hi & -0x10000).to(tl.float32, bitcast=True))


def aligned_rows(x: torch.Tensor, words: bool) -> torch.Tensor:
    """x with unit stride along its rows and, for `words` (read as int64 words of 4 bf16), a row
    stride % 4 == 0 and an 8-byte aligned start; copied if not."""
    ok = x.stride(-1) == 1 and (not words or (x.data_ptr() % 8 == 0 and (x.dim() == 1 or x.stride(0) % 4 == 0)))
    return x if ok else x.clone(memory_format=torch.contiguous_format)
