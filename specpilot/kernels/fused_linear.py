"""y = x · Wᵀ for bf16/fp32 weights, with an RMSNorm prologue and a SiLU·mul or residual-add epilogue.

`fused_linear(x, weight, norm_weight=, gated=, residual=)` is, in one launch, what a decoder layer
runs as up to three: rmsnorm(x) (kernels/rmsnorm.py), the GEMM (cuBLAS), then silu_mul
(kernels/silu_mul.py) on the gate|up output or the residual add. At batch 1 a Llama layer runs
five launches fewer: the two rmsnorms, silu_mul, and cuBLAS's split-K reduces of o and down.

Kernels. ``_gemv_kernel`` ("gemv", M <= 4 rows a program) runs on the CUDA cores in the style of
u12's gemv2: one program owns BLOCK_N output rows (gated: the BLOCK_N gate rows n and the BLOCK_N
up rows I + n, two accumulators, so the epilogue pairs them without a layout change) and every row
of x, and loops over K in chunks of BLOCK_W words of 4 weights. bf16 weights are read as int64
words of 4 where K % 4 == 0, the row stride % 4 == 0 and the pointer is 8-byte aligned (x and the
norm weight likewise, copied where misaligned: kernels/bf16_words.py), split into four fp32 planes
(plane j: weight 4 w + j); else (fp32, odd K, misaligned W) four contiguous element loads a chunk
(plane j: elements 4 w0 + j BLOCK_W + w). Each plane FMAs into one [BM, BN, BW] fp32 accumulator,
reduced once after the loop (no join or reshape in the loop: that costs a shared-memory round trip
a chunk). Every load has the accumulator's shape, rows past M and N re-read the last row, and only
a last partial chunk of K is masked. ``_dot_kernel`` ("dot", 16-64 rows a program) feeds tl.dot
with W as the wide side, acc[BN, BM] += W[BN, BK] · x[BM, BK]ᵀ: bf16 operands on the GPU for bf16
x, fp32 "ieee" ones for fp32 x and under the interpreter (its bf16 dot is wrong).

Prologue (norm_weight). Each program first sums x² over K for its rows, then normalises every x
chunk in registers as rmsnorm does: inv = rsqrt(Σx² · fp32(1/K) + eps), n = dtype(x · inv),
x' = dtype(norm_weight · n). On the word path the sum reads the whole row as int64 words in one
chunk (rmsnorm's ``row_inv_words``): one memory round trip before the main loop. Epilogues, in
fp32 from the fp32 sums: gated: g, u = dtype(sums), s = dtype(g / (1 + exp(-g))) (IEEE division,
libdevice expf on the GPU), y = dtype(s · u); residual: residual = dtype(dtype(y) + residual), in
place.

Sums of squares handed on (dot only; ``RowSquares``). A call with ``residual=`` and ``squares=``
also stores, for each output block of the updated stream, Σ y² of each row over the block's
columns; the next call with ``norm_weight=`` over that stream and ``squares=`` sums those parts
(rmsnorm's ``row_inv_parts``) instead of reading every row of x in every program (at 16 rows and
K = 4096, 128 KB a program). Without them the dot prologue reads x as int64 words of whole rows
in 2-4 chunks (``DOT_NORM_WORDS``).

Split-K (dot only): kernels/split_k.py's serial semaphore; each program stores its fp32 partials
([gate, up] × split × M × N), the last of an output block sums them in split order and runs the
epilogue.

Numerics. The roundings are the unfused kernels' (and torch's) at every point; what differs is
order: the fp32 GEMM sums, so a bf16 output can land one bf16 step from the reference where the
exact sum sits near a rounding boundary; and the prologue's Σx², so inv can differ in the last ulps
and a normalised element one bf16 step where it sits on a boundary. Given the same GEMM sums the
epilogues are bit-exact with silu_mul (GPU: libdevice expf, div_rn, fp fusion off as there) and
torch's add. The interpreter truncates fp32 -> bf16 casts, so under it every such cast rounds
first, and exp is numpy's.

Configs are data (``FusedLinearConfig``); ``default_config`` takes ``TUNED`` first (keyed by the M
bucket, weight rows, K, gated), else a heuristic; bench/kernels/fused_linear.py sweeps the
Llama-3.1-8B shapes against the unfused kernels. Measurements and what was tried:
docs/experiments/fused-linear.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .bf16_words import aligned_rows, bf16x4_to_fp32
from .overlap import Launch, pdl_args, pdl_enter
from .registry import KernelSpec, register
from .rmsnorm import norm_words, normalize, rmsnorm_reference, row_inv, row_inv_parts, row_inv_words
from .rounding import to_dtype
from .silu_mul import silu_mul_reference
from .split_k import split_counters
from .target import native as on_native
from .tuning import KernelTuning, nearest_tuned

SM_COUNT_H200 = 132
# Words of x a thread of the dot kernel's norm prologue holds a chunk: 32 (64 registers, before the
# main loop) puts a 16-row, K = 4096 prologue in 2 chunks at 8 warps, 4 at 4, where BLOCK_K chunks
# of elements took 32-64 (each waited on before the next, an L2 round trip).
DOT_NORM_WORDS = 32
_DTYPES = (torch.bfloat16, torch.float32)


# --- shared pieces ---------------------------------------------------------------------------

@triton.jit
def epilogue(
    g, u, y_ptrs, mask, DTYPE: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    ROUND_BF16: tl.constexpr, EXPF: tl.constexpr, sq_ptrs=None, SQ_OUT: tl.constexpr = False,
    res=0.0, RES_LOADED: tl.constexpr = False,
):
    """Store dtype(g), or silu_mul's dtype(dtype(silu(g)) · u) (GATED); RESIDUAL: add it to the
    residual that y_ptrs points at, rounded as torch's add (RES_LOADED: `res`, the caller's fp32 load
    of it, so that a caller storing several elements issues their loads before any store: a load
    after a store that may alias waits for it). SQ_OUT: also store Σ y² of each row's stored values
    at sq_ptrs [BM] (this program's part of RowSquares). Returns the stored values (fp32, each
    exactly its stored dtype value)."""
    y = to_dtype(g, DTYPE, ROUND_BF16)
    if GATED:
        up = to_dtype(u, DTYPE, ROUND_BF16)
        if EXPF:
            e = libdevice.exp(-y)
        else:
            e = tl.exp(-y)
        s = to_dtype(tl.math.div_rn(y, 1.0 + e), DTYPE, ROUND_BF16)
        y = to_dtype(s * up, DTYPE, ROUND_BF16)
    if RESIDUAL:
        r = res
        if not RES_LOADED:
            r = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        y = to_dtype(y + r, DTYPE, ROUND_BF16)
    tl.store(y_ptrs, y.to(DTYPE), mask=mask)
    if SQ_OUT:
        ys = tl.where(mask, y, 0.0)
        tl.store(sq_ptrs, tl.sum(ys * ys, axis=1), mask=tl.max(mask.to(tl.int32), axis=1) > 0)
    return y


# --- the GEMV kernel for M <= 4 ("gemv") ------------------------------------------------------

@triton.jit
def _load_planes(rows, w0, K, BLOCK_W: tl.constexpr, WORDS: tl.constexpr, MASKED: tl.constexpr):
    """The chunk of words [w0, w0 + BLOCK_W) of `rows` ([BM, BN, 1] pointers) as four fp32 planes
    [BM, BN, BW]. WORDS: int64 words of 4 bf16, plane j = element 4 w + j, split by one shift or
    mask each; else plane j = elements 4 w0 + j BLOCK_W + w, four contiguous loads. MASKED:
    elements past K read as 0."""
    offs = tl.arange(0, BLOCK_W)[None, None, :]
    if WORDS:
        offs_w = w0 + offs
        if MASKED:
            v = tl.load(rows + offs_w, mask=offs_w < K // 4, other=0)
        else:
            v = tl.load(rows + offs_w)
        p0, p1, p2, p3 = bf16x4_to_fp32(v)
    else:
        k = 4 * w0 + offs
        if MASKED:
            p0 = tl.load(rows + k, mask=k < K, other=0.0).to(tl.float32)
            p1 = tl.load(rows + k + BLOCK_W, mask=k + BLOCK_W < K, other=0.0).to(tl.float32)
            p2 = tl.load(rows + k + 2 * BLOCK_W, mask=k + 2 * BLOCK_W < K, other=0.0).to(tl.float32)
            p3 = tl.load(rows + k + 3 * BLOCK_W, mask=k + 3 * BLOCK_W < K, other=0.0).to(tl.float32)
        else:
            p0 = tl.load(rows + k).to(tl.float32)
            p1 = tl.load(rows + k + BLOCK_W).to(tl.float32)
            p2 = tl.load(rows + k + 2 * BLOCK_W).to(tl.float32)
            p3 = tl.load(rows + k + 3 * BLOCK_W).to(tl.float32)
    return p0, p1, p2, p3


@triton.jit
def _gemv_chunk(
    acc_g, acc_u, w0, x_rows, wg_rows, wu_rows, nw_rows, inv, K,
    BLOCK_W: tl.constexpr, WORDS: tl.constexpr, MASKED: tl.constexpr, NORM: tl.constexpr,
    GATED: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    """acc[m, n, w] += Σ_j x'[m, plane j] · W[n, plane j] for the chunk at word w0 (gate and up)."""
    x0, x1, x2, x3 = _load_planes(x_rows, w0, K, BLOCK_W, WORDS, MASKED)
    if NORM:
        n0, n1, n2, n3 = _load_planes(nw_rows, w0, K, BLOCK_W, WORDS, MASKED)
        x0 = normalize(x0, inv, n0, DTYPE, ROUND_BF16)
        x1 = normalize(x1, inv, n1, DTYPE, ROUND_BF16)
        x2 = normalize(x2, inv, n2, DTYPE, ROUND_BF16)
        x3 = normalize(x3, inv, n3, DTYPE, ROUND_BF16)
    g0, g1, g2, g3 = _load_planes(wg_rows, w0, K, BLOCK_W, WORDS, MASKED)
    acc_g = tl.fma(x0, g0, acc_g)
    acc_g = tl.fma(x1, g1, acc_g)
    acc_g = tl.fma(x2, g2, acc_g)
    acc_g = tl.fma(x3, g3, acc_g)
    if GATED:
        u0, u1, u2, u3 = _load_planes(wu_rows, w0, K, BLOCK_W, WORDS, MASKED)
        acc_u = tl.fma(x0, u0, acc_u)
        acc_u = tl.fma(x1, u1, acc_u)
        acc_u = tl.fma(x2, u2, acc_u)
        acc_u = tl.fma(x3, u3, acc_u)
    return acc_g, acc_u


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, nw_ptr, y_ptr,
    M, N, K, inv_k, eps, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    WORDS: tl.constexpr,  # x, W and norm weight read as int64 words of 4 bf16; strides then count words
    EVEN_K: tl.constexpr,  # K % (4 BLOCK_W) == 0: no masked last chunk
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    NORM_WORDS: tl.constexpr,  # WORDS: the norm prologue's chunk of x in words (norm_words: the whole row)
    ROUND_BF16: tl.constexpr,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr,  # libdevice's expf (GPU); else tl.exp (the interpreter has no libdevice)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
):
    """BLOCK_M rows of x against BLOCK_N output rows (N: output columns; gated: W rows n and N + n)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M or N re-read the last row (their outputs are not stored), so only K needs masks.
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None]
    if NORM and WORDS:
        inv = row_inv_words(x_ptr, rows_m, stride_xm, K // 4, inv_k, eps, BLOCK_M, NORM_WORDS)[:, None, None]
    elif NORM:
        inv = row_inv(x_ptr, rows_m, stride_xm, K, inv_k, eps, BLOCK_M, 4 * BLOCK_W)[:, None, None]
    else:
        inv = 1.0
    if WORDS:
        x_base = x_ptr.to(tl.pointer_type(tl.int64))
        w_base = w_ptr.to(tl.pointer_type(tl.int64))
        nw_base = nw_ptr.to(tl.pointer_type(tl.int64))
    else:
        x_base = x_ptr
        w_base = w_ptr
        nw_base = nw_ptr
    # Every load has the accumulator's shape [BM, BN, 1 -> BW] (repeated loads merge in LLVM), so
    # Triton gives them all its layout: no layout conversion in the loop (as in u12_linear's gemv2).
    shape: tl.constexpr = (BLOCK_M, BLOCK_N, 1)
    x_rows = tl.broadcast_to(x_base + rows_m.to(tl.int64)[:, None, None] * stride_xm, shape)
    wg_rows = tl.broadcast_to(w_base + rows_n * stride_wn, shape)
    wu_rows = tl.broadcast_to(w_base + (rows_n + N) * stride_wn, shape)
    nw_rows = tl.broadcast_to(nw_base + 0 * rows_n, shape)

    acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # reduced once, after the loop
    acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # GATED only (else unused)
    full_words = (K // (4 * BLOCK_W)) * BLOCK_W
    for w0 in range(0, full_words, BLOCK_W):
        acc_g, acc_u = _gemv_chunk(acc_g, acc_u, w0, x_rows, wg_rows, wu_rows, nw_rows, inv, K,
                                   BLOCK_W, WORDS, False, NORM, GATED, DTYPE, ROUND_BF16)
    if not EVEN_K:
        acc_g, acc_u = _gemv_chunk(acc_g, acc_u, full_words, x_rows, wg_rows, wu_rows, nw_rows, inv, K,
                                   BLOCK_W, WORDS, True, NORM, GATED, DTYPE, ROUND_BF16)
    g = tl.sum(acc_g, axis=2)
    u = tl.sum(acc_u, axis=2) if GATED else g
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    epilogue(g, u, y_ptrs, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF)


# --- the tensor-core kernel ("dot") -----------------------------------------------------------

@triton.jit
def _dot_kernel(
    x_ptr, w_ptr, nw_ptr, y_ptr, part_ptr, count_ptr, sq_ptr,
    M, N, K, k_per_split, part_stride, inv_k, eps, stride_xm, stride_wn, stride_ym, sq_parts,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks
    NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,  # ways over K; > 1: partials and the semaphore (constexpr: the sum unrolls)
    DOT_BF16: tl.constexpr,  # bf16 operands (GPU, bf16 x); else fp32 "ieee" dots
    NORM_WORDS: tl.constexpr,  # > 0: the norm prologue reads x as int64 words, this many a chunk (norm_words)
    SQ_IN: tl.constexpr,  # NORM: the rows' Σx² from RowSquares' sq_parts parts at sq_ptr, not from x
    SQ_OUT: tl.constexpr,  # RESIDUAL: store this program's part of Σy² of the updated rows at sq_ptr
    SQ_BLOCK: tl.constexpr,  # SQ_IN: parts summed a chunk
    ROUND_BF16: tl.constexpr, EXPF: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
):
    """BLOCK_M rows of x against BLOCK_N output rows over K range pid_k of SPLIT_K."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.minimum(offs_m, M - 1)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    if NORM and SQ_IN:
        inv = row_inv_parts(sq_ptr, rows_m, M, sq_parts, inv_k, eps, BLOCK_M, SQ_BLOCK)[:, None]
    elif NORM and NORM_WORDS > 0:
        inv = row_inv_words(x_ptr, rows_m, stride_xm // 4, K // 4, inv_k, eps, BLOCK_M, NORM_WORDS)[:, None]
    elif NORM:
        inv = row_inv(x_ptr, rows_m, stride_xm, K, inv_k, eps, BLOCK_M, BLOCK_K)[:, None]
    else:
        inv = 1.0
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    wg_rows = w_ptr + rows_n[:, None] * stride_wn
    wu_rows = w_ptr + (rows_n + N)[:, None] * stride_wn

    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ: W is the dot's wide side
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # GATED only
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)[None, :]  # k_per_split is a multiple of BLOCK_K: masks need only K
        if EVEN_K:
            xt = tl.load(x_rows + k)
            wg = tl.load(wg_rows + k)
        else:
            xt = tl.load(x_rows + k, mask=k < K, other=0.0)
            wg = tl.load(wg_rows + k, mask=k < K, other=0.0)
        if NORM:
            if EVEN_K:
                nw = tl.load(nw_ptr + k)
            else:
                nw = tl.load(nw_ptr + k, mask=k < K, other=0.0)
            xt = normalize(xt.to(tl.float32), inv, nw.to(tl.float32), DTYPE, ROUND_BF16)
        if DOT_BF16:
            xb = tl.trans(xt.to(tl.bfloat16))
            acc_g = tl.dot(wg, xb, acc_g)
        else:
            xb = tl.trans(xt.to(tl.float32))
            acc_g = tl.dot(wg.to(tl.float32), xb, acc_g, input_precision="ieee")
        if GATED:
            if EVEN_K:
                wu = tl.load(wu_rows + k)
            else:
                wu = tl.load(wu_rows + k, mask=k < K, other=0.0)
            if DOT_BF16:
                acc_u = tl.dot(wu, xb, acc_u)
            else:
                acc_u = tl.dot(wu.to(tl.float32), xb, acc_u, input_precision="ieee")
    g = tl.trans(acc_g)
    u = tl.trans(acc_u) if GATED else g

    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    sq_ptrs = sq_ptr + pid_n * M + offs_m  # SQ_OUT: this output block's part
    if SPLIT_K > 1:
        part = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # [split, gate/up, M, N] fp32
        own = part + pid_k.to(tl.int64) * part_stride
        if GATED:
            own += pid_k.to(tl.int64) * part_stride
            tl.store(own + part_stride, u, mask=mask)
        tl.store(own, g, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last program of this block sums, in split order
            g_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for _ in tl.static_range(SPLIT_K):  # unrolled: every partial's load in flight at once
                g_sum += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                part += part_stride
                if GATED:
                    u_sum += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                    part += part_stride
            epilogue(g_sum, u_sum, y_ptrs, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF, sq_ptrs, SQ_OUT)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA graph replays)
    else:
        epilogue(g, u, y_ptrs, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF, sq_ptrs, SQ_OUT)


# --- configs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class FusedLinearConfig:
    """One launch configuration. kernel "gemv": ``_gemv_kernel`` (up to 4 rows of x a program),
    block_k = 4 · words a chunk; "dot": ``_dot_kernel`` (block_m rows a program, 0: 16..64 from
    M), block_k a tile, split_k ways over K."""

    kernel: str
    block_n: int
    block_k: int
    block_m: int = 0
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    maxnreg: int = 0  # registers a thread ptxas may use (PTX .maxnreg, on the GPU); 0: its choice

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"FusedLinearConfig.maxnreg: expected 0 (the compiler's choice) or 24..255, got {self.maxnreg}")
        if self.kernel not in ("gemv", "dot"):
            raise ValueError(f"FusedLinearConfig.kernel: expected 'gemv' or 'dot', got {self.kernel!r}")
        if not pow2(self.block_n):
            raise ValueError(f"FusedLinearConfig.block_n: expected a power of two, got {self.block_n}")
        if self.kernel == "gemv":
            if self.block_k < 4 or not pow2(self.block_k):
                raise ValueError(f"FusedLinearConfig.block_k: gemv takes a power of two >= 4, got {self.block_k}")
            if self.split_k != 1 or self.block_m != 0:
                raise ValueError(f"FusedLinearConfig: gemv has no split_k or block_m, got {self}")
        else:
            if self.block_k < 16 or not pow2(self.block_k) or self.block_n < 16:
                raise ValueError(f"FusedLinearConfig: dot needs block_n and block_k >= 16, powers of two, got {self}")
            if self.block_m not in (0, 16, 32, 64):
                raise ValueError(f"FusedLinearConfig.block_m: dot takes 0, 16, 32 or 64, got {self.block_m}")
            if self.split_k < 1:
                raise ValueError(f"FusedLinearConfig.split_k: expected >= 1, got {self.split_k}")

    def __str__(self) -> str:
        regs = f"-r{self.maxnreg}" if self.maxnreg else ""
        if self.kernel == "gemv":
            return f"gemv-bn{self.block_n}-bk{self.block_k}-w{self.num_warps}-s{self.num_stages}{regs}"
        return (f"dot-bm{self.block_m or 'auto'}-bn{self.block_n}-bk{self.block_k}-sk{self.split_k}"
                f"-w{self.num_warps}-s{self.num_stages}{regs}")


def _block_m(m: int, cfg: FusedLinearConfig) -> int:
    """Rows of x a program: up to 4 for gemv, 16..64 for dot."""
    if cfg.kernel == "gemv":
        return min(4, triton.next_power_of_2(m))
    return cfg.block_m or min(64, max(16, triton.next_power_of_2(m)))


def m_bucket(m: int) -> int:
    """TUNED's M key: 1, 2, 4 (gemv rows), 16, 32, 64 (dot rows; 64 for any larger M)."""
    return triton.next_power_of_2(m) if m <= 4 else min(64, max(16, triton.next_power_of_2(m)))


def gemv_acc_registers(cfg: FusedLinearConfig, block_m: int, gated: bool) -> int:
    """fp32 accumulator registers a thread of the gemv kernel holds ([BM, BN, BW], two if gated)."""
    return (2 if gated else 1) * block_m * cfg.block_n * (cfg.block_k // 4) // (32 * cfg.num_warps)


# Best configs measured by bench/kernels/fused_linear.py on the H200, keyed (m_bucket(M), weight rows
# N, K, gated): Llama-3.1-8B's layer shapes. M = 1: fused_linear_h200_graph.json and the AR step
# (step_ab_h200_bf16-tuned.json; maxnreg 128 on o and down: every load before the first FMA, the AR
# step 4.142 ms against 4.237 at b8d00fd); M = 4: fused_linear_h200.json; M = 16:
# fused_linear_h200_m16-graph.json; M = 32: fused_linear_h200_m32-graph.json.
# docs/experiments/fused-linear.md has the figures.
TUNED: dict[tuple[int, int, int, bool], FusedLinearConfig] = {
    (1, 6144, 4096, False): FusedLinearConfig("gemv", 8, 1024, num_warps=4, num_stages=1),  # qkv
    (4, 6144, 4096, False): FusedLinearConfig("gemv", 8, 1024, num_warps=4, num_stages=1),  # qkv
    (16, 6144, 4096, False): FusedLinearConfig("dot", 128, 64, split_k=2, num_warps=4, num_stages=6),  # qkv
    (32, 6144, 4096, False): FusedLinearConfig("dot", 128, 64, split_k=2, num_warps=4, num_stages=6),  # qkv
    (1, 4096, 4096, False): FusedLinearConfig("gemv", 4, 1024, num_warps=2, num_stages=3, maxnreg=128),  # o
    (4, 4096, 4096, False): FusedLinearConfig("gemv", 4, 1024, num_warps=2, num_stages=3),  # o
    (16, 4096, 4096, False): FusedLinearConfig("dot", 64, 128, split_k=2, num_warps=4, num_stages=5),  # o
    (32, 4096, 4096, False): FusedLinearConfig("dot", 64, 128, split_k=2, num_warps=4, num_stages=5),  # o
    (1, 28672, 4096, True): FusedLinearConfig("gemv", 2, 1024, num_warps=2, num_stages=1, maxnreg=128),  # gate_up
    (4, 28672, 4096, True): FusedLinearConfig("gemv", 4, 512, num_warps=2, num_stages=1),  # gate_up
    (16, 28672, 4096, True): FusedLinearConfig("dot", 128, 128, num_warps=8, num_stages=3),  # gate_up
    (32, 28672, 4096, True): FusedLinearConfig("dot", 128, 128, num_warps=8, num_stages=3),  # gate_up
    (1, 4096, 14336, False): FusedLinearConfig("gemv", 4, 1024, num_warps=2, num_stages=1, maxnreg=128),  # down
    (4, 4096, 14336, False): FusedLinearConfig("dot", 64, 128, split_k=4, num_warps=4, num_stages=3),  # down
    (16, 4096, 14336, False): FusedLinearConfig("dot", 64, 128, split_k=2, num_warps=4, num_stages=5),  # down
    (32, 4096, 14336, False): FusedLinearConfig("dot", 64, 64, split_k=4, num_warps=4, num_stages=4),  # down
}

# Small tiles under the interpreter: several chunks, a masked last one, and split-K on the CPU too.
_INTERPRETER_GEMV = FusedLinearConfig("gemv", 8, 32, num_warps=2)
_INTERPRETER_DOT = FusedLinearConfig("dot", 32, 32, split_k=2)


def default_config(m: int, n: int, k: int, gated: bool, on_gpu: bool = True,
                   tuning: KernelTuning | None = None) -> FusedLinearConfig:
    """TUNED (or `tuning`'s "fused_linear" table: an engine's own) where measured (n: weight rows,
    2I when gated), or at the nearest measured shape (kernels/tuning.py); else gemv for M <= 4 (16-64
    accumulator registers a thread; M = 1, 2: u12_linear gemv2's most frequent winner), else dot
    with enough programs for two a SM through split-K (the heuristic is unmeasured)."""
    if not on_gpu:
        return _INTERPRETER_GEMV if m <= 4 else _INTERPRETER_DOT
    table = TUNED if tuning is None else tuning.table("fused_linear", TUNED)
    tuned = nearest_tuned(table, (m_bucket(m), n, k, bool(gated)))
    if tuned is not None:
        return tuned
    if m <= 2:
        return FusedLinearConfig("gemv", 8, 512, num_warps=2)
    if m <= 4:  # 8 rows (gated: 4 + 4) a thread share each normalised x element (sm_90 SASS)
        return FusedLinearConfig("gemv", 8 if gated else 16, 256, num_warps=2)
    tile = FusedLinearConfig("dot", 64, 64, num_warps=4, num_stages=4)
    n_out = n // 2 if gated else n
    blocks = triton.cdiv(n_out, tile.block_n) * triton.cdiv(m, m_bucket(m))
    # >= 2 tiles and 512 columns a split: at small K (the zoo's 256) a split only adds the semaphore's
    # partials and serial sum to a launch-bound call
    split = max(1, min(8, 2 * SM_COUNT_H200 // blocks, k // (2 * tile.block_k), k // 512))
    return dataclasses.replace(tile, split_k=split)


# --- host --------------------------------------------------------------------------------------

@dataclass(eq=False)
class RowSquares:
    """Σ y² of a residual stream's rows, handed from one fused_linear call to the next.

    A call with `residual=` and `squares=` (dot kernel) stores, next to each output block of the
    updated stream, that block's Σ y² per row (fp32, [parts, M]); the next call with
    `norm_weight=` over the same stream and `squares=` sums those parts for its norm instead of
    reading every row of x in each program (at 16 rows and K = 4096: 128 KB a program, against a
    few KB of parts). The stream must not change in between. `parts` and `source` (the stream's
    address and shape) are host state set by the writer, so a reader over other rows, or after a
    writer that could not store them (gemv), computes its norm from x as before. Make one per
    forward (its buffer is allocated on first write, in a CUDA graph's pool during capture)."""

    buf: torch.Tensor | None = None
    parts: int = 0
    source: tuple = ()

    def _writer(self, residual: torch.Tensor, parts: int) -> torch.Tensor:
        need = parts * residual.shape[0]
        if self.buf is None or self.buf.numel() < need or self.buf.device != residual.device:
            self.buf = torch.empty(need, dtype=torch.float32, device=residual.device)
        self.parts, self.source = parts, _source(residual)
        return self.buf

    @classmethod
    def of(cls, x: torch.Tensor, parts: int) -> "RowSquares":
        """The parts a writer of `parts` equal column blocks would leave for x (K % parts == 0),
        computed by torch: for benchmarks and tests of a reader alone."""
        m, k = x.shape
        if parts < 1 or k % parts:
            raise ValueError(f"RowSquares.of: parts must divide K = {k}, got {parts}")
        sums = x.float().pow(2).view(m, parts, k // parts).sum(2)
        return cls(sums.T.contiguous().view(-1), parts, _source(x))

    def readable(self, x: torch.Tensor) -> bool:
        return self.parts > 0 and self.source == _source(x)


def _source(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.device)


def check_linear_args(x, weight, norm_weight, gated, residual, squares=None) -> tuple[int, int, int]:
    """(M, K, output columns) of valid inputs; ValueError naming the argument otherwise."""
    if squares is not None and norm_weight is not None and residual is not None:
        raise ValueError("fused_linear: squares with both norm_weight and residual (the call would "
                         "read the parts it overwrites)")
    if x.dim() != 2:
        raise ValueError(f"fused_linear: x must be [M, K], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"fused_linear: x must be bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    if k == 0:
        raise ValueError("fused_linear: K must be >= 1, got an x of shape [M, 0]")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fused_linear: weight must be [N, {k}] for x {list(x.shape)}, got {list(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"fused_linear: weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.stride(1) != 1 and weight.shape[0] > 0:
        raise ValueError(f"fused_linear: weight rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    tensors = {"weight": weight, "norm_weight": norm_weight, "residual": residual}
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"fused_linear: {name} on {t.device}, x on {x.device}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"fused_linear: norm_weight must be [{k}] {x.dtype}, got {list(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"fused_linear: gated needs weight rows [gate; up], an even count, got {n}")
    n_out = n // 2 if gated else n
    if residual is not None:
        if residual.shape != (m, n_out) or residual.dtype != x.dtype:
            raise ValueError(f"fused_linear: residual must be [{m}, {n_out}] {x.dtype}, got "
                             f"{list(residual.shape)} {residual.dtype}")
        if residual.numel() and residual.stride(1) != 1:
            raise ValueError(f"fused_linear: residual rows must be contiguous, got strides {residual.stride()}")
        if residual.numel() and x.numel() and _overlap(residual, x):
            raise ValueError("fused_linear: residual overlaps x (the epilogue writes it while other programs read x)")
    return m, k, n_out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges that a and b span intersect."""
    def span(t):
        start = t.data_ptr()
        return start, start + t.element_size() * (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())))
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _words_apply(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16 W readable as aligned int64 words of 4: K % 4 == 0, row stride % 4 == 0, 8-byte aligned."""
    k = x.shape[1]
    return (x.dtype == torch.bfloat16 and k % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 8 == 0)


def fused_linear(
    x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    gated: bool = False, residual: torch.Tensor | None = None, config: FusedLinearConfig | None = None,
    squares: RowSquares | None = None, launch: Launch | None = None, tuning: KernelTuning | None = None,
) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ in x's dtype (bf16/fp32), fp32 sums; norm_weight: x replaced by
    rmsnorm(x, norm_weight, eps) first; gated: weight is [gate; up] (N = 2I) and the output [M, I]
    is silu(gate) · up; residual [M, N_out]: the output is added into it in place and it is returned.
    squares: with residual, store the updated rows' Σ y² there; with norm_weight, take the rows' Σ x²
    from there where a writer left them for x (RowSquares). `launch`: PDL (kernels/overlap.py).
    `tuning`: the tuned tables to take the config from (an engine's own; default the module's)."""
    m, k, n_out = check_linear_args(x, weight, norm_weight, gated, residual, squares)
    if squares is not None and residual is not None:
        squares.parts = 0  # until this call stores them (the dot kernel only)
    y = residual if residual is not None else torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return y
    native = on_native(x)
    cfg = config or default_config(m, weight.shape[0], k, gated, on_gpu=native, tuning=tuning)
    if x.stride(1) != 1:
        x = x.contiguous()
    if norm_weight is not None and norm_weight.stride(0) != 1:
        norm_weight = norm_weight.contiguous()
    norm = norm_weight is not None
    bm = _block_m(m, cfg)
    flags = dict(NORM=norm, GATED=bool(gated), RESIDUAL=residual is not None,
                 ROUND_BF16=not native and x.dtype == torch.bfloat16, EXPF=native, **pdl_args(x.device, launch))
    # fp fusion off, as in rmsnorm and silu_mul: sum · (1/K) + eps and 1 + exp(-g) round as torch's do
    # (the GEMV's sums are explicit FMAs, the dot's are tensor-core or "ieee" dots: unaffected).
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False) if native else {}
    if native and cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg

    if cfg.kernel == "gemv":
        words = _words_apply(x, weight)
        if words:
            x = aligned_rows(x, True)
            if norm:
                norm_weight = aligned_rows(norm_weight, True)
        unit = 4 if words else 1  # strides in words of 4 for the int64 loads
        grid = (triton.cdiv(n_out, cfg.block_n), triton.cdiv(m, bm))
        _gemv_kernel[grid](
            x, weight, norm_weight if norm else x, y,
            m, n_out, k, 1.0 / k, eps, x.stride(0) // unit, weight.stride(0) // unit, y.stride(0),
            BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_k // 4, WORDS=words,
            EVEN_K=k % cfg.block_k == 0, NORM_WORDS=norm_words(k, bm, cfg.num_warps), **flags, **opts,
        )
        return y

    k_tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    sq_in = norm and squares is not None and squares.readable(x)
    sq_out = squares is not None and residual is not None
    norm_words_chunk = 0
    if norm and not sq_in and x.dtype == torch.bfloat16 and k % 4 == 0:  # Σx² in a few whole-row chunks
        x = aligned_rows(x, True)
        norm_words_chunk = norm_words(k, bm, cfg.num_warps, per_thread=DOT_NORM_WORDS)
    grid = (triton.cdiv(n_out, cfg.block_n), split, triton.cdiv(m, bm))
    if split > 1:
        part = torch.empty(((2 if gated else 1) * split, m, n_out), dtype=torch.float32, device=x.device)
        counters = split_counters(weight.untyped_storage(), grid[0] * grid[2], weight.device)
    else:  # unused; an fp32 and an int32 pointer keep the compiled types
        part = torch.empty(1, dtype=torch.float32, device=x.device)
        counters = part.view(torch.int32)
    sq_parts = squares.parts if sq_in else 0
    sq_buf = squares.buf if sq_in else squares._writer(residual, grid[0]) if sq_out else part
    _dot_kernel[grid](
        x, weight, norm_weight if norm else x, y, part, counters, sq_buf,
        m, n_out, k, k_per_split, m * n_out, 1.0 / k, eps, x.stride(0), weight.stride(0), y.stride(0),
        sq_parts,
        BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SPLIT_K=split,
        DOT_BF16=native and x.dtype == torch.bfloat16, NORM_WORDS=norm_words_chunk,
        SQ_IN=sq_in, SQ_OUT=sq_out, SQ_BLOCK=min(128, triton.next_power_of_2(max(1, sq_parts))), **flags, **opts,
    )
    return y


def fused_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    gated: bool = False, residual: torch.Tensor | None = None, squares: RowSquares | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """The unfused ops: rmsnorm_reference, the GEMM in fp32 cast to x's dtype, silu_mul_reference,
    and the torch add into residual (in place, returned). squares: left unwritten (parts 0), so
    its readers compute their norms. `launch` is the kernel's argument, unused here."""
    check_linear_args(x, weight, norm_weight, gated, residual, squares)
    if squares is not None and residual is not None:
        squares.parts = 0
    h = rmsnorm_reference(x, norm_weight, eps) if norm_weight is not None else x
    y = (h.float() @ weight.float().T).to(x.dtype)
    if gated:
        y = silu_mul_reference(y)
    if residual is None:
        return y
    return residual.add_(y)


# --- registry entry -----------------------------------------------------------------------------

# Named configs the cases may ask for (else the default one: on the CPU, _INTERPRETER_GEMV for
# M <= 4 and _INTERPRETER_DOT, split-K 2, for more rows).
_CHECK_CONFIGS = {
    "gemv-bk16": FusedLinearConfig("gemv", 4, 16, num_warps=1),  # many chunks, BN < N
    "gemv-bn64": FusedLinearConfig("gemv", 64, 64, num_warps=4),  # N < BN: all rows in one program
    "dot-sk1": FusedLinearConfig("dot", 16, 16),  # no split; BM 16 at any M
    "dot-sk3": FusedLinearConfig("dot", 16, 16, block_m=32, split_k=3),
}


def _make_inputs(case, device, seed):
    """x ~ N(0, 1) (every third row × 30, as hidden states are), W ~ N(0, 0.02) (a row-slice view at
    row case["view"] of a larger weight when view > 0), norm weight ~ 1 + N(0, 0.1), residual ~
    N(0, 1); positional (x, W, norm weight or None, gated, residual or None, config name)."""
    g = torch.Generator().manual_seed(seed)
    m, n, k, dtype, start = case["M"], case["N"], case["K"], case["dtype"], case["view"]
    x = torch.randn(m, k, generator=g)
    x[::3] *= 30
    base = 0.02 * torch.randn(start + n + (3 if start else 0), k, generator=g)
    w = base.to(dtype).to(device)[start : start + n]
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device) if case["norm"] else None
    n_out = n // 2 if case["gated"] else n
    r = torch.randn(m, n_out, generator=g).to(dtype).to(device) if case["residual"] else None
    return x.to(dtype).to(device), w, nw, case["gated"], r, case["config"]


def _run(x, w, nw, gated, r, config):
    """fused_linear on a copy of the residual (the reference gets its own copy)."""
    return fused_linear(x, w, norm_weight=nw, gated=bool(gated), residual=None if r is None else r.clone(),
                        config=_CHECK_CONFIGS.get(config))


def _reference(x, w, nw, gated, r, config):
    return fused_linear_reference(x, w, norm_weight=nw, gated=bool(gated), residual=None if r is None else r.clone())


def plant_wrong_weight(inputs):
    """One weight moved by 4 (weights are ~0.02) where x' (x after the norm) is largest in row 0,
    in the row whose output moves most: for gated, the gate row of the largest |up| output."""
    x, w, nw, gated, r, config = inputs
    h = rmsnorm_reference(x, nw, 1e-6) if nw is not None else x
    col = int(h[0].float().abs().argmax())
    row = 0
    if gated:
        n_out = w.shape[0] // 2
        up = fused_linear_reference(x, w[n_out:], norm_weight=nw)
        row = int(up[0].float().abs().argmax())
    w = w.clone()
    w[row, col] += 4.0 * (1.0 if h[0, col] >= 0 else -1.0)  # gated: gate + ~8, so silu(gate) · up moves by ~8 up
    return x, w, nw, gated, r, config


def _case(m, n, k, dtype, norm=0, gated=0, residual=0, view=0, config="default"):
    return {"M": m, "N": n, "K": k, "dtype": dtype, "norm": norm, "gated": gated, "residual": residual,
            "view": view, "config": config}


BF16, F32 = torch.bfloat16, torch.float32

register(KernelSpec(
    name="fused_linear",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        # gemv (M <= 4): K % 4 != 0 reads elements, K % 4 == 0 bf16 reads words
        _case(1, 7, 33, BF16),
        _case(1, 34, 64, BF16, norm=1, gated=1, view=5),  # an odd start row, still 8-byte aligned
        _case(2, 33, 96, F32, norm=1),
        _case(2, 17, 50, BF16, residual=1, view=3),
        _case(3, 38, 100, BF16, gated=1, residual=1),
        _case(3, 34, 41, F32, gated=1),
        _case(4, 67, 140, BF16, norm=1, residual=1),
        _case(4, 40, 128, F32, norm=1, gated=1, residual=1, view=7),
        _case(1, 16, 128, BF16, norm=1, gated=1, residual=1),  # K % block_k == 0: no masked chunk
        _case(3, 9, 67, BF16, norm=1, config="gemv-bk16"),
        _case(4, 20, 36, BF16, gated=1, residual=1, view=1, config="gemv-bn64"),
        _case(5, 21, 64, BF16, norm=1, residual=1, config="gemv-bk16"),  # two M blocks of gemv
        _case(4, 11, 1100, BF16, norm=1, config="gemv-bk16"),  # the norm's words in 3 chunks, the last masked
        # dot (M >= 5): split-K 2 by default on the CPU
        _case(5, 33, 65, BF16, norm=1),
        _case(16, 64, 128, F32, gated=1, residual=1),
        _case(17, 33, 257, BF16, residual=1, view=9),
        _case(33, 40, 96, BF16, norm=1, gated=1, residual=1),
        _case(5, 34, 64, F32, norm=1, gated=1, view=1),
        _case(33, 9, 31, F32, norm=1, residual=1),
        _case(16, 17, 40, BF16, config="dot-sk1"),
        _case(17, 50, 100, BF16, norm=1, gated=1, residual=1, config="dot-sk3"),
        _case(2, 20, 64, BF16, norm=1, gated=1, config="dot-sk3"),  # dot at M = 2
        _case(16, 9, 1100, BF16, norm=1, config="dot-sk1"),  # the norm's words in 2 chunks, the last masked
    ],
    # fp32: summation order only, with atol 5e-5: a gated output is silu(g) · u with |u| up to ~7
    # here (x rows × 30), so g's order error (~1e-6) reaches 2.3e-5 at 2 torch threads. bf16: the fp32 sums differ from torch's in order, so a rounding to
    # bf16 may land one bf16 step apart (2^-7 relative at worst), and so may a normalised x element
    # (the Σx² order); atol covers the fp32 order error near zero. As u12_linear's.
    tolerance={F32: (5e-5, 1e-5), BF16: (1e-4, 8e-3)},
    corrupt=plant_wrong_weight,
    description="x @ W.T with an RMSNorm prologue and SiLU·mul / residual-add epilogues, bf16/fp32 W",
))
