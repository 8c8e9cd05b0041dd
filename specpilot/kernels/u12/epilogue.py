"""After a u12 block kernel's loop: split-K's partials, the escapes, the store.

The tile and mma kernels end in ``store_block``: the program holding an output block's whole
sum (kernels/split_k.py's serial semaphore, ``split_k_sum``) adds the block's escapes from the
table (escapes.py's ``apply_escapes``) and stores y. ``epilogue_args`` gives the mma and hmma
kernels the arguments of kernels/u12/fused.py's epilogues (SiLU·mul, the residual add, the norm
handoff), which run after that sum in their own launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..split_k import split_counters
from .config import U12Config
from .escapes import apply_escapes


def block_m(m: int) -> int:
    """Rows of x per program: up to 4 on the multiply-and-sum path, else 16..64 for tl.dot."""
    if m <= 4:
        return triton.next_power_of_2(m)
    return min(64, max(16, triton.next_power_of_2(m)))


def split_k_plan(t: U12Tensor, cfg: U12Config, m: int, n_words: int, rows: int):
    """(grid (N blocks, splits, M blocks), words per split, fp32 partials, counters) of a split-K
    launch of `rows` rows of x a program: each split a whole number of block_w chunks, none empty;
    with one split the two buffers are placeholders (unused; an fp32 and an int32 pointer keep the
    compiled types)."""
    n = t.shape[0]
    chunk = cfg.block_w
    split = max(1, min(cfg.split_k, triton.cdiv(n_words, chunk)))
    words_per_split = triton.cdiv(triton.cdiv(n_words, split), chunk) * chunk if n_words else 1
    split = max(1, triton.cdiv(n_words, words_per_split))  # no empty splits
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, rows))
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=t.device)
        counters = split_counters(t, grid[0] * grid[2], t.device)
    else:
        counters = t.esc_row_ptr
        part = counters.view(torch.float32)
    return grid, words_per_split, part, counters


@triton.jit
def block_escapes(
    out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
    stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    DTYPE: tl.constexpr, BIASED: tl.constexpr, y_scale,
):
    """``store_block``'s escape step: the table's escapes of rows offs_n (``apply_escapes``)."""
    return apply_escapes(
        out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
        stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, USE_DOT, x_ptr, 1.0, False, DTYPE, False, BIASED, y_scale,
    )


@triton.jit
def split_k_sum(out, part_ptr, count_ptr, offs_m, offs_n, mask_out, pid_n, pid_k, pid_m, M, N,
                 SPLIT_K: tl.constexpr):
    """(last, total) for a program's fp32 sums out [BM, BN] of W rows offs_n: with SPLIT_K 1 (true,
    out); else its partial stored, and for the last program of the block to arrive (the serial
    split-K semaphore) true and the partials summed in split order, its counter reset to 0 (ready
    for the next launch and CUDA graph replays); false for the others, which load nothing."""
    if SPLIT_K == 1:
        return pid_k == 0, out
    else:
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]  # [SPLIT_K, M, N] fp32
        tl.store(part + pid_k * M * N, out, mask=mask_out)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        total = tl.zeros_like(out)
        for ks in tl.static_range(SPLIT_K):  # unrolled: every partial's load in flight at once
            total += tl.load(part + ks * M * N, mask=tl.where(last, mask_out, False), other=0.0, cache_modifier=".cg")
        if last:
            tl.atomic_xchg(counter, 0)
        return last, total


@triton.jit
def store_block(
    out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr, offs_m, mask_m, offs_n, mask_n,
    n0, pid_n, pid_k, pid_m, M, N, K, SPLIT_K: tl.constexpr, stride_xm, stride_xk, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    BIASED: tl.constexpr = False, y_scale=1.0,
):
    """Store a program's fp32 sums ``out`` [BM, BN] (y's units, or BIASED the biased decode's, which
    the escape step scales by y_scale; ``apply_escapes``): the program that holds the block's
    whole sum (``split_k_sum``) adds the table's escapes and stores y. Shared by the tile kernel and
    the mma kernel."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    last, total = split_k_sum(out, part_ptr, count_ptr, offs_m, offs_n, mask_out, pid_n, pid_k, pid_m, M, N, SPLIT_K)
    if last:
        total = block_escapes(
            total, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
            stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, USE_DOT, y_ptr.dtype.element_ty, BIASED, y_scale,
        )
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask_out)


def epilogue_args(x: torch.Tensor, y: torch.Tensor, native: bool, parts_out: int, gated: bool = False,
                  residual: bool = False, hand_in=None, hand_out=None) -> tuple[tuple, dict, bool]:
    """The mma and hmma kernels' arguments for kernels/u12/fused.py's epilogue: (hw, xg, parts,
    n_out, inv_k, eps, n_parts, stride_xg) in their order, placeholders of the right types where
    unused; the constexpr flags; and whether any epilogue runs (then without fp fusion:
    ``U12Config.launch_options``). hand_out (a ``NormHandoff``) gets its xg and `parts_out` parts
    allocated here."""
    hw, xg, parts, n_parts, eps = x, x, y, 0, 0.0
    if hand_out is not None:
        hand_out.allocate(y, parts_out)
        hw, xg, parts, eps = hand_out.weight.contiguous(), hand_out.xg, hand_out.parts, hand_out.eps
    elif hand_in is not None:
        parts, n_parts, eps = hand_in.parts, hand_in.parts.shape[0], hand_in.eps
    flags = dict(GATED=gated, RESIDUAL=residual, HAND_IN=hand_in is not None, HAND_OUT=hand_out is not None,
                 # a chunk of parts: all 1024 at once held the registers of a tile
                 BLOCK_P=min(256, triton.next_power_of_2(max(1, n_parts))),
                 ROUND_BF16=not native and x.dtype == torch.bfloat16, EXPF=native)
    fused = gated or residual or hand_in is not None or hand_out is not None
    return (hw, xg, parts, y.shape[1], 1.0 / x.shape[1], eps, n_parts, xg.stride(0)), flags, fused
