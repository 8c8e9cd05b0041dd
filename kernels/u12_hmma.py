"""y = x · Wᵀ with W in the u12 format by warp-level tensor-core MMAs (mma.sync), for 1..16 rows ("hmma").

Why a second tensor-core kernel. kernels/u12_mma.py goes through tl.dot, which on sm_90 is wgmma:
its words pass through shared memory (cp.async, then ldmatrix), x is stored to shared memory as
the B operand each chunk behind two barriers, and the warp group waits for its wgmma within the
chunk, so a program's decode and its dot never overlap. This kernel keeps everything in registers,
as gemv2 does at M = 1 (kernels/u12_linear.py): each thread loads its words straight from global
memory, decodes them (gemv2's biased decode, ``_pair_patterns``) directly into the A fragment of
``mma.sync.aligned.m16n8k16`` and multiplies by x's B fragments, loaded as words too. No shared
memory, no barrier; a warp's MMAs are asynchronous to its next decode.

Fragments. A warp owns 16 · TILES rows of W and the BLOCK_M rows of x of its M block over the
program's K range: two n-tiles of 8 (BLOCK_M 16), or at most 8 rows one (BLOCK_M 8, ``NARROW``:
half the x loads and MMAs of two whose second re-reads the last row, the same W traffic; sm_90
ptxas, triton 3.6, TUNED's o/down tile under its 128-register cap: 80 registers against 127, so 6
programs an SM against 4). Lane l (g = l // 4, q = l % 4) of m-tile r holds rows g and g + 8 of the
tile. A chunk of BLOCK_W words a row is BLOCK_W / 16 groups u of 16 words; in group u lane q
reads the 4 words BLOCK_W / 4 · q + 4 u .. + 3 of each of its rows (one 16-byte load a row) and
their codes (8 bytes), so a lane's groups are contiguous and a quad reads the chunk's words of a
row as one run. K's order inside the sum is free, so k-step s (0..3) of a group takes the lane's
word s: its pair registers (weights 0, 2) and (1, 3) are exactly the bf16x2 registers of the A
fragment at k = 2 q, 2 q + 1 and 2 q + 8, 2 q + 9 (PTX ISA, "Matrix Fragments for
mma.m16n8k16"), for rows g (a0, a2) and g + 8 (a1, a3). The B fragment of lane l holds the same
k of x's row g (n-tile 0) or 8 + g (n-tile 1): the same word, read as one int64 of 4 bf16, split
by two prmt into (x0, x2) and (x1, x3). So every lane reads contiguous words, x's included, and
nothing is permuted.

Layout. The fragments are Triton tensors of shape [32 · warps] with one element a thread, element
t on lane t % 32 of warp t // 32 (Triton's default blocked layout for that shape), and the MMA is
``tl.inline_asm_elementwise`` over them: every lane runs the same instruction at once, as
mma.sync requires. The word loads are [32 · warps, 4] tensors with the 4 in the thread (16-byte
vectors), split in registers. The sm_90 SASS of the loop has no shared-memory access, shuffle or
barrier (checked with triton 3.6 and 3.9). Under the interpreter (no PTX), ``_mma_emulated`` does
the instruction's arithmetic from the same fragments with gathers across the lanes, so the CPU
tests check the fragment mapping itself.

H200, M = 16, each config in a CUDA graph over distinct weight copies: o 17.0 µs and down 39.5
against 23.7 and 43.9 for the mma kernel (bench/results/tried/u12_linear_hmma_ed31e59_h200.json;
TUNED takes both: 64 rows and 32 words a chunk, split-K 8, 128 registers); qkv 21.1 against 20.4,
gate_up 64.0 against 60.9, lm_head 236 (two m-tiles a warp) against 213
(bench/results/u12_linear_hmma_h200.json, commit 89d4609). With a lane's groups strided through
the chunk instead (word 4 q + 16 u: a quad read 64 B of a row at a time) every config of a shape
ran within a few percent of the others, lm_head 341 µs and gate_up 86
(bench/results/tried/u12_linear_hmma_strided_h200.json).

Tried and dropped: a register double buffer (commit 462a452: chunk c + 1's words loaded while chunk
c decodes and multiplies, all of a chunk's loads before its first MMA, 134 registers against 105):
within the run's spread or slower at every shape (best configs o 17.4 µs against 16.9, down 40.1 /
39.1, gate_up 66.3 / 63.7, lm_head 250 / 235; bench/results/tried/u12_linear_stages_h200.json), so
more loads in flight a warp is not what this kernel lacks. Nor is an L2 look-ahead
(kernels/overlap.py). Nor shared memory: the loop's loads pipelined by cp.async (``tl.range(...,
num_stages=2..4)``: Triton then copies every word, code and x load STAGES - 1 chunks ahead, 28 KB a
stage at 64 rows, 32 words, 4 warps; commits ed63f5c-45a785f, reverted): each shape's best pipelined
config ran 1.24-2.0x the best one-stage one (o 20.4 µs against 16.4, down 62.5 against 38.8, lm_head
474 against 236), with x's copies bypassing L1 (.cg) or keeping it (.ca) alike
(bench/results/tried/u12_linear_hmma_cp_async_cg_h200.json and u12_linear_hmma_cp_async_h200.json).
Nsight Compute at M = 16 (bench/results/tried/linear_ncu_u12_m16_h200.txt, TUNED's configs): down
reads 2.28 TB/s with L1 throughput at 79%, 70% L1 hits (x's loads, which every warp
repeats, and, we think, the second half of each weight sector, read by the next group), 21% occupancy (128 registers: 4 programs an SM) and 10 of the 13.9 cycles
between a warp's instructions waiting on L1. x's share of that: an ablation that pointed each warp's
x loads at one contiguous 512-byte run (wrong sums) ran qkv 18.9 µs against 20.3, o 15.0 / 16.4,
gate_up 58.2 / 64.1, down 36.7 / 38.8
(bench/results/tried/u12_linear_hmma_x_contiguous_ablation_h200.json): 5-9%, far from the 1.3x the
issue's 1.15x at M = 16 needs.

Numerics: the biased decode (w · 2^(113-base), an escape 2^-15), bf16 x unscaled, fp32 accumulation
in the tensor cores. The epilogue stays in the fragments' layout (``_finish``, elementwise): each
accumulator reads the escapes of its W row (from the row's lanes, ``LANE_GROUP`` a step, or where
the weight has none from the table), takes back their spurious x · 2^-15 and adds x · w exactly,
then the scale 2^(base-113); split-K by the serial semaphore, partials summed in split order. For
kernels/u12_fused_linear.py ``_finish`` runs its epilogue in the same layout: gated, an m-tile's
rows g are 8 gate rows and rows g + 8 their up rows (``_half`` splits a lane's elements in the
thread); a handed-in norm's inv is computed for the block's 16 rows once and gathered to the
elements (``_inv_rows``); the residual add and the handoff's xg as fused_linear's epilogue does; and
``_parts_out`` stores its Σ y² parts, one a warp (a lane's two rows of each m-tile, then across the
quad column's 8 lanes), each (part, row of x) by one thread. (The mma kernel's 2-D epilogue,
``_store_block``, cost about 80 registers a thread here: 168 against 90 for the loop, sm_90 ptxas.)
Tiled weights (``U12Tensor.layout`` "tiles", ``TILED``): with the row planes each load instruction
of a warp touches 8 rows (a quad's 4 lanes read 64 bytes of each, half of a 128-byte line, the
next group the other half), and Nsight Compute has the M = 16 kernel's L1 busy 79% with 70% hits
(above). A tiled weight stores each 16-row tile's 16-word groups row after row (Marlin's idea for
int4 weights, specpilot/runtime/u12.py): a warp's word loads read 512 contiguous bytes, its code
loads 256, and its groups follow each other, with the same loads, MMAs and registers (sm_90 SASS;
the loop's address arithmetic a little longer: bench/results/kernel_static_sm90_triton36.json,
tests/test_kernel_static.py) and, since a lane's words of group u are 16 u + 4 q + (0..3) and x's
likewise, the row planes' sums bit for bit (tests/test_u12_layout.py). Gated, a lane's gate and up
rows come from two tiles (256 contiguous bytes each). It is the weight's own layout, not a copy:
every u12 kernel reads it (u12_linear's ``_row_words`` / ``_col_words``). H200, M = 16, CUDA graphs
(bench/results/u12_linear_tiles_h200.json, a291905): on tiles this kernel won every Llama-3.1-8B
shape, against the best on row planes: qkv 19.1 µs (mma 19.5), o 15.9 (16.9), gate_up 52.0 (mma
64.4), down 35.6 (40.4), lm_head 202 (mma 218); hence u12_linear.TUNED_TILES. verify(16)
interleaved with every weight tiled (u12-tiles, 753d9c4): 4.613 ms against the bf16 step's 4.446
(0.96x; the row planes' 5.151, 0.86x; bench/results/tried/step_ab_verify16_753d9c4_h200.json; at 0bc2353
4.637 against 4.510, 0.97x: bench/results/step_ab_verify16_h200.json).

bf16 x only (fp32 x, K % 4 != 0 or a base past 240 run the tile kernel: ``hmma_applies``). By
default u12_linear runs it from TENSOR_CORE_ROWS (3) rows up where TUNED's 16-row config is an hmma
one (o and down); the one-n-tile kernel at 3..8 rows: see NARROW.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specpilot.runtime.u12 import U12Tensor

from .fused_linear import _epilogue, _row_inv_parts
from .overlap import pdl_args, pdl_enter
from .registry import KernelSpec, register
from .target import native as on_native
from .rmsnorm import _to_dtype
from .u12_linear import (
    ESC_DECODED,
    U12Config,
    _case,
    _lane_walk,
    _make_inputs,
    _nonempty,
    _pair_patterns,
    _plant_wrong_weight,
    _prmt,
    _row_words,
    _split_k_plan,
    aligned_rows,
    biased_scale,
    epilogue_args,
    lane_group,
    lanes_args,
    u12_linear,
    u12_linear_reference,
    words_and_scales,
)

MAX_ROWS = 16  # rows of x a program at most: two n-tiles of mma.m16n8k16 (x rows 0..7 and 8..15)
# At most 8 rows of x, whether a program multiplies one n-tile (8 rows) rather than two with the
# second's 8 rows re-reading the last: half the x loads and MMAs, the same W traffic. On the H200 at
# 3353acd: verify(4) 4.877 ms against 5.092 with two n-tiles, verify(8) 4.876 against 5.143
# (bench/results/step_ab_verify{4,8}_h200.json). Read at launch (bench/step_ab.py's verify variants compare).
NARROW = True


@triton.jit
def _bf16_lo(r):
    return (r << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_hi(r):
    return (r & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _quad(v, first):
    """v at lanes first .. first + 3 for every lane: [T, 4] (a gather across the warp)."""
    T: tl.constexpr = v.shape[0]
    return tl.gather(tl.broadcast_to(v[:, None], (T, 4)), first[:, None] + tl.arange(0, 4)[None, :], 0)


@triton.jit
def _dot_pairs(a, b):
    """Σ over a quad's 4 lanes of the products of their bf16 pairs: a, b [T, 4] int32 registers."""
    return tl.sum(_bf16_lo(a) * _bf16_lo(b) + _bf16_hi(a) * _bf16_hi(b), axis=1)


@triton.jit
def _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.m16n8k16 (row.col, bf16 in, fp32 accumulate) from per-lane fragments [32 · warps]: each
    lane's D from the A fragments of its row's quad and the B fragments of its column's."""
    T: tl.constexpr = a0.shape[0]
    t = tl.arange(0, T)
    lane = t % 32
    quad_a = t - lane + 4 * (lane // 4)  # lanes 4 g .. 4 g + 3: A's rows g and g + 8
    quad_b0 = t - lane + 8 * (lane % 4)  # lanes 4 n ..: B's column n = 2 q
    quad_b1 = quad_b0 + 4  # column 2 q + 1
    # k = 2 q', 2 q' + 1 in a0, a1 and b0; k = 2 q' + 8, 2 q' + 9 in a2, a3 and b1 (q' the quad's lane)
    ra0, ra1, ra2, ra3 = _quad(a0, quad_a), _quad(a1, quad_a), _quad(a2, quad_a), _quad(a3, quad_a)
    rb00, rb01 = _quad(b0, quad_b0), _quad(b1, quad_b0)
    rb10, rb11 = _quad(b0, quad_b1), _quad(b1, quad_b1)
    d0 = c0 + (_dot_pairs(ra0, rb00) + _dot_pairs(ra2, rb01))
    d1 = c1 + (_dot_pairs(ra0, rb10) + _dot_pairs(ra2, rb11))
    d2 = c2 + (_dot_pairs(ra1, rb00) + _dot_pairs(ra3, rb01))
    d3 = c3 + (_dot_pairs(ra1, rb10) + _dot_pairs(ra3, rb11))
    return d0, d1, d2, d3


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """D = A · B + C for one m16n8k16 tile from the lanes' fragments (PTX ISA's register layout)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
        )
    else:
        return _mma_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@triton.jit
def _four(v):
    """The 4 in-thread columns of v [T, 4] as 4 tensors [T] (register moves)."""
    T: tl.constexpr = v.shape[0]
    even, odd = tl.split(tl.reshape(v, (T, 2, 2)))  # columns (0, 2) and (1, 3)
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return v0, v1, v2, v3


@triton.jit
def _load4(ptrs, w, w_end, lane_w, MASKED: tl.constexpr):
    """The 4 words ptrs + w [T, 4] (ptrs at the lane's words lane_w; masked at words past w_end: 0) as
    4 tensors [T]."""
    if MASKED:
        return _four(tl.load(ptrs + w, mask=w + lane_w < w_end, other=0))
    else:
        return _four(tl.load(ptrs + w))


@triton.jit
def _b_fragment(xw, ASM: tl.constexpr):
    """An int64 of 4 bf16 x values (x0 in the low bits) as the B registers (x0, x2) and (x1, x3)."""
    lo = xw.to(tl.int32)
    hi = (xw >> 32).to(tl.int32)
    return _prmt(lo, hi, 0x5410, ASM), _prmt(lo, hi, 0x7632, ASM)


@triton.jit
def _tile_step(d0, d1, d2, d3, e0, e1, e2, e3, s_lo, c_lo, s_hi, c_hi, x0, x1, NT: tl.constexpr,
               ASM: tl.constexpr):
    """One k-step of one m-tile: decode the word of rows g (s_lo, c_lo: int16 codes) and g + 8 into
    the A fragment, multiply by the B fragments of x's word in each of the NT n-tiles (x0 -> d: x
    rows 0..7, x1 -> e: 8..15)."""
    b00, b01 = _b_fragment(x0, ASM)
    p02_lo, p13_lo = _pair_patterns(s_lo, c_lo.to(tl.int32), ASM)
    p02_hi, p13_hi = _pair_patterns(s_hi, c_hi.to(tl.int32), ASM)
    d0, d1, d2, d3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b00, b01, d0, d1, d2, d3, ASM)
    if NT == 2:
        b10, b11 = _b_fragment(x1, ASM)
        e0, e1, e2, e3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b10, b11, e0, e1, e2, e3, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit
def _tile_group(
    d0, d1, d2, d3, e0, e1, e2, e3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end, lane_w,
    x00, x01, x02, x03, x10, x11, x12, x13, NT: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
):
    """One m-tile over a group of 16 words a row (the group's word w; its weights at offset ww of
    the planes' pointers): 4 k-steps, k-step s on word s of each lane's 4."""
    shift = ww - w  # 0 in rows; the tiled planes' offset (the masks stay x's)
    s_lo0, s_lo1, s_lo2, s_lo3 = _load4(sm_lo + shift, w, w_end, lane_w, MASKED)
    s_hi0, s_hi1, s_hi2, s_hi3 = _load4(sm_hi + shift, w, w_end, lane_w, MASKED)
    c_lo0, c_lo1, c_lo2, c_lo3 = _load4(code_lo + shift, w, w_end, lane_w, MASKED)
    c_hi0, c_hi1, c_hi2, c_hi3 = _load4(code_hi + shift, w, w_end, lane_w, MASKED)
    d0, d1, d2, d3, e0, e1, e2, e3 = _tile_step(
        d0, d1, d2, d3, e0, e1, e2, e3, s_lo0, c_lo0, s_hi0, c_hi0, x00, x10, NT, ASM)
    d0, d1, d2, d3, e0, e1, e2, e3 = _tile_step(
        d0, d1, d2, d3, e0, e1, e2, e3, s_lo1, c_lo1, s_hi1, c_hi1, x01, x11, NT, ASM)
    d0, d1, d2, d3, e0, e1, e2, e3 = _tile_step(
        d0, d1, d2, d3, e0, e1, e2, e3, s_lo2, c_lo2, s_hi2, c_hi2, x02, x12, NT, ASM)
    d0, d1, d2, d3, e0, e1, e2, e3 = _tile_step(
        d0, d1, d2, d3, e0, e1, e2, e3, s_lo3, c_lo3, s_hi3, c_hi3, x03, x13, NT, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit
def _group(
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww, w, w_end, lane_w,
    x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
    TILES: tl.constexpr, NT: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
):
    """A 16-word group of the warp's m-tiles (accumulators d, e: tile 0; f, h: tile 1; e and h the
    second n-tile's), x's words loaded once for all."""
    x00, x01, x02, x03 = _load4(x_row0, w, w_end, lane_w, MASKED)
    if NT == 2:
        x10, x11, x12, x13 = _load4(x_row1, w, w_end, lane_w, MASKED)
    else:  # one n-tile: no second x row, its accumulators stay 0
        x10, x11, x12, x13 = x00, x01, x02, x03
    d0, d1, d2, d3, e0, e1, e2, e3 = _tile_group(
        d0, d1, d2, d3, e0, e1, e2, e3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end, lane_w,
        x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM)
    if TILES == 2:
        f0, f1, f2, f3, h0, h1, h2, h3 = _tile_group(
            f0, f1, f2, f3, h0, h1, h2, h3, sm_lo2, code_lo2, sm_hi2, code_hi2, ww, w, w_end, lane_w,
            x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _stack(d0, d1, d2, d3, e0, e1, e2, e3, NT: tl.constexpr):
    """A tile's accumulators of a lane (n-tile 0's d, 1's e) as one [T, 2 (p), 2 (h), NT (n-tile)]
    tensor, in the thread."""
    d = tl.join(tl.join(d0, d1), tl.join(d2, d3))
    if NT == 2:
        return tl.join(d, tl.join(tl.join(e0, e1), tl.join(e2, e3)))
    else:
        return d[:, :, :, None]


@triton.jit
def _inv_rows(parts_ptr, mm, pid_m, M, n_parts, inv_k, eps, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """A handed-in norm's inv (``_row_inv_parts``) at each element's x row mm: the block's BLOCK_M
    rows' once, then gathered to the elements (a gather through shared memory, once a program)."""
    inv = _row_inv_parts(parts_ptr, tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), M - 1), M, n_parts,
                         inv_k, eps, BLOCK_M, BLOCK_P)
    idx = tl.reshape(mm - pid_m * BLOCK_M, (mm.numel,))
    return tl.reshape(tl.gather(inv, idx, 0), mm.shape)


@triton.jit
def _half(v, h: tl.constexpr):
    """Elements [T, 2 (p), 2 (h), NT (n-tile)] of rows h (0: g, 1: g + 8) as [T, 2 (p), NT]."""
    lo, hi = tl.split(tl.permute(v, (0, 1, 3, 2)))
    if h == 0:
        return lo
    else:
        return hi


@triton.jit
def _finish(
    acc, mm, rows, ok_n, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, M, K, stride_xm, stride_ym,
    y_scale, LANES: tl.constexpr, LANE_GROUP: tl.constexpr,
    hw_ptr, xg_ptr, stride_xg, parts_ptr, n_parts, inv_k, eps, pid_m, BLOCK_M: tl.constexpr,
    GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAND_IN: tl.constexpr, HAND_OUT: tl.constexpr,
    BLOCK_P: tl.constexpr, ROUND_BF16: tl.constexpr, EXPF: tl.constexpr,
):
    """y from the biased sums acc (each element: x row mm, W row rows, ok_n where that row is one of
    the block's): per element, the escapes of its W row take back their spurious x · 2^-15 and add
    x · w exactly, then the scale. The escapes from the row's lanes (LANES > 0: LANE_GROUP lanes of
    every element at once, so no load waits on another but x's on its lane), else from the table
    (CSR esc_row_ptr, then each escape's index and value, then x: a walk as long as the longest
    row's). Elementwise in the accumulators' own layout: no layout change, few registers. Then
    kernels/u12_fused_linear.py's epilogue where asked: GATED (rows g gate rows, rows g + 8 their up
    rows: SiLU·mul of the two halves, in the thread), HAND_IN (the sums times the rows' inv),
    RESIDUAL (added into the residual) and HAND_OUT (the handoff's xg). Returns the stored values,
    0 where not stored (HAND_OUT's parts)."""
    x_row = x_ptr + tl.minimum(mm, M - 1) * stride_xm
    spur = tl.zeros_like(acc)
    esc = tl.zeros_like(acc)
    if LANES:
        spur, esc = _lane_walk(acc, lanes_ptr, rows, x_row, 1, ok_n, K, LANES, LANE_GROUP)
    else:
        start = tl.load(esc_row_ptr + rows)
        count = tl.where(ok_n, tl.load(esc_row_ptr + rows + 1) - start, 0)
        for j in range(0, tl.max(count)):  # a row's escapes, the longest row's count for all
            has = j < count
            idx = tl.load(esc_idx_ptr + start + j, mask=has, other=0)
            val = (tl.load(esc_val_ptr + start + j, mask=has, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            xv = tl.load(x_row + idx % K, mask=has, other=0.0).to(tl.float32)
            esc += tl.where(has, xv * val, 0.0)
            spur += xv * ESC_DECODED
    y = (acc - spur) * y_scale + esc  # the scale: exact (a power of two)
    mask = (mm < M) & ok_n
    if GATED or RESIDUAL or HAND_IN:  # u12_fused_linear's epilogue
        DTYPE: tl.constexpr = y_ptr.dtype.element_ty
        if GATED:  # the output column is the gate row's
            g, u, mm, cols, mask = _half(y, 0), _half(y, 1), _half(mm, 0), _half(rows, 0), _half(mask, 0)
        else:
            g, u, cols = y, y, rows
        if HAND_IN:  # rmsnorm's inv, factored out of the sums (x = dtype(stream · weight))
            inv = _inv_rows(parts_ptr, mm, pid_m, M, n_parts, inv_k, eps, BLOCK_M, BLOCK_P)
            g = g * inv
            u = u * inv
        y = _epilogue(g, u, y_ptr + mm * stride_ym + cols, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF)
        if HAND_OUT:  # xg = dtype(y · the norm's weight)
            hw = tl.load(hw_ptr + cols).to(tl.float32)
            tl.store(xg_ptr + mm * stride_xg + cols, _to_dtype(y * hw, DTYPE, ROUND_BF16).to(DTYPE), mask=mask)
    else:
        tl.store(y_ptr + mm * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=mask)
    return tl.where(mask, y, 0.0)


@triton.jit
def _parts_out(y, y2, parts_ptr, pid_n, pid_m, M, WARPS: tl.constexpr, TILES: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """A norm handoff's Σ y² parts from the stored values y (and TILES 2: y2) [T, 2 (p), 2 (h), NT
    (n-tile)] (``_finish``): one part a warp, parts[pid_n · WARPS + warp, m] summed over the warp's
    rows (its lanes' two rows of each m-tile, then across the 8 lanes g of a quad column), each
    (part, m) stored by one thread."""
    NT: tl.constexpr = BLOCK_M // 8
    sq = tl.sum(y * y, axis=2)  # [T, 2 (p), NT (n-tile)]: rows g and g + 8
    if TILES == 2:
        sq += tl.sum(y2 * y2, axis=2)
    sq = tl.sum(tl.reshape(sq, (WARPS, 8, 4, 2, NT)), axis=1)  # over g: [warp, q, p, n-tile]
    q = tl.arange(0, 4)[None, :, None, None]
    p = tl.arange(0, 2)[None, None, :, None]
    nt = tl.arange(0, NT)[None, None, None, :]
    m = pid_m * BLOCK_M + 2 * q + p + 8 * nt
    part = pid_n * WARPS + tl.arange(0, WARPS)[:, None, None, None]
    tl.store(parts_ptr + part * M + m, sq, mask=m < M)


@triton.jit
def _u12_hmma_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, part_ptr, count_ptr,
    hw_ptr, xg_ptr, parts_ptr,  # the epilogue's norm handoff (u12_fused_linear's NormHandoff); else unused
    M, N, K, n_words, y_scale, words_per_split, n_out, inv_k, eps, n_parts,
    stride_xm, stride_sm, stride_codes, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr,  # rows of x a program: 8 (one n-tile of mma.m16n8k16) or 16 (two)
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # ways over K (constexpr: the last program's sum of the partials unrolls)
    EVEN_K: tl.constexpr,  # n_words % BLOCK_W == 0: no split has a masked last chunk
    ASM: tl.constexpr,  # PTX mma.sync and prmt (GPU); else their emulation (interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    LANES: tl.constexpr = 0,  # > 0: the escapes from W's lanes (U12Tensor.esc_lanes, LANES a row), not the table
    LANE_GROUP: tl.constexpr = 4,  # lanes a step of the epilogue's walk (u12_linear.LANE_GROUP)
    # u12_fused_linear's epilogue (``_finish``): GATED (W is [gate; up], n_out = N / 2 output columns;
    # an m-tile's rows g are 8 gate rows, rows g + 8 their up rows), RESIDUAL (y is the residual, added
    # into), HAND_IN (x is a handoff's xg: the sums times its rows' inv), HAND_OUT (the updated
    # stream's norm handed on: xg, a Σ y² part a warp)
    GATED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    HAND_IN: tl.constexpr = False, HAND_OUT: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 16,  # HAND_IN: parts summed a chunk
    TILED: tl.constexpr = False,  # W's planes in tiles (U12Tensor.layout)
    ROUND_BF16: tl.constexpr = False,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr = False,  # GATED: libdevice's expf (GPU); else tl.exp
):
    pdl_enter(PDL)
    TILES: tl.constexpr = BLOCK_N // (16 * WARPS)  # m-tiles a warp: 1 or 2
    NT: tl.constexpr = BLOCK_M // 8  # n-tiles (8 rows of x each) a warp: 1 or 2
    T: tl.constexpr = 32 * WARPS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    t = tl.arange(0, T)
    lane = t % 32
    g = lane // 4
    q = lane % 4
    # Each m-tile's W rows of a lane: lo (its row g) and hi (g + 8); rows past N (gated: columns past
    # n_out) re-read the last one (their outputs are not stored). Plain: the warp's 16 · TILES rows in
    # order. Gated: an m-tile holds 8 output columns c, lo their gate rows c and hi their up rows
    # n_out + c, so each lane holds both halves of its outputs.
    if GATED:
        c0 = pid_n * (BLOCK_N // 2) + (t // 32) * (8 * TILES) + g  # m-tile 0's column; m-tile 1's: + 8
        lo0, hi0, lo1, hi1 = c0, c0 + n_out, c0 + 8, c0 + 8 + n_out
        ok0, ok1 = c0 < n_out, c0 + 8 < n_out
        rl0, rl1 = tl.minimum(c0, n_out - 1), tl.minimum(c0 + 8, n_out - 1)
        rh0, rh1 = rl0 + n_out, rl1 + n_out
    else:
        row = n0 + (t // 32) * (16 * TILES) + g  # m-tile 0's row g; + 8, + 16, + 24 for the others
        lo0, hi0, lo1, hi1 = row, row + 8, row + 16, row + 24
        rl0, rh0 = tl.minimum(row, N - 1), tl.minimum(row + 8, N - 1)
        rl1, rh1 = tl.minimum(row + 16, N - 1), tl.minimum(row + 24, N - 1)
    j = tl.arange(0, 4)[None, :]
    if TILED:
        # W's tiles (U12Tensor.layout): a 16-row tile's 16-word group is 256 words, rows 0..15 of 16
        # words each; a lane's 4 words of group u of a chunk are 16 u + 4 q + (0..3) of its rows, so
        # each load instruction of a warp whose rows g are one tile's reads 512 contiguous bytes
        # (codes 256; gated, the gate and up halves 256 each) and a warp's groups follow each other.
        lane_w = (4 * q)[:, None] + j  # [T, 4]: x's words (and the masks')
        sm_lo = sm_ptr + _row_words(rl0, stride_sm, True)[:, None] + lane_w
        sm_hi = sm_ptr + _row_words(rh0, stride_sm, True)[:, None] + lane_w
        code_lo = codes_ptr + _row_words(rl0, stride_codes, True)[:, None] + lane_w
        code_hi = codes_ptr + _row_words(rh0, stride_codes, True)[:, None] + lane_w
        sm_lo2 = sm_ptr + _row_words(rl1, stride_sm, True)[:, None] + lane_w
        sm_hi2 = sm_ptr + _row_words(rh1, stride_sm, True)[:, None] + lane_w
        code_lo2 = codes_ptr + _row_words(rl1, stride_codes, True)[:, None] + lane_w
        code_hi2 = codes_ptr + _row_words(rh1, stride_codes, True)[:, None] + lane_w
    else:
        # A lane's 4 words of each 16-word group u of a chunk: BLOCK_W / 4 q + 4 u + (0..3), so that a
        # lane's groups are contiguous and a quad reads BLOCK_W contiguous words of each row.
        lane_w = ((BLOCK_W // 4) * q)[:, None] + j  # [T, 4]
        sm_lo = sm_ptr + rl0[:, None] * stride_sm + lane_w
        sm_hi = sm_ptr + rh0[:, None] * stride_sm + lane_w
        code_lo = codes_ptr + rl0[:, None] * stride_codes + lane_w
        code_hi = codes_ptr + rh0[:, None] * stride_codes + lane_w
        sm_lo2 = sm_ptr + rl1[:, None] * stride_sm + lane_w
        sm_hi2 = sm_ptr + rh1[:, None] * stride_sm + lane_w
        code_lo2 = codes_ptr + rl1[:, None] * stride_codes + lane_w
        code_hi2 = codes_ptr + rh1[:, None] * stride_codes + lane_w
    x64 = x_ptr.to(tl.pointer_type(tl.int64))
    x_row0 = x64 + tl.minimum(pid_m * BLOCK_M + g, M - 1)[:, None] * (stride_xm // 4) + lane_w
    x_row1 = x64 + tl.minimum(pid_m * BLOCK_M + 8 + g, M - 1)[:, None] * (stride_xm // 4) + lane_w

    w_begin = pid_k * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, n_words)
    full_end = w_begin + (w_end - w_begin) // BLOCK_W * BLOCK_W
    zero = tl.zeros((T,), dtype=tl.float32)
    d0, d1, d2, d3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    f0, f1, f2, f3, h0, h1, h2, h3 = zero, zero, zero, zero, zero, zero, zero, zero
    for start in range(w_begin, full_end, BLOCK_W):
        for u in tl.static_range(BLOCK_W // 16):
            if TILED:  # the group's words start + 16 u ..: at 16 times that after the rows' starts
                w = start + 16 * u
                ww = 16 * w
            else:
                w = start + 4 * u
                ww = w
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _group(
                d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww, w, w_end, lane_w,
                x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
                TILES, NT, False, ASM)
    if not EVEN_K:
        if full_end < w_end:  # only the last split has a partial chunk: its words past w_end masked
            for u in tl.static_range(BLOCK_W // 16):
                if TILED:  # whole groups (K % 64 == 0): a group past w_end is masked whole
                    w = full_end + 16 * u
                    ww = 16 * w
                else:
                    w = full_end + 4 * u
                    ww = w
                d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _group(
                    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww,
                    w, w_end, lane_w,
                    x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
                    TILES, NT, True, ASM)

    # Each accumulator's x row mm and W row (nn unclamped, rows clamped, ok: one of the block's),
    # stacked as the accumulators are; m-tile 1's apart.
    mb = pid_m * BLOCK_M + 2 * q
    mm = _stack(mb, mb + 1, mb, mb + 1, mb + 8, mb + 9, mb + 8, mb + 9, NT)
    nn0 = _stack(lo0, lo0, hi0, hi0, lo0, lo0, hi0, hi0, NT)
    nn1 = _stack(lo1, lo1, hi1, hi1, lo1, lo1, hi1, hi1, NT)
    rows0 = _stack(rl0, rl0, rh0, rh0, rl0, rl0, rh0, rh0, NT)
    rows1 = _stack(rl1, rl1, rh1, rh1, rl1, rl1, rh1, rh1, NT)
    if GATED:
        v0 = _stack(ok0, ok0, ok0, ok0, ok0, ok0, ok0, ok0, NT)
        v1 = _stack(ok1, ok1, ok1, ok1, ok1, ok1, ok1, ok1, NT)
    else:
        v0, v1 = nn0 < N, nn1 < N
    acc = _stack(d0, d1, d2, d3, e0, e1, e2, e3, NT)
    acc2 = _stack(f0, f1, f2, f3, h0, h1, h2, h3, NT)  # TILES 2: m-tile 1
    if SPLIT_K > 1:  # the serial split-K semaphore (as _store_block): the last program sums the partials in split order
        part0 = part_ptr + mm * N + nn0  # [SPLIT_K, M, N] fp32
        part1 = part_ptr + mm * N + nn1
        tl.store(part0 + pid_k * M * N, acc, mask=(mm < M) & v0)
        if TILES == 2:
            tl.store(part1 + pid_k * M * N, acc2, mask=(mm < M) & v1)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        acc = tl.zeros_like(acc)
        acc2 = tl.zeros_like(acc2)
        for ks in tl.static_range(SPLIT_K):  # unrolled: every partial's load in flight at once
            acc += tl.load(part0 + ks * M * N, mask=tl.where(last, (mm < M) & v0, False), other=0.0,
                           cache_modifier=".cg")
            if TILES == 2:
                acc2 += tl.load(part1 + ks * M * N, mask=tl.where(last, (mm < M) & v1, False), other=0.0,
                                cache_modifier=".cg")
        if last:
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA graph replays)
    else:
        last = pid_k == 0
    if last:
        y1 = _finish(acc, mm, rows0, v0, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, M, K,
                     stride_xm, stride_ym, y_scale, LANES, LANE_GROUP, hw_ptr, xg_ptr, stride_xg, parts_ptr,
                     n_parts, inv_k, eps, pid_m, BLOCK_M, GATED, RESIDUAL, HAND_IN, HAND_OUT, BLOCK_P, ROUND_BF16,
                     EXPF)
        y2 = y1
        if TILES == 2:
            y2 = _finish(acc2, mm, rows1, v1, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, M, K,
                         stride_xm, stride_ym, y_scale, LANES, LANE_GROUP, hw_ptr, xg_ptr, stride_xg, parts_ptr,
                         n_parts, inv_k, eps, pid_m, BLOCK_M, GATED, RESIDUAL, HAND_IN, HAND_OUT, BLOCK_P, ROUND_BF16,
                     EXPF)
        if HAND_OUT:
            _parts_out(y1, y2, parts_ptr, pid_n, pid_m, M, WARPS, TILES, BLOCK_M)


def hmma_applies(x: torch.Tensor, k: int, base: int) -> bool:
    """Whether an hmma config runs this kernel: 1..16 rows of bf16 x, and ``words_and_scales``."""
    return x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= MAX_ROWS and words_and_scales(k, base)


def hmma_rows(m: int) -> int:
    """Rows of x a program of M: 8 (one n-tile) where NARROW and M <= 8, else 16."""
    return 8 if NARROW and m <= 8 else MAX_ROWS


def launch_hmma(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, gated: bool = False,
                residual: bool = False, hand_in=None, hand_out=None) -> None:
    """y = x · Wᵀ by ``_u12_hmma_kernel`` (``hmma_applies`` holds); grid (N blocks, splits, 1).
    With kernels/u12_fused_linear.py's epilogue: gated (t is [gate; up], y [M, N / 2] is
    silu(gate) · up), residual (y is the residual, added into in place), hand_in / hand_out (a
    ``NormHandoff`` consumed, or produced: its xg and parts, one a warp, allocated here)."""
    m, k = x.shape
    n = t.shape[0]
    n_words = k // 4
    x = aligned_rows(x, True)
    block_m = hmma_rows(m)
    grid, words_per_split, part, counters = _split_k_plan(t, cfg, m, n_words, block_m)
    native = on_native(x)  # the interpreter runs no PTX
    sm, codes = t.sm.contiguous().view(torch.int32), t.codes.contiguous().view(torch.int16)
    lanes, n_lanes = lanes_args(t, block=True)
    epi, flags, fused = epilogue_args(x, y, native, grid[0] * cfg.num_warps, gated, residual, hand_in, hand_out)
    hw, xg, parts, n_out, inv_k, eps, n_parts, stride_xg = epi
    _u12_hmma_kernel[grid](
        x, sm, codes,
        _nonempty(t.esc_idx), _nonempty(t.esc_val), t.esc_row_ptr, lanes, y, part, counters, hw, xg, parts,
        m, n, k, n_words, biased_scale(t.base), words_per_split, n_out, inv_k, eps, n_parts,
        x.stride(0), n_words, n_words, y.stride(0), stride_xg,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, WARPS=cfg.num_warps, SPLIT_K=grid[1],
        EVEN_K=n_words % cfg.block_w == 0, ASM=native,
        **cfg.launch_options(native, fp_fusion=not fused),
        **pdl_args(x.device), LANES=n_lanes, LANE_GROUP=lane_group(n_lanes), TILED=t.layout == "tiles", **flags,
    )


# --- registry entry -------------------------------------------------------------------------

# One warp of two m-tiles: the cases cover partial N blocks, split-K and masked last chunks.
_HMMA_CHECK_CONFIG = U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")

register(KernelSpec(
    name="u12_hmma",
    run=functools.partial(u12_linear, config=_HMMA_CHECK_CONFIG),
    reference=u12_linear_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(5, 17, 64, torch.bfloat16, "few"),  # 16 words: one masked chunk (BLOCK_W 32); one n-tile, 3 re-read x rows
        _case(3, 40, 96, torch.bfloat16, "special"),  # 3 rows (TENSOR_CORE_ROWS): one n-tile; 24 words, 2 splits
        _case(16, 64, 128, torch.bfloat16, "special"),  # 32 words: one full chunk a split, 2 N blocks
        _case(13, 17, 136, torch.bfloat16, "few"),  # 34 words: the second split a masked chunk of 2 words
        _case(9, 40, 96, torch.bfloat16, "special"),  # 24 words: a full chunk, then a split of one masked group
        _case(16, 17, 64, torch.float32, "few"),  # fp32 x: the tile kernel
        _case(17, 9, 32, torch.bfloat16, "few"),  # M past 16: the tile kernel
        _case(8, 17, 64, torch.bfloat16, "all"),  # base 241, not biased: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=_plant_wrong_weight,
    description="u12_linear with an hmma config: 1..16 rows by mma.sync on fragments decoded in registers, "
                "escapes exact",
))
