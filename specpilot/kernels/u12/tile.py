"""The tile kernel: y = x · Wᵀ for any M, K and base, the u12 family's general case.

``_u12_linear_kernel`` multiplies M <= 4 rows of x on the CUDA cores (a [BM, BN, 4 BW]
accumulator, reduced once after the loop) and feeds M >= 5 decoded [BLOCK_N, BLOCK_K] tiles to
``tl.dot`` (bf16 operands on the GPU, fp32 under the interpreter, whose bf16 dot is wrong) with up
to 64 rows of x a program, so each weight is decoded once a program. It reads the planes as words
where K % 4 == 0 (int32 sign/mantissa, int16 codes) and as bytes otherwise, and takes either decode
(decode.py: the scaled one where the base allows, else the exact one). Split-K by the serial
semaphore (epilogue.py). The faster kernels (gemv2, mma, hmma) serve the scaled word path; this one
serves the rest, and the configs the dispatcher gives where they do not apply.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..overlap import Launch, pdl_args, pdl_enter
from ..target import native as on_native
from .config import U12Config
from .decode import decode_words, scaled_decode
from .epilogue import block_m, split_k_plan, store_block
from .escapes import ESC_BLOCK, nonempty
from .planes import col_words, row_words

SM_COUNT_H200 = 132
INTERPRETER_CONFIG = U12Config(16, 8, split_k=2)  # small tiles; split-K exercised on the CPU too


@triton.jit
def _u12_linear_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, n_words, base, x_scale, y_scale_lo, y_scale_hi, words_per_split,
    stride_xm, stride_xk, stride_sm, stride_codes, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ESC_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,  # ways over K (constexpr: the last program's sum of the partials unrolls)
    PAIRS: tl.constexpr,  # the scaled decode two weights per 32-bit op (else one)
    WORDS: tl.constexpr,  # sm viewed as int32 [N, K/4], codes as int16 [N, K/4] (K % 4 == 0); else bytes
    SCALED: tl.constexpr,  # exponent field = code, x scaled by x_scale, sums by y_scale_lo · y_scale_hi
    USE_DOT: tl.constexpr,  # tl.dot on decoded tiles (BLOCK_M >= 16), else multiply-and-sum
    DOT_BF16: tl.constexpr,  # bf16 tiles for a bf16 dot (GPU, bf16 x); else fp32 tiles
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    TILED: tl.constexpr = False,  # W's planes in tiles (U12Tensor.layout; WORDS)
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm

    w_begin = pid_k * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, n_words)  # arguments, so the compiler sees their divisibility
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ: W is the dot's wide side
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, 4 * BLOCK_W), dtype=tl.float32)  # reduced once, after the loop
    for w0 in range(w_begin, w_end, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        w_mask = mask_n[:, None] & (offs_w < w_end)[None, :]
        if WORDS:
            at = col_words(offs_w, TILED)[None, :]
            s = tl.load(sm_ptr + row_words(offs_n, stride_sm, TILED)[:, None] + at, mask=w_mask, other=0)
            c = tl.load(codes_ptr + row_words(offs_n, stride_codes, TILED)[:, None] + at, mask=w_mask,
                        other=0).to(tl.int32)
        else:  # bytes beyond K (and the padding nibble) read as 0, which decodes to +0.0
            sm_row = sm_ptr + offs_n[:, None] * stride_sm + 4 * offs_w[None, :]
            s = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.int32)
            for j in tl.static_range(4):
                in_k = w_mask & (4 * offs_w + j < K)[None, :]
                s |= tl.load(sm_row + j, mask=in_k, other=0).to(tl.int32) << (8 * j)
            code_row = codes_ptr + offs_n[:, None] * stride_codes + 2 * offs_w[None, :]
            c = tl.load(code_row, mask=w_mask, other=0).to(tl.int32)
            c |= tl.load(code_row + 1, mask=w_mask & (4 * offs_w + 2 < K)[None, :], other=0).to(tl.int32) << 8
        w = decode_words(s, c, base, SCALED, PAIRS, DOT_BF16, BLOCK_N, BLOCK_W)  # [BN, 4 BW]
        offs_k = 4 * w0 + tl.arange(0, 4 * BLOCK_W)
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        x = x.to(tl.float32) * x_scale  # exact: a power of two
        if USE_DOT:
            if DOT_BF16:
                acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc += x[:, None, :] * w[None, :, :]
    if USE_DOT:
        out = tl.trans(acc)
    else:
        out = tl.sum(acc, axis=2)
    out = out * y_scale_lo * y_scale_hi  # exact: powers of two

    store_block(
        out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr, offs_m, mask_m, offs_n, mask_n,
        n0, pid_n, pid_k, pid_m, M, N, K, SPLIT_K, stride_xm, stride_xk, stride_ym,
        BLOCK_M, BLOCK_N, ESC_BLOCK, USE_DOT, False, 1.0,
    )


def tile_config(m: int, n: int, k: int, on_gpu: bool) -> U12Config:
    """The tile kernel's heuristic: enough programs for ~8 (GEMV) or ~2 (dot) a SM."""
    if not on_gpu:
        return INTERPRETER_CONFIG
    rows = block_m(m)
    if rows <= 4:  # 32 (BM = 1, 2) or 64 (BM = 4) accumulator registers a thread
        # no split-K: split_k 1 won every GEMV row of the H200 sweep (u12_linear_h200_nvidia.json)
        return U12Config(16 if rows <= 2 else 8, 64, num_warps=4)
    tile, per_sm = U12Config(64, 32, num_warps=4), 2
    n_blocks = triton.cdiv(n, tile.block_n) * triton.cdiv(m, rows)
    split = max(1, min(8, SM_COUNT_H200 * per_sm // n_blocks, triton.cdiv(k, 4 * tile.block_w * 4)))
    return dataclasses.replace(tile, split_k=split)


def launch_tile(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, launch: Launch | None = None) -> None:
    """y = x · Wᵀ by ``_u12_linear_kernel``; grid (N blocks, splits, M blocks)."""
    m, k = x.shape
    n = t.shape[0]
    scaled, x_scale, y_lo, y_hi = scaled_decode(t.base)
    rows = block_m(m)
    use_dot = rows >= 16
    words = k % 4 == 0 and k > 0
    n_words = triton.cdiv(k, 4)
    grid, words_per_split, part, counters = split_k_plan(t, cfg, m, n_words, rows)
    native = on_native(x)
    sm, codes = t.sm.contiguous(), t.codes.contiguous()
    _u12_linear_kernel[grid](
        x, sm.view(torch.int32) if words else sm, codes.view(torch.int16) if words else codes,
        nonempty(t.esc_idx), nonempty(t.esc_val), t.esc_row_ptr, y, part, counters,
        m, n, k, n_words, t.base, x_scale, y_lo, y_hi, words_per_split,
        x.stride(0), x.stride(1), n_words if words else k, n_words if words else codes.shape[1], y.stride(0),
        BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=ESC_BLOCK, SPLIT_K=grid[1],
        PAIRS=cfg.decode == "pairs", WORDS=words, SCALED=scaled, USE_DOT=use_dot,
        DOT_BF16=use_dot and native and x.dtype == torch.bfloat16,
        **cfg.launch_options(native), **pdl_args(x.device, launch), TILED=t.layout == "tiles",
    )
