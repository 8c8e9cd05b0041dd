"""The mma kernel: y = x · Wᵀ on the tensor cores through tl.dot (wgmma on sm_90), 16 rows of x a program at least.

A program owns BLOCK_N rows of W and BLOCK_M (16..64) rows of x and loops over K in chunks of
BLOCK_W words. The words decode by pairs (decode.py's ``pair_patterns``, the scaled decode) into
the bf16 patterns of weights (0, 2) and (1, 3) of each word, one 32-bit register each; the four
planes (plane j: weight 4 w + j) are their 16-bit halves. K's order inside a dot is free, so
nothing is reordered to k order: one dot a chunk takes the planes in ``w_in_dot_order``, where
each pair register is one bf16x2 register of wgmma's A fragment (the join, permute and reshape
are no instructions in the sm_90 SASS), and x's matching planes in the same order: acc[BN, BM] +=
W · X. After the loop epilogue.py's ``store_block`` (scales, escapes from the table, split-K); or,
for kernels/u12/fused.py at M >= 5, its epilogue (``_fused_store``). Rows past M and N re-read the
last row; only a last partial chunk of K is masked.

Numerics: the scaled decode (w · 2^-(base-1), escapes +0.0), x scaled by 2^64, the fp32 sums by
2^(base-65): exact. bf16 x on the GPU: bf16 operands, fp32 accumulation; fp32 x or the
interpreter: fp32 planes and "ieee" dots. The scaled word path only (``mma_applies``); the
dispatcher gives other cases to the tile kernel. Measurements and what was tried:
docs/experiments/u12-mma.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..bf16_words import aligned_rows
from ..fused_linear import epilogue
from ..overlap import Launch, pdl_args, pdl_enter
from ..rmsnorm import row_inv_parts
from ..rounding import to_dtype
from ..target import native as on_native
from .config import U12Config
from .decode import decode_planes, pair_patterns, scaled_decode, words_and_scales
from .epilogue import block_escapes, block_m, epilogue_args, split_k_plan, split_k_sum, store_block
from .escapes import ESC_BLOCK, nonempty
from .planes import col_words, row_words, x_planes


@triton.jit
def mma_planes(s, c, DOT_BF16: tl.constexpr, ASM: tl.constexpr):
    """Four planes of weights (plane j: weight 4 w + j, times 2^-(base-1)): bf16 halves of the pair
    registers (DOT_BF16), else fp32 (``decode_planes``)."""
    if DOT_BF16:
        p02, p13 = pair_patterns(s, c, ASM, False)
        w0 = p02.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w1 = p13.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w2 = (p02 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w3 = (p13 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return w0, w1, w2, w3
    else:
        return decode_planes(s, c, ASM, False)


@triton.jit
def w_in_dot_order(w0, w1, w2, w3):
    """Planes [BN, BW] -> W [BN, 4 BW] in the dot's K order: k = 2 BW q + 2 w + h holds plane 2 h + q,
    so planes 0 and 2 (q = 0), then 1 and 3, each weight pair adjacent: in wgmma's A fragment (two
    consecutive k a 32-bit register) each register is one pair register of the decode, so the join,
    permute and reshape are no instructions (sm_90 SASS: no PRMT beyond the decode's, no shuffle)."""
    BN: tl.constexpr = w0.shape[0]
    BW: tl.constexpr = w0.shape[1]
    w02 = tl.reshape(tl.join(w0, w2), (BN, 2 * BW))
    w13 = tl.reshape(tl.join(w1, w3), (BN, 2 * BW))
    return tl.reshape(tl.permute(tl.join(w02, w13), (0, 2, 1)), (BN, 4 * BW))


@triton.jit
def x_in_dot_order(x0, x1, x2, x3):
    """Planes [BW, BM] of x -> [4 BW, BM] in ``w_in_dot_order``'s K order."""
    BW: tl.constexpr = x0.shape[0]
    BM: tl.constexpr = x0.shape[1]
    x02 = tl.reshape(tl.permute(tl.join(x0, x2), (0, 2, 1)), (2 * BW, BM))
    x13 = tl.reshape(tl.permute(tl.join(x1, x3), (0, 2, 1)), (2 * BW, BM))
    return tl.reshape(tl.permute(tl.join(x02, x13), (2, 0, 1)), (4 * BW, BM))


@triton.jit
def _plane_dot(w, x, x_scale, acc, DOT_BF16: tl.constexpr):
    """acc + w · (x 2^64): bf16 operands (the scale is exact in bf16), else fp32 in full precision."""
    if DOT_BF16:
        return tl.dot(w, (x * x_scale).to(tl.bfloat16), acc)
    else:
        return tl.dot(w, x * x_scale, acc, input_precision="ieee")


@triton.jit
def _mma_chunk(
    acc, start, w_end, sm_rows, code_rows, x_cols, x_scale,
    BLOCK_W: tl.constexpr, X_WORDS: tl.constexpr, DOT_BF16: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
    TILED: tl.constexpr,
):
    """acc[n, m] += sum over the words w in [start, start + BLOCK_W) and j of w[n, 4 w + j] x[m, 4 w + j]
    (scaled); MASKED: words at or past w_end read as 0 (+0.0 weights, 0 activations)."""
    offs_w = start + tl.arange(0, BLOCK_W)
    w_of_n = offs_w[None, :]  # [1, BW]: W's chunk is [BN, BW]
    w_of_x = offs_w[:, None]  # [BW, 1]: x's planes are [BW, BM]
    at = col_words(w_of_n, TILED)
    if MASKED:
        s = tl.load(sm_rows + at, mask=w_of_n < w_end, other=0)
        c = tl.load(code_rows + at, mask=w_of_n < w_end, other=0).to(tl.int32)
    else:
        s = tl.load(sm_rows + at)
        c = tl.load(code_rows + at).to(tl.int32)
    w0, w1, w2, w3 = mma_planes(s, c, DOT_BF16, ASM)
    x0, x1, x2, x3 = x_planes(x_cols, w_of_x, w_of_x < w_end, X_WORDS, MASKED)
    return _plane_dot(w_in_dot_order(w0, w1, w2, w3), x_in_dot_order(x0, x1, x2, x3), x_scale, acc, DOT_BF16)


@triton.jit
def _u12_mma_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr,
    hw_ptr, xg_ptr, parts_ptr,  # the epilogue's norm handoff (fused.py's NormHandoff); else unused
    M, N, K, n_words, x_scale, y_scale_lo, y_scale_hi, words_per_split, n_out, inv_k, eps, n_parts,
    stride_xm, stride_xk, stride_sm, stride_codes, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ESC_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,  # ways over K (epilogue.py's store_block)
    X_WORDS: tl.constexpr,  # bf16 x as int64 words of 4 (contiguous, 8-byte aligned rows); else elements, stride_xk 1
    EVEN_K: tl.constexpr,  # n_words % BLOCK_W == 0: no split has a masked last chunk
    DOT_BF16: tl.constexpr,  # bf16 planes and dots (GPU, bf16 x); else fp32
    ASM: tl.constexpr,  # PTX prmt/lop3 (GPU); else their shift-and-mask emulation (interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    # fused.py's epilogue (``_fused_store``): GATED (W is [gate; up], n_out = N / 2 output
    # columns, a program's rows half gate, half the matching up), RESIDUAL (y is the residual, added
    # into), HAND_IN (x is a handoff's xg: the sums times its rows' inv), HAND_OUT (the updated
    # stream's norm handed on); none: the plain store (``store_block``).
    GATED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    HAND_IN: tl.constexpr = False, HAND_OUT: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 16,  # HAND_IN: parts summed a chunk
    ROUND_BF16: tl.constexpr = False,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr = False,  # GATED: libdevice's expf (GPU); else tl.exp
    TILED: tl.constexpr = False,  # W's planes in tiles (U12Tensor.layout)
):
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if GATED:  # rows i < BN / 2: gate rows c = pid_n BN / 2 + i; the rest: their up rows n_out + c
        HALF: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        c = pid_n * HALF + i % HALF
        up = (i >= HALF).to(tl.int32)
        offs_n = c + up * n_out
        mask_n = c < n_out
        rows_n = (tl.minimum(c, n_out - 1) + up * n_out)[:, None]
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        rows_n = tl.minimum(offs_n, N - 1)[:, None]
    rows_m = tl.minimum(offs_m, M - 1)[None, :]
    sm_rows = sm_ptr + row_words(rows_n, stride_sm, TILED)
    code_rows = codes_ptr + row_words(rows_n, stride_codes, TILED)
    if X_WORDS:
        x_cols = x_ptr.to(tl.pointer_type(tl.int64)) + rows_m * (stride_xm // 4)
    else:
        x_cols = x_ptr + rows_m * stride_xm

    w_begin = pid_k * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, n_words)
    full_end = w_begin + (w_end - w_begin) // BLOCK_W * BLOCK_W
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ: W is the dot's wide side
    for start in range(w_begin, full_end, BLOCK_W):
        acc = _mma_chunk(acc, start, w_end, sm_rows, code_rows, x_cols, x_scale, BLOCK_W, X_WORDS, DOT_BF16, False, ASM,
                         TILED)
    if not EVEN_K:
        if full_end < w_end:  # only the last split has a partial chunk
            acc = _mma_chunk(acc, full_end, w_end, sm_rows, code_rows, x_cols, x_scale,
                             BLOCK_W, X_WORDS, DOT_BF16, True, ASM, TILED)
    out = tl.trans(acc) * y_scale_lo * y_scale_hi  # exact: powers of two

    if GATED or RESIDUAL or HAND_IN or HAND_OUT:
        _fused_store(
            out, offs_m, mask_m, offs_n, mask_n, pid_n, pid_k, pid_m, M, N, K, n_out,
            x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr,
            hw_ptr, xg_ptr, parts_ptr, inv_k, eps, n_parts, stride_xm, stride_xk, stride_ym, stride_xg,
            BLOCK_M, BLOCK_N, ESC_BLOCK, SPLIT_K,
            GATED, RESIDUAL, HAND_IN, HAND_OUT, BLOCK_P, ROUND_BF16, EXPF,
        )
    else:
        store_block(
            out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr, offs_m, mask_m, offs_n,
            mask_n, n0, pid_n, pid_k, pid_m, M, N, K, SPLIT_K, stride_xm, stride_xk, stride_ym, BLOCK_M, BLOCK_N,
            ESC_BLOCK, True, False, 1.0,
        )


@triton.jit
def _fused_store(
    out, offs_m, mask_m, offs_n, mask_n, pid_n, pid_k, pid_m, M, N, K, n_out,
    x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr,
    hw_ptr, xg_ptr, parts_ptr, inv_k, eps, n_parts, stride_xm, stride_xk, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    HAND_IN: tl.constexpr, HAND_OUT: tl.constexpr, BLOCK_P: tl.constexpr, ROUND_BF16: tl.constexpr,
    EXPF: tl.constexpr,
):
    """fused.py's epilogue after the block's whole sum (``split_k_sum``) of W
    rows offs_n: the escapes (gated: the gate half's and the up half's, each from its own rows),
    HAND_IN the rows' inv from the producer's parts, then fused_linear's ``epilogue`` (SiLU·mul,
    the residual add, and HAND_OUT this program's Σ y² part, parts[pid_n, m]) and HAND_OUT xg =
    dtype(y · the norm's weight) at these columns."""
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    last, total = split_k_sum(out, part_ptr, count_ptr, offs_m, offs_n, mask_m[:, None] & mask_n[None, :],
                              pid_n, pid_k, pid_m, M, N, SPLIT_K)
    if last:
        if GATED:
            HALF: tl.constexpr = BLOCK_N // 2
            g, u = tl.split(tl.permute(tl.reshape(total, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            c0 = pid_n * HALF
            cols = c0 + tl.arange(0, HALF)
            g = block_escapes(g, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, cols, c0,
                              n_out, K, stride_xm, stride_xk, HALF, ESC_BLOCK, True, DTYPE, False, 1.0)
            u = block_escapes(u, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m,
                              cols + n_out, c0 + n_out, 2 * n_out, K, stride_xm, stride_xk, HALF, ESC_BLOCK, True,
                              DTYPE, False, 1.0)
        else:
            cols = offs_n
            g = block_escapes(total, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, cols,
                              pid_n * BLOCK_N, N, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, True, DTYPE, False,
                              1.0)
            u = g
        if HAND_IN:  # rmsnorm's inv, factored out of the sums (x = dtype(stream · weight))
            inv = row_inv_parts(parts_ptr, tl.minimum(offs_m, M - 1), M, n_parts, inv_k, eps, BLOCK_M, BLOCK_P)
            g = g * inv[:, None]
            u = u * inv[:, None]
        mask = mask_m[:, None] & (cols < n_out)[None, :]
        y = epilogue(g, u, y_ptr + offs_m[:, None] * stride_ym + cols[None, :], mask, DTYPE, GATED, RESIDUAL,
                     ROUND_BF16, EXPF, parts_ptr + pid_n * M + offs_m, HAND_OUT)
        if HAND_OUT:
            hw = tl.load(hw_ptr + cols, mask=cols < n_out, other=0.0).to(tl.float32)
            tl.store(xg_ptr + offs_m[:, None] * stride_xg + cols[None, :],
                     to_dtype(y * hw[None, :], DTYPE, ROUND_BF16).to(DTYPE), mask=mask)


def mma_applies(m: int, k: int, base: int) -> bool:
    """Whether an mma config runs the mma kernel: word loads (K % 4 == 0) and the scaled decode (any
    M: below 16 rows a program's rows past M re-read the last)."""
    return m >= 1 and words_and_scales(k, base)


def launch_mma(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, gated: bool = False,
               residual: bool = False, hand_in=None, hand_out=None, launch: Launch | None = None) -> None:
    """y = x · Wᵀ by ``_u12_mma_kernel`` (``mma_applies`` holds); grid (N blocks, splits, M blocks).
    With fused.py's epilogue: gated (t is [gate; up], y [M, N / 2] is silu(gate) · up), residual (y is the residual, added into in place), hand_in / hand_out (a
    ``NormHandoff`` consumed, or produced: its xg and parts allocated here)."""
    _, x_scale, y_lo, y_hi = scaled_decode(t.base)
    m, k = x.shape
    n = t.shape[0]
    n_words = k // 4
    x_words = x.dtype == torch.bfloat16
    x = aligned_rows(x, x_words)
    rows = max(16, block_m(m))  # tl.dot's narrowest side
    grid, words_per_split, part, counters = split_k_plan(t, cfg, m, n_words, rows)
    native = on_native(x)  # the interpreter runs no PTX, no bf16 dot
    sm, codes = t.sm.contiguous(), t.codes.contiguous()
    if gated and cfg.block_n % 32:  # each half at least 16 rows: the table's one-hot dot over them
        raise ValueError(f"launch_mma: a gated launch splits block_n into gate and up rows, a multiple of 16 "
                         f"each; got block_n {cfg.block_n}")
    epi, flags, fused = epilogue_args(x, y, native, grid[0], gated, residual, hand_in, hand_out)
    hw, xg, parts, n_out, inv_k, eps, n_parts, stride_xg = epi
    _u12_mma_kernel[grid](
        x, sm.view(torch.int32), codes.view(torch.int16),
        nonempty(t.esc_idx), nonempty(t.esc_val), t.esc_row_ptr, y, part, counters, hw, xg, parts,
        m, n, k, n_words, x_scale, y_lo, y_hi, words_per_split, n_out, inv_k, eps, n_parts,
        x.stride(0), x.stride(1), n_words, n_words, y.stride(0), stride_xg,
        BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=ESC_BLOCK, SPLIT_K=grid[1],
        X_WORDS=x_words, EVEN_K=n_words % cfg.block_w == 0,
        DOT_BF16=native and x.dtype == torch.bfloat16, ASM=native,
        **cfg.launch_options(native, fp_fusion=not fused),
        **pdl_args(x.device, launch), TILED=t.layout == "tiles", **flags,
    )
