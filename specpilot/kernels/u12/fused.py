"""u12_fused_linear: y = x · Wᵀ for a u12 weight, with an RMSNorm prologue and a SiLU·mul or residual-add epilogue.

`u12_fused_linear(x, t, norm_weight=, gated=, residual=)` is kernels/fused_linear.py's
`fused_linear` with the weight in the u12 format: in one launch what a decoder layer runs as up
to three, rmsnorm(x), u12_linear and silu_mul on the gate|up output or the residual add.

At M <= 4, ``_u12_fused_gemv_kernel``: gemv2's loop (gemv2.py) with fused_linear's prologue and
epilogue. One program owns BLOCK_N output rows (gated: the BLOCK_N gate rows n and the BLOCK_N up
rows I + n of t, two accumulators, so the epilogue pairs them without a layout change) and every
row of x; escapes from the lanes or the table (escapes.py), with x' at their columns where a norm
is fused. At M >= 5 the epilogue runs in the mma or hmma kernel's launch after its split-K sum
(mma.py's ``_fused_store``, hmma.py's ``_finish``), the norm as an rmsnorm kernel before it.

Norm handoff (``NormHandoff``). The fused stacks run no prologue: a residual GEMV (o, down) hands
the updated stream's norm to the GEMV after it (gate|up, the next layer's q|k|v). Its epilogue also
stores xg = dtype(stream · norm weight) at its columns and its Σ stream² per row (one part a
program); the consumer runs its plain loop on xg, sums the parts and multiplies its fp32 sums by
rsqrt(Σ · fp32(1/K) + eps), rmsnorm's per-row scale factored out of the dot product, before its
epilogue. So no kernel normalises x and the consumer's loop is unchanged; the roundings differ from
rmsnorm's (xg rounds stream · weight once; rmsnorm rounds x · inv, then its product with the
weight): about one bf16 step from the rmsnorm path for a GEMV; token forcing judges.

Numerics. The decoded weights are u12_linear's bit for bit, so the kernel computes fused_linear on
unpack_u12(t): the roundings are the unfused kernels' at every point, and what differs is order
(the fp32 sums, the escapes added last; the prologue's Σx²). fp fusion off on the GPU, as in
fused_linear. Where neither kernel applies (K % 4 != 0, a base outside the scaled range:
``fused_applies``), the unfused composition: rmsnorm, u12_linear, silu_mul and a torch add.
Measurements: docs/experiments/fused-linear.md.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor, unpack_u12

from ..bf16_words import aligned_rows
from ..fused_linear import check_linear_args, epilogue, fused_linear_reference
from ..overlap import Launch, pdl_args, pdl_enter
from ..rmsnorm import norm_words, normalize, parts_inv, rmsnorm, row_inv, row_inv_parts, row_inv_words
from ..rounding import to_dtype
from ..silu_mul import silu_mul, silu_mul_reference
from ..target import native as on_native
from ..tuning import KernelTuning, nearest_tuned
from .config import U12Config
from .decode import biased_scale, words_and_scales
from .dispatch import default_config, gemv_config, u12_linear
from .epilogue import block_m
from .escapes import (ESC_BLOCK, escape_ahead_init, escape_stage, escape_stages_left, escapes_ahead, lanes_args,
                      lanes_finish, lanes_gather, lanes_load, nonempty)
from .gemv2 import gemv2_applies
from .hmma import hmma_applies, launch_hmma
from .mma import launch_mma
from .planes import fma_planes, row_words, x_planes

@triton.jit
def _fused_chunk(
    acc_g, acc_u, start, x_rows, nw_rows, inv, gate_sm, gate_codes, up_sm, up_codes, n_words,
    BLOCK_W: tl.constexpr, X_WORDS: tl.constexpr, MASKED: tl.constexpr, NORM: tl.constexpr,
    GATED: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, ASM: tl.constexpr, TILED: tl.constexpr,
):
    """acc[m, n, w] += Σ_j x'[m, 4 w + j] · W[n, 4 w + j] 2^(113-base) over the words w in
    [start, start + BLOCK_W), for the gate rows and (GATED) the up rows; MASKED: words past K read as 0."""
    offs_w = (start + tl.arange(0, BLOCK_W))[None, None, :]
    mask = offs_w < n_words
    x0, x1, x2, x3 = x_planes(x_rows, offs_w, mask, X_WORDS, MASKED)
    if NORM:
        n0, n1, n2, n3 = x_planes(nw_rows, offs_w, mask, X_WORDS, MASKED)
        x0 = normalize(x0, inv, n0, DTYPE, ROUND_BF16)
        x1 = normalize(x1, inv, n1, DTYPE, ROUND_BF16)
        x2 = normalize(x2, inv, n2, DTYPE, ROUND_BF16)
        x3 = normalize(x3, inv, n3, DTYPE, ROUND_BF16)
    acc_g = fma_planes(acc_g, gate_sm, gate_codes, offs_w, mask, x0, x1, x2, x3, MASKED, ASM, TILED)
    if GATED:
        acc_u = fma_planes(acc_u, up_sm, up_codes, offs_w, mask, x0, x1, x2, x3, MASKED, ASM, TILED)
    return acc_g, acc_u


@triton.jit
def _u12_fused_gemv_kernel(
    x_ptr, nw_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr,
    hw_ptr, xg_ptr, parts_ptr,  # the norm handoff (NormHandoff): its weight, dtype(stream · weight), Σ parts
    M, N, K, n_words, y_scale, inv_k, eps, n_parts,
    stride_xm, stride_sm, stride_codes, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ESC_BLOCK: tl.constexpr,
    X_WORDS: tl.constexpr,  # bf16 x and norm weight read as int64 words of 4; else fp32 elements
    EVEN_K: tl.constexpr,  # n_words % BLOCK_W == 0: no masked last chunk
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    NORM_WORDS: tl.constexpr,  # X_WORDS: the norm prologue's chunk of x in words (norm_words: the whole row)
    ROUND_BF16: tl.constexpr,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr,  # libdevice's expf (GPU); else tl.exp (the interpreter has no libdevice)
    ASM: tl.constexpr,  # PTX prmt/lop3 (GPU); else their shift-and-mask emulation (interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    HAND_OUT: tl.constexpr = False,  # RESIDUAL: hand the updated stream's norm on (xg, Σ parts)
    HAND_IN: tl.constexpr = False,  # x is a handoff's xg: the sums times its rows' inv (from n_parts parts)
    BLOCK_P: tl.constexpr = 16,  # HAND_IN: parts summed a chunk (all of them in one: their loads in flight at once)
    LANES: tl.constexpr = 0,  # > 0: the escapes from t's lanes (U12Tensor.esc_lanes, LANES a row), not the table
    TILED: tl.constexpr = False,  # t's planes in tiles (U12Tensor.layout)
    PARTS_AFTER: tl.constexpr = False,  # HAND_IN (n_parts <= BLOCK_P): the parts loaded before the loop, summed after it (``parts_after``)
):
    """All M (<= 4) rows of x against BLOCK_N output rows (N: output columns; gated: rows n and N + n of t)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Rows past M or N re-read the last row (their outputs are not stored), so only K needs masks.
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1)[None, :, None]
    if NORM:
        if X_WORDS:
            inv_m = row_inv_words(x_ptr, rows_m, stride_xm // 4, n_words, inv_k, eps, BLOCK_M, NORM_WORDS)
        else:
            inv_m = row_inv(x_ptr, rows_m, stride_xm, K, inv_k, eps, BLOCK_M, 4 * BLOCK_W)
        inv = inv_m[:, None, None]
    else:
        inv_m = 1.0
        inv = 1.0
    if HAND_IN and PARTS_AFTER:  # one load in flight under the loop, its sum after it
        p_all = tl.arange(0, BLOCK_P)[:, None]
        parts_v = tl.load(parts_ptr + p_all * M + rows_m[None, :], mask=p_all < n_parts, other=0.0)
    elif HAND_IN:  # the norm's inv from the producer's parts (a few KB from L2), before the loop
        hand_inv = row_inv_parts(parts_ptr, rows_m, M, n_parts, inv_k, eps, BLOCK_M, BLOCK_P)
    # Every load has the accumulator's shape [BM, BN, 1 -> BW], so Triton gives them all its layout:
    # no layout conversion in the loop (as in gemv2 and fused_linear's gemv).
    shape: tl.constexpr = (BLOCK_M, BLOCK_N, 1)
    gate_sm = tl.broadcast_to(sm_ptr + row_words(rows_n, stride_sm, TILED), shape)
    gate_codes = tl.broadcast_to(codes_ptr + row_words(rows_n, stride_codes, TILED), shape)
    up_sm = tl.broadcast_to(sm_ptr + row_words(rows_n + N, stride_sm, TILED), shape)
    up_codes = tl.broadcast_to(codes_ptr + row_words(rows_n + N, stride_codes, TILED), shape)
    if X_WORDS:
        x_rows = tl.broadcast_to(x_ptr.to(tl.pointer_type(tl.int64)) + rows_m[:, None, None] * (stride_xm // 4), shape)
        nw_rows = tl.broadcast_to(nw_ptr.to(tl.pointer_type(tl.int64)) + 0 * rows_n, shape)
    else:
        x_rows = tl.broadcast_to(x_ptr + rows_m[:, None, None] * stride_xm, shape)
        nw_rows = tl.broadcast_to(nw_ptr + 0 * rows_n, shape)

    # The first escape block's row pointers load before the loop, the rest after it
    # (escapes.py's ``escape_stage``): the gate block's (rows n0.. of t) and, gated, the up block's
    # (rows N + n0..).
    eg0, eg_end, idx_g, val_g, xg_g, nw_g = escape_ahead_init(esc_idx_ptr, BLOCK_M, ESC_BLOCK)
    eu0, eu_end, idx_u, val_u, xg_u, nw_u = escape_ahead_init(esc_idx_ptr, BLOCK_M, ESC_BLOCK)
    if LANES:  # escapes.py's ``lanes_load``: the gate rows' and, gated, the up rows'
        lanes_g = lanes_load(lanes_ptr, rows_n, LANES, BLOCK_M, BLOCK_N)
        if GATED:
            lanes_u = lanes_load(lanes_ptr, rows_n + N, LANES, BLOCK_M, BLOCK_N)
    if not LANES:
        eg0, eg_end, idx_g, val_g, xg_g, nw_g = escape_stage(
            0, eg0, eg_end, idx_g, val_g, xg_g, nw_g, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr,
            x_ptr, nw_ptr, offs_m, mask_m, K, stride_xm, 1, BLOCK_N, ESC_BLOCK, NORM,
        )
        if GATED:
            eu0, eu_end, idx_u, val_u, xg_u, nw_u = escape_stage(
                0, eu0, eu_end, idx_u, val_u, xg_u, nw_u, esc_row_ptr, n0 + N, 2 * N, esc_idx_ptr,
                esc_val_ptr, x_ptr, nw_ptr, offs_m, mask_m, K, stride_xm, 1, BLOCK_N, ESC_BLOCK, NORM,
            )
    acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # reduced once, after the loop
    acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # GATED only (else unused)
    full_words = n_words - n_words % BLOCK_W
    for start in range(0, full_words, BLOCK_W):
        acc_g, acc_u = _fused_chunk(acc_g, acc_u, start, x_rows, nw_rows, inv, gate_sm, gate_codes, up_sm, up_codes,
                                    n_words, BLOCK_W, X_WORDS, False, NORM, GATED, DTYPE, ROUND_BF16, ASM, TILED)
    if HAND_IN and PARTS_AFTER:
        hand_inv = parts_inv(parts_v, inv_k, eps)  # row_inv_parts' sum of one chunk, bit for bit
    if LANES:  # escapes.py's ``lanes_gather``: x (NORM: x') at the lanes' columns
        rows_m3 = rows_m[:, None, None]
        spur_g, esc_g = lanes_gather(lanes_g, x_ptr, nw_ptr, rows_m3, stride_xm, K, inv, NORM, DTYPE, ROUND_BF16)
        if GATED:
            spur_u, esc_u = lanes_gather(lanes_u, x_ptr, nw_ptr, rows_m3, stride_xm, K, inv, NORM, DTYPE, ROUND_BF16)
    else:
        eg0, eg_end, idx_g, val_g, xg_g, nw_g = escape_stages_left(
            1, eg0, eg_end, idx_g, val_g, xg_g, nw_g, esc_row_ptr, n0, N, esc_idx_ptr,
            esc_val_ptr, x_ptr, nw_ptr, offs_m, mask_m, K, stride_xm, 1, BLOCK_N, ESC_BLOCK, NORM,
        )
        if GATED:
            eu0, eu_end, idx_u, val_u, xg_u, nw_u = escape_stages_left(
                1, eu0, eu_end, idx_u, val_u, xg_u, nw_u, esc_row_ptr, n0 + N, 2 * N,
                esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m, mask_m, K, stride_xm, 1, BLOCK_N, ESC_BLOCK, NORM,
            )
    if not EVEN_K:
        acc_g, acc_u = _fused_chunk(acc_g, acc_u, full_words, x_rows, nw_rows, inv, gate_sm, gate_codes, up_sm,
                                    up_codes, n_words, BLOCK_W, X_WORDS, True, NORM, GATED, DTYPE,
                                    ROUND_BF16, ASM, TILED)
    if LANES:  # scales the sums to y's
        g = lanes_finish(acc_g, spur_g, esc_g, y_scale)
        u = lanes_finish(acc_u, spur_u, esc_u, y_scale) if GATED else g
    else:
        g = escapes_ahead(  # scales the sums to y's
            tl.sum(acc_g, axis=2), eg0, eg_end, idx_g, val_g, xg_g, nw_g, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m,
            mask_m, offs_n, K, stride_xm, 1, ESC_BLOCK, nw_ptr, inv_m, NORM, DTYPE, ROUND_BF16, y_scale,
        )
        if GATED:
            u = escapes_ahead(  # the up block: rows N + n of t
                tl.sum(acc_u, axis=2), eu0, eu_end, idx_u, val_u, xg_u, nw_u, x_ptr, esc_idx_ptr, esc_val_ptr,
                offs_m, mask_m, offs_n + N, K, stride_xm, 1, ESC_BLOCK, nw_ptr, inv_m, NORM, DTYPE, ROUND_BF16, y_scale,
            )
        else:
            u = g
    if HAND_IN:  # rmsnorm's inv, factored out of the sums (x = dtype(stream · weight))
        g = g * hand_inv[:, None]
        u = u * hand_inv[:, None]
    mask = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y = epilogue(g, u, y_ptrs, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF,
                  parts_ptr + pid_n * M + offs_m, HAND_OUT)  # HAND_OUT: this program's Σ y² part
    if HAND_OUT:  # and dtype(y · weight) at these columns, the next GEMV's x
        hw = tl.load(hw_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(xg_ptr + offs_m[:, None] * stride_xg + offs_n[None, :],
                 to_dtype(y * hw[None, :], DTYPE, ROUND_BF16).to(DTYPE), mask=mask)

# --- configs and host -------------------------------------------------------------------------

INTERPRETER_CONFIG = U12Config(4, 8, num_warps=1, num_stages=1, kernel="gemv2")  # several N blocks and chunks
# M >= 5: the mma kernel's tiles under the interpreter (partial blocks, split-K, a masked chunk), and
# on the GPU where the dispatcher's config for the rows is not one that takes the epilogue.
MMA_INTERPRETER_CONFIG = U12Config(64, 16, split_k=2, num_warps=4, num_stages=2, kernel="mma")
MMA_DEFAULT_CONFIG = U12Config(64, 32, num_warps=4, num_stages=3, kernel="mma")

# This kernel's own M <= 4 configs, keyed (rows bucket, N weight rows, K, gated), from
# bench/kernels/u12_fused_linear.py and the AR step: o at 4-row blocks, one wave of 1024 programs
# (u12_fused_linear_h200.json; H100 AR step 4.477 ms against 4.489,
# docs/experiments/tried/step_ab_h100_parts-after-8726774.json); gate|up at 16 rows in 4 warps so its
# handed-in parts wait for the loop's end (4.448 ms against 4.467,
# docs/experiments/tried/step_ab_h100_gate-up-w4-a092850.json); qkv its derived tile, so the
# nearest-shape lookup does not hand it o's. Elsewhere ``fused_config`` derives the tile from the
# dispatcher's.
TUNED_FUSED: dict[tuple[int, int, int, bool], U12Config] = {
    (1, 6144, 4096, False): U12Config(4, 128, num_warps=4, num_stages=1, kernel="gemv2"),  # qkv
    (1, 4096, 4096, False): U12Config(4, 256, num_warps=4, num_stages=1, kernel="gemv2"),  # o
    (1, 28672, 4096, True): U12Config(16, 64, num_warps=4, num_stages=1, kernel="gemv2", maxnreg=72),  # gate|up
}


def fused_config(m: int, n: int, k: int, gated: bool, on_gpu: bool = True,
                 tuning: KernelTuning | None = None) -> U12Config:
    """For M <= 4: TUNED_FUSED's config where measured, or at the nearest measured shape
    (kernels/tuning.py); else the dispatcher's gemv2 config for the weight's n rows (2I when gated).
    A gated program holds two accumulators, so it takes half that tile: block_n halved from 8 up
    (never below 4), else block_w halved; the accumulator registers a thread holds are then the
    plain tile's. `tuning`: an engine's own tables ("u12_fused", and "u12" for the dispatcher's)."""
    if not on_gpu:
        return INTERPRETER_CONFIG
    table = TUNED_FUSED if tuning is None else tuning.table("u12_fused", TUNED_FUSED)
    tuned = nearest_tuned(table, (block_m(m), n, k, bool(gated)))
    if tuned is not None:
        return tuned
    cfg = gemv_config(m, n, k, tuning)
    if gated:
        half = dict(block_n=cfg.block_n // 2) if cfg.block_n >= 8 else dict(block_w=max(1, cfg.block_w // 2))
        cfg = dataclasses.replace(cfg, **half)
    return cfg


def parts_after(n_parts: int, rows: int, warps: int) -> bool:
    """Whether a consumer GEMV of `warps` warps loads the n_parts parts of its `rows` rows before its
    loop and sums them after it (one load of them all, at most 8 registers a thread, 4 warps or
    more), rather than summing them all before the loop, where the loop's first weight loads issue
    an L2 round trip late (H200 AR step 3.337 ms against 3.356: step_ab_h200.json, u12-parts-before)."""
    return 1 <= n_parts <= 1024 and n_parts * rows <= 8 * 32 * warps and warps >= 4


def fused_applies(m: int, k: int, base: int) -> bool:
    """Whether u12_fused_linear runs its epilogue in the GEMM's own launch: gemv2's fused kernel
    (M <= 4) or the mma and hmma kernels' epilogues (M >= 5), all on the scaled word path."""
    return words_and_scales(k, base)


def tensor_core_config(m: int, n: int, k: int, on_gpu: bool = True, layout: str = "rows",
                       tuning: KernelTuning | None = None) -> U12Config:
    """For M >= 5: the dispatcher's config for the weight's n rows (and layout) where it is a
    tensor-core kernel's (both take the epilogue), else the mma kernel's default tile."""
    if not on_gpu:
        return MMA_INTERPRETER_CONFIG
    cfg = default_config(m, n, k, layout=layout, tuning=tuning)
    return cfg if cfg.kernel in ("mma", "hmma") else MMA_DEFAULT_CONFIG


def _u12_check(x, t: U12Tensor, norm_weight, gated, residual) -> tuple[int, int, int]:
    """fused_linear's checks with a stand-in of t's shape and device (and x's dtype: t decodes to
    bf16 exactly, so x may be bf16 or fp32); its messages, naming t as `weight`."""
    stand_in = torch.empty(t.shape[1], dtype=x.dtype, device=t.device).expand(t.shape)  # rows of unit stride
    try:
        return check_linear_args(x, stand_in, norm_weight, gated, residual)
    except ValueError as e:
        raise ValueError(f"u12_{e}") from None


@dataclasses.dataclass
class NormHandoff:
    """An RMSNorm handed from one u12 GEMV to the next over the same residual stream, in place of an
    rmsnorm kernel between them (a fused kernel on both sides: gemv2's at M <= 4 rows, the mma or
    hmma kernel's epilogue at more; parts one a program of output columns, the hmma kernel's one a warp).

    The producer, ``u12_fused_linear(x, t, residual=stream, hand_out=h)``, adds its output into the
    stream and also stores ``h.xg`` = dtype(stream · h.weight) and each program's Σ stream² per row
    (``h.parts``, [programs, M] fp32, as RowSquares' parts). The consumer, ``u12_fused_linear(h.xg,
    t2, hand_in=h)``, runs on xg and multiplies its fp32 sums by inv = rsqrt(Σ parts · fp32(1/K) +
    eps) before its epilogue: rmsnorm's scale, a per-row factor, taken out of the dot product, so no
    kernel normalises x and the consumer's loop is the plain one. Not rmsnorm's roundings: rmsnorm
    rounds x · inv to dtype and then its product with the weight, this rounds stream · weight once
    and scales the fp32 sums (``u12_fused_linear_reference`` computes the same). The stream must not
    change in between; make one per norm (the buffers are allocated by the producer)."""

    weight: torch.Tensor  # [K] the norm's weight (K: the stream's width)
    eps: float = 1e-6
    xg: torch.Tensor | None = None  # [M, K] dtype(stream · weight), the consumer's x
    parts: torch.Tensor | None = None  # [programs, M] fp32 Σ stream² of each producer program's columns

    def allocate(self, y: torch.Tensor, programs: int) -> None:
        """The producer's buffers for an output y and `programs` parts a row (each launch anew)."""
        if self.weight.shape != (y.shape[1],):
            raise ValueError(f"u12_fused_linear: hand_out.weight must have shape ({y.shape[1]},) (the residual's "
                             f"width), got {tuple(self.weight.shape)}")
        self.xg = torch.empty_like(y)
        self.parts = torch.empty((programs, y.shape[0]), dtype=torch.float32, device=y.device)


def launch_fused_gemv(
    x, t: U12Tensor, norm_weight, eps, gated, y, residual: bool, cfg: U12Config, native: bool,
    hand_out: NormHandoff | None = None, hand_in: NormHandoff | None = None, launch: Launch | None = None,
) -> None:
    """y from ``_u12_fused_gemv_kernel`` (residual: y is the residual, added into), one program per
    block_n output columns; hand_out: also the stream's norm handed on; hand_in: x is a handoff's xg."""
    m, k = x.shape
    n_out = y.shape[1]
    n_words = k // 4
    x_words = x.dtype == torch.bfloat16
    x = aligned_rows(x, x_words)
    norm = norm_weight is not None
    nw = aligned_rows(norm_weight, x_words) if norm else x
    sm, codes = t.sm.contiguous(), t.codes.contiguous()
    programs = triton.cdiv(n_out, cfg.block_n)
    if hand_out is not None:
        hand_out.allocate(y, programs)
        hw, xg, parts, n_parts = hand_out.weight.contiguous(), hand_out.xg, hand_out.parts, programs
        eps = hand_out.eps
    elif hand_in is not None:
        hw, xg, parts, n_parts = x, x, hand_in.parts, hand_in.parts.shape[0]
        eps = hand_in.eps
    else:
        hw, xg, parts, n_parts = x, x, y, 0
    # fp fusion off, as in fused_linear: sum · (1/K) + eps and 1 + exp(-g) round as torch's do.
    opts = {**cfg.launch_options(native), "enable_fp_fusion": False} if native else {}
    lanes, n_lanes = lanes_args(t)
    _u12_fused_gemv_kernel[(programs,)](
        x, nw, sm.view(torch.int32), codes.view(torch.int16),
        nonempty(t.esc_idx), nonempty(t.esc_val), t.esc_row_ptr, lanes, y, hw, xg, parts,
        m, n_out, k, n_words, biased_scale(t.base), 1.0 / k, eps, n_parts,
        x.stride(0), n_words, n_words, y.stride(0), xg.stride(0),
        BLOCK_M=block_m(m), BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=ESC_BLOCK,
        NORM_WORDS=norm_words(k, block_m(m), cfg.num_warps),
        X_WORDS=x_words, EVEN_K=n_words % cfg.block_w == 0,
        NORM=norm, GATED=bool(gated), RESIDUAL=residual,
        ROUND_BF16=not native and x.dtype == torch.bfloat16, EXPF=native, ASM=native, **opts, **pdl_args(x.device, launch),
        HAND_OUT=hand_out is not None, HAND_IN=hand_in is not None,
        BLOCK_P=min(1024, triton.next_power_of_2(max(1, n_parts))), LANES=n_lanes, TILED=t.layout == "tiles",
        PARTS_AFTER=parts_after(n_parts, block_m(m), cfg.num_warps) if hand_in is not None else False,
    )


def _check_handoff(x, t: U12Tensor, norm_weight, gated, residual, hand_out, hand_in) -> None:
    """The handoff's conditions (``NormHandoff``), as ValueErrors naming the argument."""
    if hand_out is None and hand_in is None:
        return
    if hand_out is not None and hand_in is not None:
        raise ValueError("u12_fused_linear: hand_out and hand_in cannot both be given")
    if not fused_applies(x.shape[0], x.shape[1], t.base):
        raise ValueError(f"u12_fused_linear: a norm handoff needs a fused kernel (K % 4 == 0 and a scaled base), "
                         f"got K = {x.shape[1]}, base {t.base}")
    if norm_weight is not None:
        raise ValueError("u12_fused_linear: norm_weight must be None with a norm handoff (the handoff holds the norm)")
    if hand_out is not None and (residual is None or gated):
        raise ValueError("u12_fused_linear: hand_out needs residual= (the stream) and gated=False")
    if hand_in is not None and (hand_in.xg is None or x.data_ptr() != hand_in.xg.data_ptr()
                                or x.shape != hand_in.xg.shape):
        raise ValueError("u12_fused_linear: with hand_in, x must be hand_in.xg as its producer wrote it")


def u12_fused_linear(
    x: torch.Tensor, t: U12Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    gated: bool = False, residual: torch.Tensor | None = None, config: U12Config | None = None,
    hand_out: NormHandoff | None = None, hand_in: NormHandoff | None = None, launch: Launch | None = None,
    tuning: KernelTuning | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) · t [N, K]ᵀ (u12) in x's dtype, fp32 sums; norm_weight: x replaced by
    rmsnorm(x, norm_weight, eps) first; gated: t is [gate; up] (N = 2I) and the output [M, I] is
    silu(gate) · up; residual [M, N_out]: the output is added into it in place and it is returned.
    One fused launch where gemv2 applies (M <= 4, K % 4 == 0, a scaled base); at M >= 5 on that
    path an rmsnorm kernel (norm_weight) and the mma or hmma kernel with the epilogue; else the
    unfused rmsnorm, u12_linear, silu_mul and torch add. config: a gemv2 U12Config at M <= 4
    (``fused_config``), an mma or hmma one above (``tensor_core_config``). hand_out (with residual) /
    hand_in (x = hand_in.xg): a ``NormHandoff`` from this GEMV to the next, fused kernels only.
    `launch`: PDL (kernels/overlap.py). `tuning`: the tuned tables configs come from (an engine's own)."""
    m, k, n_out = _u12_check(x, t, norm_weight, gated, residual)
    _check_handoff(x, t, norm_weight, gated, residual, hand_out, hand_in)
    want = ("gemv2",) if m <= 4 else ("mma", "hmma")
    if config is not None and config.kernel not in want:
        raise ValueError(f"u12_fused_linear: config must be a {' or '.join(want)} U12Config at {m} rows, "
                         f"got kernel {config.kernel!r}")
    y = residual if residual is not None else torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y
    if norm_weight is not None and norm_weight.stride(0) != 1:
        norm_weight = norm_weight.contiguous()
    native = on_native(x)
    if m > 4 and fused_applies(m, k, t.base):  # a tensor-core kernel with the epilogue; the norm as an rmsnorm kernel
        h = rmsnorm(x, norm_weight, eps, launch=launch) if norm_weight is not None else x
        cfg = config or tensor_core_config(m, t.shape[0], k, on_gpu=native, layout=t.layout, tuning=tuning)
        if cfg.kernel == "hmma" and hmma_applies(h, k, t.base):
            launch_hmma(h, t, y, cfg, gated=bool(gated), residual=residual is not None, hand_in=hand_in,
                        hand_out=hand_out, launch=launch)
        else:
            launch_mma(h, t, y, cfg if cfg.kernel == "mma" else MMA_DEFAULT_CONFIG, gated=bool(gated),
                       residual=residual is not None, hand_in=hand_in, hand_out=hand_out, launch=launch)
        return y
    if not gemv2_applies(m, k, t.base):
        h = rmsnorm(x, norm_weight, eps, launch=launch) if norm_weight is not None else x
        out = u12_linear(h, t, launch=launch, tuning=tuning)
        if gated:
            out = silu_mul(out, launch=launch)
        return out if residual is None else residual.add_(out)
    cfg = config or fused_config(m, t.shape[0], k, gated, on_gpu=native, tuning=tuning)
    launch_fused_gemv(x, t, norm_weight, eps, gated, y, residual is not None, cfg, native, hand_out, hand_in, launch)
    return y


def u12_fused_linear_reference(
    x: torch.Tensor, t: U12Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    gated: bool = False, residual: torch.Tensor | None = None,
    hand_out: NormHandoff | None = None, hand_in: NormHandoff | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """fused_linear_reference on the unpacked weight in x's dtype (bf16 -> fp32 is exact); with a
    ``NormHandoff``, its math in torch: hand_out stores xg = dtype(stream · weight) and the whole
    row's Σ stream² as one part; hand_in scales the fp32 sums by rsqrt(Σ parts · fp32(1/K) + eps)
    before the epilogue's roundings. `launch` is the kernel's argument, unused here."""
    _u12_check(x, t, norm_weight, gated, residual)
    w = unpack_u12(t).to(x.dtype)
    if hand_in is None:
        y = fused_linear_reference(x, w, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
    else:
        inv = torch.rsqrt(hand_in.parts.sum(0) * torch.tensor(1.0 / x.shape[1], dtype=torch.float32) + hand_in.eps)
        y = ((x.float() @ w.float().T) * inv[:, None]).to(x.dtype)
        if gated:
            y = silu_mul_reference(y)
        if residual is not None:
            y = residual.add_(y)
    if hand_out is not None:
        s = residual.float()
        hand_out.xg = (s * hand_out.weight.float()).to(residual.dtype)
        hand_out.parts = (s * s).sum(1)[None, :]
    return y
