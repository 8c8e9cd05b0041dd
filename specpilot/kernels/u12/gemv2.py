"""gemv2: y = x · Wᵀ for M <= 4 rows of x on the CUDA cores, the AR step's u12 GEMV.

One program owns BLOCK_N rows of W and every row of x, so each weight is decoded once and used M
times, and loops over K in chunks of BLOCK_W words. The 4 weights of a word decode into four fp32
planes (decode.py's biased decode, ``decode_planes``: 12 integer ops a word), each FMA'd with the
matching plane of x (bf16 x read as one int64 word a w) into one [BM, BN, BW] accumulator, reduced
once after the loop: no join, reshape or layout conversion, no shared memory (sm_90 SASS). Rows
past M and N re-read the last row, so only a last partial chunk of K is masked. Escapes from the
rows' lanes, else the table (escapes.py). Scaled path only: K % 4 == 0 and 1 <= base <= 240
(``gemv2_applies``). Measurements: docs/experiments/u12-gemv2.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..bf16_words import aligned_rows
from ..overlap import Launch, pdl_args, pdl_enter
from ..target import native as on_native
from .config import U12Config
from .decode import biased_scale, words_and_scales
from .epilogue import block_m
from .escapes import (ESC_BLOCK, escape_ahead_init, escape_stage, escape_stages_left, escapes_ahead, lanes_args,
                      lanes_finish, lanes_gather, lanes_load, nonempty)
from .planes import fma_planes, row_words, x_planes


@triton.jit
def _gemv_chunk(
    acc, start, sm_rows, code_rows, x_rows, n_words,
    BLOCK_W: tl.constexpr, X_WORDS: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr, TILED: tl.constexpr,
):
    """acc[m, n, w] += sum over j of x[m, 4 w + j] · w[n, 4 w + j] 2^(113-base), for the words
    w in [start, start + BLOCK_W); MASKED: words past K read as 0 (2^-15 weights, 0 activations)."""
    offs_w = (start + tl.arange(0, BLOCK_W))[None, None, :]
    mask = offs_w < n_words
    x0, x1, x2, x3 = x_planes(x_rows, offs_w, mask, X_WORDS, MASKED)
    return fma_planes(acc, sm_rows, code_rows, offs_w, mask, x0, x1, x2, x3, MASKED, ASM, TILED)


@triton.jit
def _u12_gemv_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr,
    M, N, K, n_words, y_scale,
    stride_xm, stride_xk, stride_sm, stride_codes, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ESC_BLOCK: tl.constexpr,
    X_WORDS: tl.constexpr,  # bf16 x read as int64 words of 4 (contiguous rows, 8-byte aligned); else fp32 elements
    EVEN_K: tl.constexpr,  # n_words % BLOCK_W == 0: no masked last chunk
    ASM: tl.constexpr,  # PTX prmt/lop3 (GPU); else their shift-and-mask emulation (interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    LANES: tl.constexpr = 0,  # > 0: the escapes from W's lanes (U12Tensor.esc_lanes, LANES a row), not the table
    TILED: tl.constexpr = False,  # W's planes in tiles (U12Tensor.layout)
):
    """All M (<= 4) rows of x against BLOCK_N rows of W by the biased decode (K % 4 == 0, 1 <= base <= 240)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Rows past M or N re-read the last row (their outputs are not stored), so only K needs masks.
    rows_m = tl.minimum(offs_m, M - 1)[:, None, None]
    rows_n = tl.minimum(offs_n, N - 1)[None, :, None]
    # Every load has the accumulator's shape [BM, BN, 1 -> BW] (LLVM merges the repeated loads and
    # their decode), so Triton gives them all its layout: no layout conversion in the loop (sm_90 SASS).
    shape: tl.constexpr = (BLOCK_M, BLOCK_N, 1)
    sm_rows = tl.broadcast_to(sm_ptr + row_words(rows_n, stride_sm, TILED), shape)
    code_rows = tl.broadcast_to(codes_ptr + row_words(rows_n, stride_codes, TILED), shape)
    if X_WORDS:
        x_rows = tl.broadcast_to(x_ptr.to(tl.pointer_type(tl.int64)) + rows_m * (stride_xm // 4), shape)
    else:
        x_rows = tl.broadcast_to(x_ptr + rows_m * stride_xm, shape)

    # The first escape block's row pointers load before the loop, the rest after it.
    e0, e_end, idx, val, xg, nw = escape_ahead_init(esc_idx_ptr, BLOCK_M, ESC_BLOCK)
    if not LANES:
        e0, e_end, idx, val, xg, nw = escape_stage(
            0, e0, e_end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, x_ptr,
            offs_m, mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, False,
        )
    if LANES:
        lanes = lanes_load(lanes_ptr, rows_n, LANES, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # reduced once, after the loop
    full_words = n_words - n_words % BLOCK_W
    for start in range(0, full_words, BLOCK_W):
        acc = _gemv_chunk(acc, start, sm_rows, code_rows, x_rows, n_words, BLOCK_W, X_WORDS, False, ASM, TILED)
    if LANES:  # x at the lanes' columns, after the loop (before it, the lanes' load would stall the loop's start)
        spur, esc = lanes_gather(lanes, x_ptr, x_ptr, rows_m, stride_xm, K, 1.0, False, y_ptr.dtype.element_ty, False)
    else:
        e0, e_end, idx, val, xg, nw = escape_stages_left(
            1, e0, e_end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr,
            x_ptr, offs_m, mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, False,
        )
    if not EVEN_K:
        acc = _gemv_chunk(acc, full_words, sm_rows, code_rows, x_rows, n_words, BLOCK_W, X_WORDS, True, ASM, TILED)
    if LANES:  # scales the sums to y's
        out = lanes_finish(acc, spur, esc, y_scale)
    else:
        out = escapes_ahead(  # scales the sums to y's
            tl.sum(acc, axis=2), e0, e_end, idx, val, xg, nw, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n,
            K, stride_xm, stride_xk, ESC_BLOCK, x_ptr, 1.0, False, y_ptr.dtype.element_ty, False, y_scale,
        )
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv2_applies(m: int, k: int, base: int) -> bool:
    """Whether a gemv2 config runs the gemv2 kernel: M <= 4 and ``words_and_scales``."""
    return m <= 4 and words_and_scales(k, base)


def gemv2_acc_registers(cfg: U12Config, rows: int) -> int:
    """fp32 accumulator registers a thread of the gemv2 kernel holds: [BM, BN, BW] over 32 · warps threads."""
    return rows * cfg.block_n * cfg.block_w // (32 * cfg.num_warps)


def launch_gemv2(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, launch: Launch | None = None) -> None:
    """y = x · Wᵀ by ``_u12_gemv_kernel``, one program per block_n rows of W (``gemv2_applies`` holds)."""
    m, k = x.shape
    n = t.shape[0]
    n_words = k // 4
    x_words = x.dtype == torch.bfloat16
    x = aligned_rows(x, x_words)  # the kernel reads x[m, 4 w + j] at unit k stride, bf16 x as int64 words
    sm, codes = t.sm.contiguous(), t.codes.contiguous()
    native = on_native(x)
    lanes, n_lanes = lanes_args(t)
    _u12_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, sm.view(torch.int32), codes.view(torch.int16),
        nonempty(t.esc_idx), nonempty(t.esc_val), t.esc_row_ptr, lanes, y,
        m, n, k, n_words, biased_scale(t.base),
        x.stride(0), x.stride(1), n_words, n_words, y.stride(0),
        BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=ESC_BLOCK,
        X_WORDS=x_words, EVEN_K=n_words % cfg.block_w == 0,
        # inline PTX on the GPU; the interpreter runs none
        ASM=native, **cfg.launch_options(native), **pdl_args(x.device, launch), LANES=n_lanes,
        TILED=t.layout == "tiles",
    )
