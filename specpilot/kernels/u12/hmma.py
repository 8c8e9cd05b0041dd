"""The hmma kernel: y = x · Wᵀ for 1..64 rows of x by warp-level tensor-core MMAs (mma.sync).

Why a second tensor-core kernel: mma.py goes through tl.dot, which on sm_90 is wgmma; its words
pass through shared memory and the warp group waits for its wgmma within each chunk, so a
program's decode and its dot never overlap. Here everything stays in registers, as in gemv2: each
thread loads its words straight from global memory, decodes them (the biased decode,
``pair_patterns``) directly into the A fragment of ``mma.sync.aligned.m16n8k16`` and multiplies by
x's B fragments, loaded as words too. No shared memory, no barrier in the loop (sm_90 SASS,
tests/test_kernel_static.py); a warp's MMAs are asynchronous to its next decode.

Fragments. A warp owns 16 · TILES rows of W and the BLOCK_M rows of x of its M block: two n-tiles
of 8 (16 rows), one (at most 8 rows), or four (32 rows, one m-tile a warp: ``hmma_rows``). Lane l
(g = l // 4, q = l % 4) of an m-tile holds rows g and g + 8 of the tile. A chunk of BLOCK_W words
a row is BLOCK_W / 16 groups of 16 words; in each group lane q reads 4 words of each of its rows
(one 16-byte load a row) and their codes, and since K's order inside the sum is free, k-step s of
a group takes the lane's word s: its pair registers (weights 0, 2) and (1, 3) are exactly the
bf16x2 registers of the A fragment (PTX ISA, "Matrix Fragments for mma.m16n8k16"). The B fragment
of lane l holds the same k of x's row g: the same word, read as one int64 of 4 bf16, split by two
prmt. So every lane reads contiguous words and nothing is permuted. The fragments are Triton
tensors of shape [32 · warps], one element a thread, and the MMA is ``tl.inline_asm_elementwise``
over them; under the interpreter ``_mma_emulated`` does its arithmetic with gathers across the
lanes, so the CPU tests check the fragment mapping itself.

Tiled weights (``U12Tensor.layout`` "tiles"): a warp's word loads read 512 contiguous bytes, with
the same loads, MMAs and registers as on the row planes and the row planes' sums bit for bit.

The epilogue stays in the fragments' layout, every tensor [T] (``_finish``): each accumulator
walks the table's escapes of its W row, takes back their spurious x · 2^-15 and adds x · w
exactly, then the scale 2^(base-113); split-K by the serial semaphore; fused.py's epilogues
(SiLU·mul with an m-tile's rows g gate rows and g + 8 their up rows, the residual add, a norm
handed in or on, its Σ y² parts one a warp). bf16 x only (``hmma_applies``). Measurements and
what was tried: docs/experiments/u12-hmma.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..bf16_words import aligned_rows
from ..fused_linear import epilogue
from ..overlap import Launch, pdl_args, pdl_enter
from ..rounding import to_dtype
from ..target import native as on_native
from .config import U12Config
from .decode import ESC_DECODED, biased_scale, pair_patterns, prmt, words_and_scales
from .epilogue import epilogue_args, split_k_plan
from .escapes import nonempty
from .planes import row_words

MAX_ROWS = 16  # rows of x a 16-row program: two n-tiles of mma.m16n8k16 (x rows 0..7 and 8..15)
MAX_M = 64  # rows of x a launch at most: past a program's rows, row blocks side by side (``launch_hmma``)
# Phase stamps for bench/kernels/hmma_trace.py (``launch_hmma``'s ``trace``, int64 [programs,
# TRACE_SLOTS], zeroed): thread 0 of each program stores %globaltimer at entry, after the main loop,
# after the split-K semaphore, after the summing program's sum and after its epilogue's stores
# (slots 0-4), and its SM's id at slot 5. Without a buffer the kernel has none of it.
_SLOTS = tl.constexpr(8)  # the kernel's view (a jit function reads only constexpr globals)
TRACE_SLOTS = _SLOTS.value


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
def mma_sync(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
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
def _wload(ptrs, mask, MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """tl.load(ptrs) (masked: 0 where mask is false); EVICT_FIRST: L1 evict-first, the weights'
    loads (each weight byte is read once, and x's words, which every warp reads again, share L1)."""
    if EVICT_FIRST:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
        return tl.load(ptrs, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0) if MASKED else tl.load(ptrs)


@triton.jit
def _load4(ptrs, w, w_end, lane_w, MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr = 0):
    """The 4 words ptrs + w [T, 4] (ptrs at the lane's words lane_w; masked at words past w_end: 0) as
    4 tensors [T]; EVICT_FIRST: the weights' loads (``_wload``)."""
    return _four(_wload(ptrs + w, w + lane_w < w_end, MASKED, EVICT_FIRST))


@triton.jit
def _b_fragment(xw, ASM: tl.constexpr):
    """An int64 of 4 bf16 x values (x0 in the low bits) as the B registers (x0, x2) and (x1, x3)."""
    lo = xw.to(tl.int32)
    hi = (xw >> 32).to(tl.int32)
    return prmt(lo, hi, 0x5410, ASM), prmt(lo, hi, 0x7632, ASM)


@triton.jit
def _tile_step(d0, d1, d2, d3, e0, e1, e2, e3, s_lo, c_lo, s_hi, c_hi, x0, x1, NT: tl.constexpr,
               ASM: tl.constexpr):
    """One k-step of one m-tile: decode the word of rows g (s_lo, c_lo: int16 codes) and g + 8 into
    the A fragment, multiply by the B fragments of x's word in each of the NT n-tiles (x0 -> d: x
    rows 0..7, x1 -> e: 8..15)."""
    b00, b01 = _b_fragment(x0, ASM)
    p02_lo, p13_lo = pair_patterns(s_lo, c_lo.to(tl.int32), ASM)
    p02_hi, p13_hi = pair_patterns(s_hi, c_hi.to(tl.int32), ASM)
    d0, d1, d2, d3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b00, b01, d0, d1, d2, d3, ASM)
    if NT == 2:
        b10, b11 = _b_fragment(x1, ASM)
        e0, e1, e2, e3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b10, b11, e0, e1, e2, e3, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit
def _tile_steps(d0, d1, d2, d3, e0, e1, e2, e3, s_lo0, s_lo1, s_lo2, s_lo3, s_hi0, s_hi1, s_hi2, s_hi3,
                c_lo0, c_lo1, c_lo2, c_lo3, c_hi0, c_hi1, c_hi2, c_hi3,
                x00, x01, x02, x03, x10, x11, x12, x13, NT: tl.constexpr, ASM: tl.constexpr):
    """One m-tile's 4 k-steps over a loaded group: k-step s on word s of each lane's 4."""
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
def _tile_group(
    d0, d1, d2, d3, e0, e1, e2, e3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end, lane_w,
    x00, x01, x02, x03, x10, x11, x12, x13, NT: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
):
    """One m-tile over a group of 16 words a row (the group's word w; its weights at offset ww of
    the planes' pointers): its words loaded, then ``_tile_steps``."""
    shift = ww - w  # 0 in rows; the tiled planes' offset (the masks stay x's)
    s_lo0, s_lo1, s_lo2, s_lo3 = _load4(sm_lo + shift, w, w_end, lane_w, MASKED, 1)
    s_hi0, s_hi1, s_hi2, s_hi3 = _load4(sm_hi + shift, w, w_end, lane_w, MASKED, 1)
    c_lo0, c_lo1, c_lo2, c_lo3 = _load4(code_lo + shift, w, w_end, lane_w, MASKED, 1)
    c_hi0, c_hi1, c_hi2, c_hi3 = _load4(code_hi + shift, w, w_end, lane_w, MASKED, 1)
    return _tile_steps(d0, d1, d2, d3, e0, e1, e2, e3, s_lo0, s_lo1, s_lo2, s_lo3, s_hi0, s_hi1, s_hi2, s_hi3,
                       c_lo0, c_lo1, c_lo2, c_lo3, c_hi0, c_hi1, c_hi2, c_hi3,
                       x00, x01, x02, x03, x10, x11, x12, x13, NT, ASM)


@triton.jit
def _tile_step_wide(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, s_lo, c_lo, s_hi, c_hi,
                    x0, x1, x2, x3, ASM: tl.constexpr):
    """``_tile_step`` for 32 rows of x (``hmma_rows``: 32-row programs): the word decoded once into the A fragment, then
    multiplied by the B fragments of 4 n-tiles (x0 -> d: x rows 0..7, x1 -> e: 8..15, x2 -> f:
    16..23, x3 -> h: 24..31)."""
    p02_lo, p13_lo = pair_patterns(s_lo, c_lo.to(tl.int32), ASM)
    p02_hi, p13_hi = pair_patterns(s_hi, c_hi.to(tl.int32), ASM)
    b0, b1 = _b_fragment(x0, ASM)
    d0, d1, d2, d3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, d0, d1, d2, d3, ASM)
    b0, b1 = _b_fragment(x1, ASM)
    e0, e1, e2, e3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, e0, e1, e2, e3, ASM)
    b0, b1 = _b_fragment(x2, ASM)
    f0, f1, f2, f3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, f0, f1, f2, f3, ASM)
    b0, b1 = _b_fragment(x3, ASM)
    h0, h1, h2, h3 = mma_sync(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, h0, h1, h2, h3, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _tile_group_wide(
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end,
    lane_w, x_row0, x_row1, x_row2, x_row3, MASKED: tl.constexpr, ASM: tl.constexpr,
):
    """``_tile_group`` for 32 rows of x: the group's words loaded and each decoded once for the 4 n-tiles."""
    shift = ww - w
    s_lo = _load4(sm_lo + shift, w, w_end, lane_w, MASKED, 1)
    s_hi = _load4(sm_hi + shift, w, w_end, lane_w, MASKED, 1)
    c_lo = _load4(code_lo + shift, w, w_end, lane_w, MASKED, 1)
    c_hi = _load4(code_hi + shift, w, w_end, lane_w, MASKED, 1)
    x0 = _load4(x_row0, w, w_end, lane_w, MASKED)
    x1 = _load4(x_row1, w, w_end, lane_w, MASKED)
    x2 = _load4(x_row2, w, w_end, lane_w, MASKED)
    x3 = _load4(x_row3, w, w_end, lane_w, MASKED)
    for s in tl.static_range(4):  # k-step s on word s of each lane's 4
        d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _tile_step_wide(
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, s_lo[s], c_lo[s], s_hi[s], c_hi[s],
            x0[s], x1[s], x2[s], x3[s], ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _x_words(x_row0, x_row1, w, w_end, lane_w, NT: tl.constexpr, MASKED: tl.constexpr):
    """x's words of a group for the n-tiles: rows 0..7 (and 8..15); one n-tile: no second x row,
    its accumulators stay 0."""
    x00, x01, x02, x03 = _load4(x_row0, w, w_end, lane_w, MASKED)
    if NT == 2:
        x10, x11, x12, x13 = _load4(x_row1, w, w_end, lane_w, MASKED)
    else:
        x10, x11, x12, x13 = x00, x01, x02, x03
    return x00, x01, x02, x03, x10, x11, x12, x13


@triton.jit
def _group(
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww, w, w_end, lane_w,
    x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
    TILES: tl.constexpr, NT: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr,
    x_row2=None, x_row3=None, WIDE: tl.constexpr = False,
):
    """A 16-word group of the warp's m-tiles (accumulators d, e: tile 0; f, h: tile 1; e and h the
    second n-tile's), x's words loaded once for all. WIDE (one m-tile): f and h x rows 16..31's."""
    if WIDE:
        d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _tile_group_wide(
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, sm_lo, code_lo, sm_hi, code_hi, ww, w,
            w_end, lane_w, x_row0, x_row1, x_row2, x_row3, MASKED, ASM)
    else:
        x00, x01, x02, x03, x10, x11, x12, x13 = _x_words(x_row0, x_row1, w, w_end, lane_w, NT, MASKED)
        d0, d1, d2, d3, e0, e1, e2, e3 = _tile_group(
            d0, d1, d2, d3, e0, e1, e2, e3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end, lane_w,
            x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM)
    if TILES == 2:
        f0, f1, f2, f3, h0, h1, h2, h3 = _tile_group(
            f0, f1, f2, f3, h0, h1, h2, h3, sm_lo2, code_lo2, sm_hi2, code_hi2, ww, w, w_end, lane_w,
            x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _group_at(start, u: tl.constexpr, BLOCK_W: tl.constexpr, TILED: tl.constexpr):
    """Group u of the chunk at word start: (w, its first word in x and the masks; ww, its offset in
    the planes): tiled, the group's words start + 16 u .. at 16 times that after the rows' starts."""
    if TILED:
        w = start + 16 * u
        return w, 16 * w
    else:
        return start + 4 * u, start + 4 * u


@triton.jit
def _stamp(trace_ptr, slot: tl.constexpr, dep, t, TRACE: tl.constexpr):
    """TRACE: thread 0 of the program stores %globaltimer (ns) at its row's `slot` once dep ([T],
    32-bit) is ready: the read is predicated on dep, so ptxas cannot hoist it above what dep waits for."""
    if TRACE:
        ns = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $1, 2147483647; @p mov.u64 $0, %globaltimer; @!p mov.u64 $0, 1; }",
            "=l,r", [dep.to(tl.int32, bitcast=True)], dtype=tl.int64, is_pure=False, pack=1,
        )
        tl.store(trace_ptr + _program() * _SLOTS + slot + t * 0, ns, mask=t == 0)


@triton.jit
def _stamp_sm(trace_ptr, t, TRACE: tl.constexpr):
    """TRACE: thread 0 of the program stores its SM (%smid) at its row's slot 5."""
    if TRACE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [t], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(trace_ptr + _program() * _SLOTS + 5 + t * 0, sm.to(tl.int64), mask=t == 0)


@triton.jit
def _program():
    """The program's row of the trace buffer: its index in the launch's grid."""
    return (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)


# --- the epilogue: every tensor [T], one element a thread ----------------------------------------
# The accumulators d0..d3 (n-tile 0) and e0..e3 (n-tile 1) of an m-tile are [T] tensors in the 1-D
# layout the loop leaves them in; element c of a lane is (W row g for c0, c1, g + 8 for c2, c3; x row
# 2 q for c0, c2, 2 q + 1 for c1, c3; n-tile 1: x rows + 8). A [T] load or store is already in the
# layout Triton's coalescing pass wants, so nothing here converts layouts.


@triton.jit
def _part_store(pk, a0, a1, a2, a3, b0, b1, b2, b3, m0, m1, m2, m3, lo, hi, vl, vh, M, N, NT: tl.constexpr):
    """An m-tile's split-K partials at pk ([M, N] fp32: rows lo (a0, a1, b0, b1) and hi, x rows m0..m3)."""
    tl.store(pk + m0 * N + lo, a0, mask=(m0 < M) & vl)
    tl.store(pk + m1 * N + lo, a1, mask=(m1 < M) & vl)
    tl.store(pk + m0 * N + hi, a2, mask=(m0 < M) & vh)
    tl.store(pk + m1 * N + hi, a3, mask=(m1 < M) & vh)
    if NT == 2:
        tl.store(pk + m2 * N + lo, b0, mask=(m2 < M) & vl)
        tl.store(pk + m3 * N + lo, b1, mask=(m3 < M) & vl)
        tl.store(pk + m2 * N + hi, b2, mask=(m2 < M) & vh)
        tl.store(pk + m3 * N + hi, b3, mask=(m3 < M) & vh)


@triton.jit
def _part_sum1(part_ptr, m, n, ok, M, N, SPLIT_K: tl.constexpr):
    """Σ over the splits, in split order, of the partials at (m, n) (ok: the last program's, in range)."""
    acc = tl.zeros(m.shape, dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):  # unrolled: every partial's load in flight at once
        acc += tl.load(part_ptr + ks * M * N + m * N + n, mask=ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _part_sum(part_ptr, last, m0, m1, m2, m3, lo, hi, vl, vh, M, N, SPLIT_K: tl.constexpr, NT: tl.constexpr):
    """An m-tile's sums from the partials (``_part_store``), in split order; 0 but in the last program."""
    a0 = _part_sum1(part_ptr, m0, lo, tl.where(last, (m0 < M) & vl, False), M, N, SPLIT_K)
    a1 = _part_sum1(part_ptr, m1, lo, tl.where(last, (m1 < M) & vl, False), M, N, SPLIT_K)
    a2 = _part_sum1(part_ptr, m0, hi, tl.where(last, (m0 < M) & vh, False), M, N, SPLIT_K)
    a3 = _part_sum1(part_ptr, m1, hi, tl.where(last, (m1 < M) & vh, False), M, N, SPLIT_K)
    b0, b1, b2, b3 = a0, a1, a2, a3
    if NT == 2:
        b0 = _part_sum1(part_ptr, m2, lo, tl.where(last, (m2 < M) & vl, False), M, N, SPLIT_K)
        b1 = _part_sum1(part_ptr, m3, lo, tl.where(last, (m3 < M) & vl, False), M, N, SPLIT_K)
        b2 = _part_sum1(part_ptr, m2, hi, tl.where(last, (m2 < M) & vh, False), M, N, SPLIT_K)
        b3 = _part_sum1(part_ptr, m3, hi, tl.where(last, (m3 < M) & vh, False), M, N, SPLIT_K)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _esc_step(e, s, xr, col, val, has):
    """One escape of an element's row: + x · w exactly, and its spurious x · 2^-15."""
    xv = tl.load(xr + col, mask=has, other=0.0).to(tl.float32)
    return e + tl.where(has, xv * val, 0.0), s + xv * ESC_DECODED


@triton.jit
def _esc_rows(esc_row_ptr, rl, rh, vl, vh):
    """Where rows rl and rh's escapes start in the CSR table, and how many (0 where not the block's)."""
    start_l = tl.load(esc_row_ptr + rl)
    cnt_l = tl.where(vl, tl.load(esc_row_ptr + rl + 1) - start_l, 0)
    start_h = tl.load(esc_row_ptr + rh)
    cnt_h = tl.where(vh, tl.load(esc_row_ptr + rh + 1) - start_h, 0)
    return start_l, cnt_l, start_h, cnt_h


@triton.jit
def _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm):
    """Pointers to x rows m0..m3 (clamped to M - 1: rows past M are never stored)."""
    return (x_ptr + tl.minimum(m0, M - 1) * stride_xm, x_ptr + tl.minimum(m1, M - 1) * stride_xm,
            x_ptr + tl.minimum(m2, M - 1) * stride_xm, x_ptr + tl.minimum(m3, M - 1) * stride_xm)


@triton.jit
def _entry(esc_idx_ptr, esc_val_ptr, start, j, cnt, K):
    """Escape j of a row whose escapes start at `start` in the table (``_esc_rows``): its column and
    value (fp32), where j < cnt (else 0 and 0: masked, no load)."""
    has = j < cnt
    idx = tl.load(esc_idx_ptr + start + j, mask=has, other=0)
    val = (tl.load(esc_val_ptr + start + j, mask=has, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return idx % K, val, has


@triton.jit
def _walk_one(e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, xr0, xr1, xr2, xr3,
              col_l, val_l, has_l, col_h, val_h, has_h, NT: tl.constexpr):
    """One escape of rows rl and rh (``_entry``'s) into the m-tile's 8 elements' (Σ x · w, Σ x · 2^-15)."""
    e0, s0 = _esc_step(e0, s0, xr0, col_l, val_l, has_l)  # row g, x rows 2 q and 2 q + 1
    e1, s1 = _esc_step(e1, s1, xr1, col_l, val_l, has_l)
    e2, s2 = _esc_step(e2, s2, xr0, col_h, val_h, has_h)  # row g + 8
    e3, s3 = _esc_step(e3, s3, xr1, col_h, val_h, has_h)
    if NT == 2:
        e4, s4 = _esc_step(e4, s4, xr2, col_l, val_l, has_l)
        e5, s5 = _esc_step(e5, s5, xr3, col_l, val_l, has_l)
        e6, s6 = _esc_step(e6, s6, xr2, col_h, val_h, has_h)
        e7, s7 = _esc_step(e7, s7, xr3, col_h, val_h, has_h)
    return e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _walk_from(e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, begin,
               start_l, cnt_l, start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K,
               NT: tl.constexpr, UNROLL: tl.constexpr):
    """The sums (e, s) carried on through escapes begin, begin + 1, ... of rows rl and rh
    (``_esc_rows``), each row's in order, one walk as long as the block's longest row, UNROLL
    escapes a step (their loads in flight at once)."""
    for j0 in range(begin, tl.max(tl.maximum(cnt_l, cnt_h)), UNROLL):
        for jj in tl.static_range(UNROLL):  # in order: the sums as one escape a step
            j = j0 + jj
            col_l, val_l, has_l = _entry(esc_idx_ptr, esc_val_ptr, start_l, j, cnt_l, K)
            col_h, val_h, has_h = _entry(esc_idx_ptr, esc_val_ptr, start_h, j, cnt_h, K)
            e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _walk_one(
                e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, xr0, xr1, xr2, xr3,
                col_l, val_l, has_l, col_h, val_h, has_h, NT)
    return e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _table_walk(start_l, cnt_l, start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K,
                NT: tl.constexpr, UNROLL: tl.constexpr):
    """The escapes of rows rl and rh (``_esc_rows``) from the CSR table for x rows xr0..xr3
    (pointers): (Σ x · w, Σ x · 2^-15) of each of the m-tile's 8 elements (``_walk_from``)."""
    z = tl.zeros(start_l.shape, dtype=tl.float32)
    return _walk_from(z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, 0, start_l, cnt_l, start_h, cnt_h,
                      xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, UNROLL)


@triton.jit
def _early_entries(esc_idx_ptr, esc_val_ptr, start_l, cnt_l, start_h, cnt_h, K):
    """EARLY: the first 4 escapes of rows rl and rh, their loads in flight together: (column,
    value, present) of each, row rl's then rh's (``_early_walk`` takes them)."""
    a = _entry(esc_idx_ptr, esc_val_ptr, start_l, 0, cnt_l, K)
    b = _entry(esc_idx_ptr, esc_val_ptr, start_l, 1, cnt_l, K)
    c = _entry(esc_idx_ptr, esc_val_ptr, start_l, 2, cnt_l, K)
    d = _entry(esc_idx_ptr, esc_val_ptr, start_l, 3, cnt_l, K)
    e = _entry(esc_idx_ptr, esc_val_ptr, start_h, 0, cnt_h, K)
    f = _entry(esc_idx_ptr, esc_val_ptr, start_h, 1, cnt_h, K)
    g = _entry(esc_idx_ptr, esc_val_ptr, start_h, 2, cnt_h, K)
    h = _entry(esc_idx_ptr, esc_val_ptr, start_h, 3, cnt_h, K)
    return a, b, c, d, e, f, g, h


@triton.jit
def _early_walk(ents, start_l, cnt_l, start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K,
                NT: tl.constexpr, UNROLL: tl.constexpr):
    """``_table_walk``'s sums, bit for bit, from ``_early_entries``' first 4 escapes of each row (already
    in registers: only their x gathers left), then the rest of the walk from the 5th."""
    z = tl.zeros(start_l.shape, dtype=tl.float32)
    e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z
    for j in tl.static_range(4):
        col_l, val_l, has_l = ents[j]
        col_h, val_h, has_h = ents[4 + j]
        e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _walk_one(
            e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, xr0, xr1, xr2, xr3,
            col_l, val_l, has_l, col_h, val_h, has_h, NT)
    return _walk_from(e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, 4, start_l, cnt_l,
                      start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, UNROLL)


@triton.jit
def _out1(g, u, m, col, ok, inv, res, hw, y_ptr, stride_ym, xg_ptr, stride_xg, M,
          GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAND_IN: tl.constexpr,
          HAND_OUT: tl.constexpr, ROUND_BF16: tl.constexpr, EXPF: tl.constexpr):
    """Store one element (gated: g and u its gate and up sums) of x row m at output column col; the
    stored value where stored, else 0. inv, res and hw: the element's handed-in inv, residual and
    handed-out norm weight (``_finish`` loads them all before the first store)."""
    mask = (m < M) & ok
    if GATED or RESIDUAL or HAND_IN:  # fused.py's epilogue
        DTYPE: tl.constexpr = y_ptr.dtype.element_ty
        if HAND_IN:  # rmsnorm's inv of row m (``_lane_invs``), factored out of the sums (x = dtype(stream · weight))
            g = g * inv
            u = u * inv
        y = epilogue(g, u, y_ptr + m * stride_ym + col, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF,
                     res=res, RES_LOADED=True)
        if HAND_OUT:  # xg = dtype(y · the norm's weight)
            tl.store(xg_ptr + m * stride_xg + col, to_dtype(y * hw, DTYPE, ROUND_BF16).to(DTYPE), mask=mask)
    else:
        y = g
        tl.store(y_ptr + m * stride_ym + col, y.to(y_ptr.dtype.element_ty), mask=mask)
    return tl.where(mask, y, 0.0)


@triton.jit
def _res(y_ptr, m, col, ok, M, stride_ym):
    """The residual (y, added into) at x row m, column col, fp32; 0 where not stored."""
    return tl.load(y_ptr + m * stride_ym + col, mask=(m < M) & ok, other=0.0).to(tl.float32)


@triton.jit
def _finish(
    a0, a1, a2, a3, b0, b1, b2, b3, m0, m1, m2, m3, rl, rh, vl, vh, i0, i1, i2, i3, sl, cl, sh, ch,
    x_ptr, esc_idx_ptr, esc_val_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale, hw_ptr, xg_ptr, stride_xg,
    GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAND_IN: tl.constexpr, HAND_OUT: tl.constexpr,
    ROUND_BF16: tl.constexpr, EXPF: tl.constexpr, NT: tl.constexpr, ESC_UNROLL: tl.constexpr,
    WALKED: tl.constexpr, w0, w1, w2, w3, w4, w5, w6, w7,
):
    """y from one m-tile's biased sums a (n-tile 0) and b (n-tile 1), [T] tensors: per element, the
    escapes of its W row take back their spurious x · 2^-15 and add x · w exactly, then the scale,
    then fused.py's epilogue where asked (``_out1``). Rows rl and rh are clamped, vl and vh where
    they are the block's; gated, rl is the output column's gate row and rh its up row; sl, cl, sh,
    ch their escapes' ``_esc_rows`` (unused where WALKED). WALKED (EARLY): a and b have their
    escapes' spurious terms taken back, w0..w7 are their Σ x · w. Returns the stored values of x
    rows m0..m3 at rows rl (and, not gated, rh): 0 where not stored."""
    xr0, xr1, xr2, xr3 = _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm)
    z = tl.zeros(rl.shape, dtype=tl.float32)
    e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z
    if WALKED:  # EARLY: the spurious terms taken back already; the escapes' Σ x · w handed in
        e0, e1, e2, e3, e4, e5, e6, e7 = w0, w1, w2, w3, w4, w5, w6, w7
    else:
        e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _table_walk(
            sl, cl, sh, ch, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, ESC_UNROLL)
    a0 = (a0 - s0) * y_scale + e0  # the spurious x · 2^-15 back, the scale, then x · w
    a1 = (a1 - s1) * y_scale + e1
    a2 = (a2 - s2) * y_scale + e2
    a3 = (a3 - s3) * y_scale + e3
    if NT == 2:
        b0 = (b0 - s4) * y_scale + e4
        b1 = (b1 - s5) * y_scale + e5
        b2 = (b2 - s6) * y_scale + e6
        b3 = (b3 - s7) * y_scale + e7
    # gated: an element's gate sum with row g + 8's up sum at output column rl (rows g + 8 store
    # nothing of their own); else every element its own sum at its own row
    u0, u1, u4, u5 = a0, a1, b0, b1
    if GATED:
        u0, u1, u4, u5 = a2, a3, b2, b3
    # every load of the epilogue before its first store (a load after a store that may alias waits
    # for it)
    r0, r1, r2, r3, r4, r5, r6, r7 = z, z, z, z, z, z, z, z
    if RESIDUAL:
        r0, r1 = _res(y_ptr, m0, rl, vl, M, stride_ym), _res(y_ptr, m1, rl, vl, M, stride_ym)
        if not GATED:
            r2, r3 = _res(y_ptr, m0, rh, vh, M, stride_ym), _res(y_ptr, m1, rh, vh, M, stride_ym)
        if NT == 2:
            r4, r5 = _res(y_ptr, m2, rl, vl, M, stride_ym), _res(y_ptr, m3, rl, vl, M, stride_ym)
            if not GATED:
                r6, r7 = _res(y_ptr, m2, rh, vh, M, stride_ym), _res(y_ptr, m3, rh, vh, M, stride_ym)
    hl, hh = z, z
    if HAND_OUT:
        hl = tl.load(hw_ptr + rl).to(tl.float32)
        if not GATED:
            hh = tl.load(hw_ptr + rh).to(tl.float32)
    y0 = _out1(a0, u0, m0, rl, vl, i0, r0, hl, y_ptr, stride_ym, xg_ptr, stride_xg, M,
               GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
    y1 = _out1(a1, u1, m1, rl, vl, i1, r1, hl, y_ptr, stride_ym, xg_ptr, stride_xg, M,
               GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
    y2, y3, y4, y5, y6, y7 = z, z, z, z, z, z
    if not GATED:
        y2 = _out1(a2, a2, m0, rh, vh, i0, r2, hh, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                   GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
        y3 = _out1(a3, a3, m1, rh, vh, i1, r3, hh, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                   GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
    if NT == 2:
        y4 = _out1(b0, u4, m2, rl, vl, i2, r4, hl, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                   GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
        y5 = _out1(b1, u5, m3, rl, vl, i3, r5, hl, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                   GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
        if not GATED:
            y6 = _out1(b2, b2, m2, rh, vh, i2, r6, hh, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                       GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
            y7 = _out1(b3, b3, m3, rh, vh, i3, r7, hh, y_ptr, stride_ym, xg_ptr, stride_xg, M,
                       GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF)
    return y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _lane_invs(parts_ptr, m0, m1, m2, m3, M, n_parts, inv_k, eps, WARPS: tl.constexpr, BLOCK_P: tl.constexpr,
               NT: tl.constexpr):
    """HAND_IN: rsqrt(Σ parts · inv_k + eps) of each lane's x rows m0..m3 ([T], the sums' layout), with
    no gather: lane g of warp w loads parts w · 8 + g, + 8 · WARPS, ... of its rows (BLOCK_P at a time,
    all in flight), then the 8 lanes g of a quad column and the warps add theirs in one [T, 4]
    reduction (no gather across the program: tests/test_kernel_static.py)."""
    T: tl.constexpr = 32 * WARPS
    STEP: tl.constexpr = 8 * WARPS
    t = tl.arange(0, T)
    first = (t // 32) * 8 + (t % 32) // 4  # w · 8 + g
    r0, r1 = tl.minimum(m0, M - 1), tl.minimum(m1, M - 1)
    r2, r3 = tl.minimum(m2, M - 1), tl.minimum(m3, M - 1)
    z = tl.zeros((T,), dtype=tl.float32)
    s0, s1, s2, s3 = z, z, z, z
    for p0 in range(0, n_parts, BLOCK_P):
        for j in tl.static_range(0, BLOCK_P, STEP):
            p = p0 + j + first
            ok = p < n_parts
            s0 += tl.load(parts_ptr + p * M + r0, mask=ok, other=0.0)
            s1 += tl.load(parts_ptr + p * M + r1, mask=ok, other=0.0)
            if NT == 2:
                s2 += tl.load(parts_ptr + p * M + r2, mask=ok, other=0.0)
                s3 += tl.load(parts_ptr + p * M + r3, mask=ok, other=0.0)
    v = tl.join(tl.join(s0, s1), tl.join(s2, s3))  # [T, 2, 2]
    tot = tl.sum(tl.sum(tl.reshape(v, (WARPS, 8, 4, 4)), axis=1), axis=0)  # [q, row]
    back = tl.reshape(tl.broadcast_to(tot[None, None], (WARPS, 8, 4, 4)), (T, 2, 2))
    a, b = tl.split(back)
    s0, s1 = tl.split(a)
    s2, s3 = tl.split(b)
    return (tl.math.rsqrt(s0 * inv_k + eps), tl.math.rsqrt(s1 * inv_k + eps), tl.math.rsqrt(s2 * inv_k + eps),
            tl.math.rsqrt(s3 * inv_k + eps))


@triton.jit
def _warp_part(sq, parts_ptr, part, m, M, WARPS: tl.constexpr):
    """Σ over a quad column's 8 lanes (rows g) of sq [T]: one part a warp at x row m (a lane's, [T])."""
    s = tl.sum(tl.reshape(sq, (WARPS, 8, 4)), axis=1)  # [warp, q]
    mq = tl.max(tl.reshape(m, (WARPS, 8, 4)), axis=1)  # the same for every g
    tl.store(parts_ptr + part[:, None] * M + mq, s, mask=mq < M)


@triton.jit
def _parts_out(y0, y1, y2, y3, y4, y5, y6, y7, z0, z1, z2, z3, z4, z5, z6, z7, m0, m1, m2, m3,
                    parts_ptr, pid_n, M, WARPS: tl.constexpr, TILES: tl.constexpr, NT: tl.constexpr):
    """A norm handoff's Σ y² parts from ``_finish``'s stored values (y: m-tile 0, z: m-tile 1 where
    TILES 2): one part a warp, parts[pid_n · WARPS + warp, m] summed over the warp's rows (a lane's two
    rows of each m-tile, then across the 8 lanes g of a quad column)."""
    part = pid_n * WARPS + tl.arange(0, WARPS)
    sq0 = y0 * y0 + y2 * y2  # x row m0: rows g and g + 8
    sq1 = y1 * y1 + y3 * y3
    if TILES == 2:
        sq0 += z0 * z0 + z2 * z2
        sq1 += z1 * z1 + z3 * z3
    _warp_part(sq0, parts_ptr, part, m0, M, WARPS)
    _warp_part(sq1, parts_ptr, part, m1, M, WARPS)
    if NT == 2:
        sq2 = y4 * y4 + y6 * y6
        sq3 = y5 * y5 + y7 * y7
        if TILES == 2:
            sq2 += z4 * z4 + z6 * z6
            sq3 += z5 * z5 + z7 * z7
        _warp_part(sq2, parts_ptr, part, m2, M, WARPS)
        _warp_part(sq3, parts_ptr, part, m3, M, WARPS)


@triton.jit
def _u12_hmma_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr,
    hw_ptr, xg_ptr, parts_ptr,  # the epilogue's norm handoff (fused.py's NormHandoff); else unused
    trace_ptr,  # TRACE: int64 [programs, TRACE_SLOTS] phase stamps; else unused
    M, N, K, n_words, y_scale, words_per_split, n_out, inv_k, eps, n_parts,
    stride_xm, stride_sm, stride_codes, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr,  # rows of x a program: 8 (one n-tile of mma.m16n8k16), 16 (two) or 32 (four)
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # ways over K (constexpr: the last program's sum of the partials unrolls)
    EVEN_K: tl.constexpr,  # n_words % BLOCK_W == 0: no split has a masked last chunk
    ASM: tl.constexpr,  # PTX mma.sync and prmt (GPU); else their emulation (interpreter)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    # fused.py's epilogue (``_finish``): GATED (W is [gate; up], n_out = N / 2 output columns; an
    # m-tile's rows g are 8 gate rows, rows g + 8 their up rows), RESIDUAL (y is the residual, added
    # into), HAND_IN (x is a handoff's xg: the sums times its rows' inv), HAND_OUT (the updated
    # stream's norm handed on: xg, a Σ y² part a warp)
    GATED: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
    HAND_IN: tl.constexpr = False, HAND_OUT: tl.constexpr = False,
    BLOCK_P: tl.constexpr = 16,  # HAND_IN: parts summed a chunk
    TILED: tl.constexpr = False,  # W's planes in tiles (U12Tensor.layout)
    ROUND_BF16: tl.constexpr = False,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr = False,  # GATED: libdevice's expf (GPU); else tl.exp
    # escapes a step of the table's walk (``_table_walk``): 1 ran o 16.64 µs against 16.32, 4 and 8
    # no faster (H100: docs/experiments/tried/hmma_epilogue_ab_h100_flat-epilogue-0a8d453.json,
    # hmma_parts_h100.json)
    ESC_UNROLL: tl.constexpr = 2,
    TRACE: tl.constexpr = False,  # phase stamps into trace_ptr (``TRACE_SLOTS``; GPU only)
    # one m-tile a warp: the escapes' row pointers loaded before the loop, each row's first 4 escapes
    # after it, before the split-K semaphore (verify(16) 4.306 ms against 4.412 without: H200,
    # step_ab_h200_verify16.json, c566ca9)
    EARLY: tl.constexpr = False,
):
    pdl_enter(PDL)
    TILES: tl.constexpr = BLOCK_N // (16 * WARPS)  # m-tiles a warp: 1 or 2
    WIDE: tl.constexpr = BLOCK_M == 32  # x rows 16..31 in f and h, each word decoded once for all 32
    NT: tl.constexpr = 2 if WIDE else BLOCK_M // 8  # n-tiles (8 rows of x each) of a 16-row half: 1 or 2
    tl.static_assert(not WIDE or TILES == 1, "32 rows of x a program: one m-tile a warp")
    T: tl.constexpr = 32 * WARPS
    pid_m = tl.program_id(0)  # the M blocks of a W block and split side by side (``launch_hmma``)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    t = tl.arange(0, T)
    _stamp(trace_ptr, 0, t, t, TRACE)
    _stamp_sm(trace_ptr, t, TRACE)
    lane = t % 32
    g = lane // 4
    q = lane % 4
    warp_rows = t // 32
    # Each m-tile's W rows of a lane: lo (its row g) and hi (g + 8); rows past N (gated: columns past
    # n_out) re-read the last one (their outputs are not stored). Plain: the warp's 16 · TILES rows in
    # order. Gated: an m-tile holds 8 output columns c, lo their gate rows c and hi their up rows
    # n_out + c, so each lane holds both halves of its outputs.
    if GATED:
        c0 = pid_n * (BLOCK_N // 2) + warp_rows * (8 * TILES) + g  # m-tile 0's column; m-tile 1's: + 8
        lo0, hi0, lo1, hi1 = c0, c0 + n_out, c0 + 8, c0 + 8 + n_out
        ok0, ok1 = c0 < n_out, c0 + 8 < n_out
        rl0, rl1 = tl.minimum(c0, n_out - 1), tl.minimum(c0 + 8, n_out - 1)
        rh0, rh1 = rl0 + n_out, rl1 + n_out
    else:
        row = n0 + warp_rows * (16 * TILES) + g  # m-tile 0's row g; + 8, + 16, + 24 for the others
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
        sm_lo = sm_ptr + row_words(rl0, stride_sm, True)[:, None] + lane_w
        sm_hi = sm_ptr + row_words(rh0, stride_sm, True)[:, None] + lane_w
        code_lo = codes_ptr + row_words(rl0, stride_codes, True)[:, None] + lane_w
        code_hi = codes_ptr + row_words(rh0, stride_codes, True)[:, None] + lane_w
        sm_lo2 = sm_ptr + row_words(rl1, stride_sm, True)[:, None] + lane_w
        sm_hi2 = sm_ptr + row_words(rh1, stride_sm, True)[:, None] + lane_w
        code_lo2 = codes_ptr + row_words(rl1, stride_codes, True)[:, None] + lane_w
        code_hi2 = codes_ptr + row_words(rh1, stride_codes, True)[:, None] + lane_w
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
    x_row2, x_row3 = x_row0, x_row1  # WIDE: x rows 16..31
    if WIDE:
        x_row2 = x64 + tl.minimum(pid_m * BLOCK_M + 16 + g, M - 1)[:, None] * (stride_xm // 4) + lane_w
        x_row3 = x64 + tl.minimum(pid_m * BLOCK_M + 24 + g, M - 1)[:, None] * (stride_xm // 4) + lane_w

    if GATED:
        vl0, vh0, vl1, vh1 = ok0, ok0, ok1, ok1
    else:
        vl0, vh0, vl1, vh1 = lo0 < N, hi0 < N, lo1 < N, hi1 < N

    w_begin = pid_k * words_per_split
    w_end = tl.minimum(w_begin + words_per_split, n_words)
    full_end = w_begin + (w_end - w_begin) // BLOCK_W * BLOCK_W
    zero = tl.zeros((T,), dtype=tl.float32)
    d0, d1, d2, d3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    f0, f1, f2, f3, h0, h1, h2, h3 = zero, zero, zero, zero, zero, zero, zero, zero
    esl, ecl, esh, ech = rl0, rl0, rl0, rl0  # EARLY: rows rl0 and rh0's escapes in the table (``_esc_rows``)
    if EARLY:  # 4 registers through the loop, so the escapes' loads after it need no round trip for them
        tl.static_assert(TILES == 1, "EARLY: one m-tile a warp")
        esl, ecl, esh, ech = _esc_rows(esc_row_ptr, rl0, rh0, vl0, vh0)
    for start in range(w_begin, full_end, BLOCK_W):
        for u in tl.static_range(BLOCK_W // 16):
            w, ww = _group_at(start, u, BLOCK_W, TILED)
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _group(
                d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww, w, w_end, lane_w,
                x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
                TILES, NT, False, ASM, x_row2, x_row3, WIDE)
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
                    TILES, NT, True, ASM, x_row2, x_row3, WIDE)

    _stamp(trace_ptr, 1, d0, t, TRACE)
    ents = _early_entries(esc_idx_ptr, esc_val_ptr, esl, ecl, esh, ech, K) if EARLY else 0
    mb = pid_m * BLOCK_M + 2 * q
    m0, m1, m2, m3 = mb, mb + 1, mb + 8, mb + 9  # x rows of d0 / d2, d1 / d3, e0 / e2, e1 / e3
    n0, n1, n2, n3 = m0 + 16, m1 + 16, m2 + 16, m3 + 16  # WIDE: those of f and h
    w0, w1, w2, w3, w4, w5, w6, w7 = zero, zero, zero, zero, zero, zero, zero, zero  # EARLY: the escapes'
    v0, v1, v2, v3, v4, v5, v6, v7 = zero, zero, zero, zero, zero, zero, zero, zero  # Σ x · w, m-tiles 0 and 1
    if SPLIT_K > 1:  # the serial split-K semaphore: the last program sums the partials in split order
        pk = part_ptr + pid_k * M * N
        _part_store(pk, d0, d1, d2, d3, e0, e1, e2, e3, m0, m1, m2, m3, lo0, hi0, vl0, vh0, M, N, NT)
        if WIDE:
            _part_store(pk, f0, f1, f2, f3, h0, h1, h2, h3, n0, n1, n2, n3, lo0, hi0, vl0, vh0, M, N, NT)
        if TILES == 2:
            _part_store(pk, f0, f1, f2, f3, h0, h1, h2, h3, m0, m1, m2, m3, lo1, hi1, vl1, vh1, M, N, NT)
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        _stamp(trace_ptr, 2, t * 0 + last.to(tl.int32), t, TRACE)
        if last:  # the sum's loads in the last program only (masked in the others, they cost every
            # program the instructions, and at 16 splits their registers)
            d0, d1, d2, d3, e0, e1, e2, e3 = _part_sum(part_ptr, last, m0, m1, m2, m3, lo0, hi0, vl0, vh0, M, N,
                                                       SPLIT_K, NT)
            if WIDE:
                f0, f1, f2, f3, h0, h1, h2, h3 = _part_sum(part_ptr, last, n0, n1, n2, n3, lo0, hi0, vl0, vh0,
                                                           M, N, SPLIT_K, NT)
            if TILES == 2:
                f0, f1, f2, f3, h0, h1, h2, h3 = _part_sum(part_ptr, last, m0, m1, m2, m3, lo1, hi1, vl1, vh1,
                                                           M, N, SPLIT_K, NT)
            _stamp(trace_ptr, 3, d0, t, TRACE)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA graph replays)
    else:
        last = pid_k == 0
    if last:
        i0, i1, i2, i3 = d0, d0, d0, d0  # (unused without HAND_IN)
        if HAND_IN:  # each lane's x rows' inv, in the sums' layout
            i0, i1, i2, i3 = _lane_invs(parts_ptr, m0, m1, m2, m3, M, n_parts, inv_k, eps, WARPS, BLOCK_P, NT)
        WALKED: tl.constexpr = EARLY
        if EARLY:  # the rows' first escapes in registers since the loop: their x gathers go out with the
            # partials' loads; the walk's sums bit for bit, the spurious terms taken back here
            xr0, xr1, xr2, xr3 = _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm)
            w0, w1, w2, w3, w4, w5, w6, w7, s0, s1, s2, s3, s4, s5, s6, s7 = _early_walk(
                ents, esl, ecl, esh, ech, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, ESC_UNROLL)
            d0, d1, d2, d3, e0, e1, e2, e3 = d0 - s0, d1 - s1, d2 - s2, d3 - s3, e0 - s4, e1 - s5, e2 - s6, e3 - s7
        sl0, cl0, sh0, ch0 = rl0, rl0, rl0, rl0  # (unused where WALKED)
        if not WALKED:
            sl0, cl0, sh0, ch0 = _esc_rows(esc_row_ptr, rl0, rh0, vl0, vh0)
        sl1, cl1, sh1, ch1 = sl0, cl0, sh0, ch0
        if TILES == 2 and not WALKED:
            sl1, cl1, sh1, ch1 = _esc_rows(esc_row_ptr, rl1, rh1, vl1, vh1)
        y0, y1, y2, y3, y4, y5, y6, y7 = _finish(
            d0, d1, d2, d3, e0, e1, e2, e3, m0, m1, m2, m3, rl0, rh0, vl0, vh0, i0, i1, i2, i3, sl0, cl0, sh0, ch0,
            x_ptr, esc_idx_ptr, esc_val_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale, hw_ptr, xg_ptr, stride_xg,
            GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED,
            w0, w1, w2, w3, w4, w5, w6, w7)
        z0, z1, z2, z3, z4, z5, z6, z7 = y0, y1, y2, y3, y4, y5, y6, y7
        if WIDE:  # x rows 16..31 (f, h) at the same W rows: their invs, early escapes' x gathers and epilogue
            j0, j1, j2, j3 = i0, i1, i2, i3
            if HAND_IN:
                j0, j1, j2, j3 = _lane_invs(parts_ptr, n0, n1, n2, n3, M, n_parts, inv_k, eps, WARPS, BLOCK_P, NT)
            wz0, wz1, wz2, wz3, wz4, wz5, wz6, wz7 = w0, w1, w2, w3, w4, w5, w6, w7
            if EARLY:
                xq0, xq1, xq2, xq3 = _x_rows(x_ptr, n0, n1, n2, n3, M, stride_xm)
                wz0, wz1, wz2, wz3, wz4, wz5, wz6, wz7, sz0, sz1, sz2, sz3, sz4, sz5, sz6, sz7 = _early_walk(
                    ents, esl, ecl, esh, ech, xq0, xq1, xq2, xq3, esc_idx_ptr, esc_val_ptr, K, NT, ESC_UNROLL)
                f0, f1, f2, f3, h0, h1, h2, h3 = f0 - sz0, f1 - sz1, f2 - sz2, f3 - sz3, h0 - sz4, h1 - sz5, h2 - sz6, h3 - sz7
            z0, z1, z2, z3, z4, z5, z6, z7 = _finish(
                f0, f1, f2, f3, h0, h1, h2, h3, n0, n1, n2, n3, rl0, rh0, vl0, vh0, j0, j1, j2, j3, sl0, cl0, sh0, ch0,
                x_ptr, esc_idx_ptr, esc_val_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale, hw_ptr, xg_ptr,
                stride_xg, GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED,
                wz0, wz1, wz2, wz3, wz4, wz5, wz6, wz7)
        if TILES == 2:
            z0, z1, z2, z3, z4, z5, z6, z7 = _finish(
                f0, f1, f2, f3, h0, h1, h2, h3, m0, m1, m2, m3, rl1, rh1, vl1, vh1, i0, i1, i2, i3, sl1, cl1, sh1, ch1,
                x_ptr, esc_idx_ptr, esc_val_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale, hw_ptr, xg_ptr,
                stride_xg, GATED, RESIDUAL, HAND_IN, HAND_OUT, ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED,
                v0, v1, v2, v3, v4, v5, v6, v7)
        if HAND_OUT and WIDE:  # each half's rows their own parts
            _parts_out(y0, y1, y2, y3, y4, y5, y6, y7, y0, y1, y2, y3, y4, y5, y6, y7, m0, m1, m2, m3,
                       parts_ptr, pid_n, M, WARPS, 1, NT)
            _parts_out(z0, z1, z2, z3, z4, z5, z6, z7, z0, z1, z2, z3, z4, z5, z6, z7, n0, n1, n2, n3,
                       parts_ptr, pid_n, M, WARPS, 1, NT)
        elif HAND_OUT:
            _parts_out(y0, y1, y2, y3, y4, y5, y6, y7, z0, z1, z2, z3, z4, z5, z6, z7, m0, m1, m2, m3,
                       parts_ptr, pid_n, M, WARPS, TILES, NT)
        _stamp(trace_ptr, 4, y0 + z7, t, TRACE)


def hmma_applies(x: torch.Tensor, k: int, base: int) -> bool:
    """Whether an hmma config runs this kernel: 1..MAX_M rows of bf16 x, and ``words_and_scales``."""
    return x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= MAX_M and words_and_scales(k, base)


def hmma_rows(m: int, tiles: int = 1) -> int:
    """Rows of x a program of M: 8 (one n-tile) where M <= 8; past 16 rows 32 where each warp holds
    one m-tile (`tiles` 1: every word decoded once for 4 n-tiles), else 16.

    At most 8 rows one n-tile halves the x loads and MMAs of two whose second re-reads the last row
    (H200 verify(4) 4.877 ms against 5.092, verify(8) 4.876 against 5.143: step_ab_h200_verify{4,8}.json);
    32-row programs past 16 rows against blocks of 16 (H100 verify(32) 6.333 ms against 6.557:
    step_ab_h100_verify32-wide.json)."""
    if m > MAX_ROWS and tiles == 1:
        return 2 * MAX_ROWS
    return 8 if m <= 8 else MAX_ROWS


def launch_hmma(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, gated: bool = False,
                residual: bool = False, hand_in=None, hand_out=None, trace: torch.Tensor | None = None,
                launch: Launch | None = None) -> None:
    """y = x · Wᵀ by ``_u12_hmma_kernel`` (``hmma_applies`` holds); grid (M blocks, N blocks, splits):
    the M blocks of a W block and split neighbours, so they run together and W's bytes come from DRAM
    once. With fused.py's epilogue: gated (t is [gate; up], y [M, N / 2] is silu(gate) · up),
    residual (y is the residual, added into in place), hand_in / hand_out (a ``NormHandoff``
    consumed, or produced: its xg and parts, one a warp, allocated here). trace: an int64
    [programs, TRACE_SLOTS] buffer for the phase stamps (``TRACE_SLOTS``; a CUDA GPU only)."""
    m, k = x.shape
    n = t.shape[0]
    n_words = k // 4
    x = aligned_rows(x, True)
    one_tile = cfg.rows_a_warp() == 16
    rows = hmma_rows(m, 1 if one_tile else 2)
    grid, words_per_split, part, counters = split_k_plan(t, cfg, m, n_words, rows)
    native = on_native(x)  # the interpreter runs no PTX
    sm, codes = t.sm.contiguous().view(torch.int32), t.codes.contiguous().view(torch.int16)
    epi, flags, fused = epilogue_args(x, y, native, grid[0] * cfg.num_warps, gated, residual, hand_in, hand_out)
    hw, xg, parts, n_out, inv_k, eps, n_parts, stride_xg = epi
    programs = grid[0] * grid[1] * grid[2]
    if trace is not None and (not native or trace.dtype != torch.int64 or trace.numel() < programs * TRACE_SLOTS):
        raise ValueError(f"launch_hmma: trace: expected a CUDA int64 buffer of {programs} x "
                         f"{TRACE_SLOTS} stamps, got {trace.dtype} {list(trace.shape)} on {trace.device}")
    _u12_hmma_kernel[(grid[2], grid[0], grid[1])](
        x, sm, codes, nonempty(t.esc_idx), nonempty(t.esc_val), t.esc_row_ptr, y, part, counters, hw, xg, parts,
        trace if trace is not None else part,
        m, n, k, n_words, biased_scale(t.base), words_per_split, n_out, inv_k, eps, n_parts,
        x.stride(0), n_words, n_words, y.stride(0), stride_xg,
        BLOCK_M=rows, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, WARPS=cfg.num_warps,
        SPLIT_K=grid[1], EVEN_K=n_words % cfg.block_w == 0, ASM=native,
        **cfg.launch_options(native, fp_fusion=not fused),
        **pdl_args(x.device, launch), TILED=t.layout == "tiles", **flags, TRACE=trace is not None, EARLY=one_tile,
    )
