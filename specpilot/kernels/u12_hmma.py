"""y = x · Wᵀ with W in the u12 format by warp-level tensor-core MMAs (mma.sync), for 1..64 rows ("hmma").

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
in the tensor cores. The epilogue stays in the fragments' layout, every tensor [T] with one element a
thread (``_finish``): each accumulator reads the escapes of its W row (from the row's lanes,
``LANE_GROUP`` a step, or where the weight has none from the table, ``ESC_UNROLL`` escapes a step),
takes back their spurious x · 2^-15 and adds x · w exactly, then the scale 2^(base-113); split-K by
the serial semaphore, partials summed in split order. For kernels/u12_fused_linear.py ``_finish``
runs its epilogue in the same layout: gated, an m-tile's rows g are 8 gate rows and rows g + 8 their
up rows, so a lane's elements pair up in the thread; a handed-in norm's inv is computed for the
block's 16 rows once and gathered to the elements; the residual add and the handoff's xg as
fused_linear's epilogue does; and ``_parts_out`` stores its Σ y² parts, one a warp (a lane's two
rows of each m-tile, then across the quad column's 8 lanes). The epilogue used to stack the
accumulators into one [T, 2, 2, 2] tensor: Triton's coalescing pass gave its stores another layout
and converted the sums and every index tensor to it through shared memory, 20 rounds of st.shared,
bar.sync, ld.shared, bar.sync a program (sm_90, triton 3.9, tiled M = 16 launches: o's program 1440
SASS instructions and 33 barriers, 1072 and 6 now; bench/results/tried/kernel_static_sm90_triton39_stacked_0a8d453.json
against bench/results/kernel_static_sm90_triton39.json). H100, M = 16, tiled weights, CUDA graphs: qkv 20.94 µs
against 22.04, o 16.71 / 17.63, gate_up 66.07 / 66.64, down 41.52 / 43.85, lm_head 274 / 277
(bench/results/tried/u12_hmma_flat_epilogue_h100.json). (The mma kernel's 2-D epilogue,
``_store_block``, cost about 80 registers a thread here: 168 against 90 for the loop, sm_90 ptxas.)
Tiled weights (``U12Tensor.layout`` "tiles", ``TILED``): with the row planes each load instruction
of a warp touches 8 rows (a quad's 4 lanes read 64 bytes of each, half of a 128-byte line, the
next group the other half), and Nsight Compute has the M = 16 kernel's L1 busy 79% with 70% hits
(above). A tiled weight stores each 16-row tile's 16-word groups row after row (Marlin's idea for
int4 weights, specpilot/formats/u12.py): a warp's word loads read 512 contiguous bytes, its code
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
4.637 against 4.510, 0.97x: bench/results/tried/step_ab_verify16_0bc2353_h200.json).

bf16 x only (fp32 x, K % 4 != 0 or a base past 240 run the tile kernel: ``hmma_applies``). By
default u12_linear runs it from TENSOR_CORE_ROWS (3) rows up where TUNED's 16-row config is an hmma
one (o and down); the one-n-tile kernel at 3..8 rows: see NARROW. On tiled weights up to 32 rows
(u12_linear.TILES_MAX_ROWS): past 16, 32-row programs (``WIDE``) side by side (``MAX_M``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from .fused_linear import _epilogue
from .overlap import pdl_args, pdl_enter
from .registry import KernelSpec, register
from .target import native as on_native
from .rmsnorm import _to_dtype
from .u12_linear import (
    ESC_DECODED,
    U12Config,
    _case,
    _col_words,
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
# Rows of x a launch at most: past a program's rows, blocks of them side by side, the programs of one
# W block and split neighbours in the grid (its first axis), so that they run at the same time and
# W's bytes come from DRAM once, the other blocks' reads hitting L2 (``launch_hmma``).
MAX_M = 64
# Past 16 rows, whether a program takes 32 rows of x where its warps hold one m-tile each: every word
# decoded once into the A fragment for 4 n-tiles (f and h the second 16 rows' accumulators), blocks of
# 32 side by side; off, blocks of 16 (each decoding W again). 128 registers, no spills at the layer
# shapes (TUNED_TILES' 32-row, 2-warp configs; sm_90, Triton 3.6: 0.146 loop instructions a weight
# against 0.116 at 16 rows, bench/results/kernel_static_wide_sm90_triton36.json). H100 verify(32)
# interleaved (c82ea2b, bench/results/step_ab_verify32_wide_h100.json): 6.333 ms against 6.557 with
# blocks of 16 and 7.021 with the mma kernel (u12_linear.TILES_MAX_ROWS 16, the default before);
# cuBLAS's bf16 step 6.326, bf16-linear-pdl-wait 6.251. Read at launch.
WIDE = True
# At most 8 rows of x, whether a program multiplies one n-tile (8 rows) rather than two with the
# second's 8 rows re-reading the last: half the x loads and MMAs, the same W traffic. On the H200 at
# 3353acd: verify(4) 4.877 ms against 5.092 with two n-tiles, verify(8) 4.876 against 5.143
# (bench/results/step_ab_verify{4,8}_h200.json). Read at launch (bench/step_ab.py's verify variants compare).
NARROW = True
# Escapes a step of the epilogue's table walk (``_table_walk``): their loads in flight together. H100,
# M = 16: o 16.32 µs against 16.64 one a step, down 41.26 / 41.85, the others within noise
# (bench/results/tried/u12_hmma_flat_epilogue_h100.json). 4 and 8 a step did not pay (H100, 524e331,
# bench/results/hmma_parts_h100.json: o 16.20 and 17.05 µs against 15.91, down 40.05 and 40.37 against
# 40.21, qkv 20.71 and 21.48 against 20.79; verify(16) in the fused way in PDL mode 2 5.289 and 5.385 ms
# against 5.272, bench/results/tried/step_ab_verify16_walk_524e331_h100.json): the walk's steps are not
# what the split-K shapes' tails cost (bench/hmma_parts.py; the README's #5 notes).
ESC_UNROLL = 2
# The table's escapes early (one m-tile a warp, no ESC_SPLIT or WARP_K): every program loads its rows'
# escape pointers before its loop (4 registers through it) and their first 4 escapes a row after it,
# before the split-K semaphore, so the program that sums finds them in registers and sends their x
# gathers out with the partials' loads; the walk then goes on from the 5th. The same sums bit for bit
# (tests/test_u12_hmma.py, on the H100 too). Why: bench/hmma_trace.py on the H200 (293ce94,
# bench/results/hmma_trace_h200.json) had the summing program's escape walk and epilogue at o 2.75 µs,
# qkv 2.75, down 4.25 and gate_up 2.5 of calls of 13-49 µs: two dependent round trips a step after one
# for the pointers. On an H100 (6cef207, bench/results/hmma_trace_early_h100.json) they take o 1.0,
# qkv 1.25, down 2.5; the tuned configs ran o 15.32 µs against 16.03, qkv 19.53 / 20.78, down 39.74 /
# 40.50, gate_up 64.28 / 64.71 (bench/results/hmma_parts_early_h100.json), and verify(16) 5.154 ms
# ("split-k") and 5.140 ("all") against 5.276 in the fused way in PDL mode 2
# (bench/results/tried/step_ab_verify16_esc_early_6cef207_h100.json). "split-k": split-K launches only
# (the pointers' registers cost gate_up's one-split launch a program an SM: 105 registers against 96,
# sm_90, Triton 3.6, bench/results/kernel_static_esc_early_sm90_triton36.json; no launch spills; it
# still ran faster); "all": every launch (the default); "off". Not yet
# timed on the H200. Read at launch.
ESC_EARLY = "all"
_EARLY_MODES = ("off", "split-k", "all")
# Tried: 8 escapes a row early (b5fd050, reverted). A block walks as long as its longest row, so with
# random N(0, 0.02) weights (0.6 escapes a row at K = 4096, 2.2 at down's 14336) 9 in 10 of down's
# 32-row blocks have a row past 4 and walk one or two more steps after their sum (hmma_trace: down's
# finish 2.25-2.5 µs against o's 1.0); at 8, about 1 in 70. down's finish went to 1.75 µs on an H100,
# but o ran 16.63 µs against 14.69, gate_up 65.61 / 64.46 (gate_up's one-split launch 128 registers
# against 105: 8 programs an SM against 9; sm_90, Triton 3.6), and verify(16) 5.414 ms against 5.153
# (bench/results/tried/step_ab_verify16_esc_early8_b5fd050_h100.json, tried/hmma_trace_early8_b5fd050_h100.json
# against tried/hmma_trace_b5fd050_h100.json;
# the registers: tried/kernel_static_esc_early8_b5fd050_sm90_triton36.json, bench/kernel_static.py --step-variants).
# A register double buffer (one m-tile a warp, block_w 16 or 32): each chunk's loop iteration first
# issues the next chunk's words and codes, then decodes and multiplies its own, so a warp keeps a
# chunk in flight while it computes. Tried on the row planes (462a452) it did not pay: their loads
# kept L1 79% busy. On tiles Nsight Compute has L1 at 36% and 8.2 of the 13.7 cycles between a
# warp's instructions waiting on global loads, DRAM 45% busy (o at M = 16, H100,
# bench/results/tried/linear_ncu_u12_m16_tiles_h100.txt), so more bytes in flight a warp is the
# next thing to try. At o's tile (64 rows, 32 words, 4 warps) it holds the carried words in 128
# registers without spilling, with the one-stage loop's loads and MMAs (sm_90 ptxas,
# tests/test_kernel_static.py). Bit for bit the one-stage sums (tests/test_u12_hmma.py). Slower on an
# H100 (5f739f0, bench/results/u12_hmma_knobs_h100.json: o 16.63 µs against 16.00, down 42.02 against
# 40.82; the verify(16) step 5.539 ms against 5.465, tried/step_ab_verify16_5f739f0_h100.json), so off. Read at launch.
AHEAD = False
# With AHEAD, each lane also asks L1 for the next chunk's x words (prefetch.global.L1, no registers
# held) when it issues the chunk's weights: AHEAD alone loads x with the chunk it multiplies, so the
# warp still waits an L2 round trip for x each chunk (x's rows are in L2; an SM's programs read other
# splits' columns). Slower still on an H100 (o 16.81 µs, the step 5.715 ms; the same files). Read at launch.
AHEAD_X = False
# The table's escapes walked by the splits of a split-K launch (the table, not the lanes): split s
# takes escapes s, s + SPLIT_K, ... of each of its rows, subtracts their spurious x · 2^-15 from its
# partial and stores their Σ x · w as a second partial, so the last program only sums partials
# where it used to walk every escape of its rows after the semaphore, with the other SMs idle.
# Escape-free weights ran down (K = 14336, the longest rows' walk) at M = 16 in 38.69 µs against
# 41.52 with its escapes (H100, tiles, bench/results/tried/u12_hmma_flat_epilogue_h100.json); o and
# qkv within noise. Rounds otherwise than the one walk (each split's share subtracted before the
# splits are summed): same weights, another order. On an H100 (5f739f0, the same files) slower
# on o (17.92 µs against 16.00) and down (42.39 against 40.82), qkv 20.66 against 21.16; the step 5.570 ms
# against 5.465; so off. Read at launch.
ESC_SPLIT = False
# The weight loads' cache policy (x's and the escapes' keep the default). Each weight byte is read
# once, but by default its lines are allocated in L1, where x's words, which every warp of an SM
# reads again, live too. On the H200 the loops stay short of the read bound where the split-K tails
# do not apply: gate_up at 16 rows ran 51.05 µs (bench/results/u12_hmma_knobs_w2_h200.json) against
# 41.0 for a kernel that only reads its u12 bytes (bench/results/read_bound_h200.json), 80%, and an
# ablation that made every x load hit one 512-byte run ran the layer shapes 5-9% faster
# (tried/u12_linear_hmma_x_contiguous_ablation_h200.json). "ef" (the default: ld.global.L1::evict_first,
# the weights' lines first out of L1), "cg" (L2 only: ld.global.cg) or "ca" (both caches, plain
# ld.global: the default before). On an H100 at 16 rows on tiles (2ed6199, bench/results/u12_hmma_knobs_wcache_h100.json,
# µs): gate_up 62.64 against 64.11 ("ca"), down 36.81 / 38.18, o 14.30 / 14.69 ("cg": 63.41, 38.17, 14.65);
# verify(16) interleaved 4.910 ms against 5.064 (bench/results/step_ab_verify16_wcache_h100.json); as the
# default (4f39eb1) 4.909 against 5.069 (step_ab_verify16_h100.json), and verify(32) 5.892 against 6.354
# (step_ab_verify32_wcache_h100.json).
# Triton 3.6 takes no ".cs" for a load. Not yet timed on the H200. A config's ``U12Config.w_cache``
# takes precedence. Read at launch.
W_CACHE = "ef"
W_CACHE_MODES = {"ca": 0, "cg": 1, "ef": 2}  # the kernel's W_POLICY: ld.global, ld.global.cg, ld.global.L1::evict_first
# Tried and dropped (b0165d5, reverted): each program's first chunk of words and codes (and the
# escape row pointers) loaded before its PDL wait, so that in PDL mode 2 the next GEMM's first
# chunks stream from HBM during a split-K tail and its first MMAs after the wait need only x. The
# same sums bit for bit, no faster on the H200: verify(16) in the fused way in PDL mode 2 4.217 ms
# against 4.221, with the 32-row configs 4.188 against 4.175 (bench/results/tried/step_ab_verify16_before_wait_b0165d5_h200.json);
# hmma_trace --pdl 2 had each shape's gap between calls (the grid's completion to the next wait's
# release) at 1.0-1.5 µs with it or without (tried/hmma_trace_pdl2_before_wait_b0165d5_h200.json).
# Phase stamps for bench/hmma_trace.py: with a trace buffer (``launch_hmma``'s ``trace``, int64
# [programs, TRACE_SLOTS], zeroed), thread 0 of each program stores %globaltimer at entry (after the
# PDL wait), after the main loop (its last MMA done), after the split-K semaphore, after the last
# program's sum of the partials and after its epilogue's stores are issued (slots 0-4; the last two in the
# program that sums only), and its SM's id at slot 5. Off (no buffer): the kernel has none of it.
_SLOTS = tl.constexpr(8)  # the kernel's view (a jit function reads only constexpr globals)
TRACE_SLOTS = _SLOTS.value
# WARP_K (``U12Config.warp_k``, a config's, no module switch): a program's warps share its 16 or 32
# rows and each multiplies a contiguous share of the split's words, then walks its share of the
# escapes (as ESC_SPLIT's splits do); the sums meet in shared memory after the loop (``_warp_sums``:
# one [T, 8] reduction an m-tile). The split-K shapes at M = 16 (qkv, o, down) spend their time in
# fixed costs (u12_linear_tiles_h200.json: 1.6-2.5 TB/s against gate_up's 3.4): a global split's
# partials, semaphore and serial last program are what WARP_K replaces, at the same warps in flight.
# sm_90 (bench/results/kernel_static_knobs_sm90_triton39.json and _triton36, the GPU's): on 16 rows at 2 or 4
# warps the loop is the tuned config's (o, Triton 3.9: 232-234 instructions against 232, 105-108 registers;
# 3.6: 239-241 against 238, 103-105; no spills; barriers in the kernel 17-22 against 6 on 3.9, 8-10 against 5
# on 3.6), and at 8 warps since the warps' share is declared whole chunks (tl.multiple_of below; before,
# the loads' layout split and the loop went through shared memory). Words that do not share out in
# whole chunks run the warps on rows (launch_hmma). Slower than the split-K configs it was meant to
# replace on an H100 (5f739f0, bench/results/u12_hmma_knobs_h100.json, best "wk" row against tuned: o
# 17.09 µs against 16.00, down 40.92 against 40.82, qkv 22.66 against 21.16; at 8 warps, the tuned
# warps in flight, o 20.30): TUNED_TILES takes none.
# More warps an SM do not help either. One-group chunks (block_w 16) keep the loop's loads ahead of
# its MMAs at 80 registers (at 64, 3 of qkv's after the first MMA), where two groups issue 8 after it
# (bench/results/kernel_static_knobs_sm90_triton36.json, the GPU's Triton), so 6-8 programs an SM
# where TUNED_TILES holds 4; with the tuned splits, and with twice them to fill the slots (the sum
# then spills 16-168 bytes a thread below 128 registers), every such config ran slower on an H100
# (a6a74c8, bench/results/tried/u12_hmma_knobs_occupancy_a6a74c8_h100.json: o 16.61 µs at best
# against tuned 15.94, down 42.26 / 40.26, qkv 21.91 / 20.94, gate_up 68.04 / 64.00); twice the splits at the tuned tile alone, o 19.43 and down 45.80, so a program's fixed
# costs (its first loads' latency, the partial's store, release and sum) weigh more than its loop.
# Nor does the next launch starting in the split-K tails (kernels/overlap.py's tried list).


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
def _wload(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    """tl.load(ptrs) (masked: 0 where mask is false) under the weights' cache policy POLICY
    (``W_CACHE_MODES``: 0 both caches, 1 L2 only, 2 L1 evict-first). Ints, not the modifier strings:
    Triton 3.6 does not take a str default of a constexpr parameter."""
    if POLICY == 1:
        return tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg") if MASKED else tl.load(ptrs, cache_modifier=".cg")
    elif POLICY == 2:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
        return tl.load(ptrs, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0) if MASKED else tl.load(ptrs)


@triton.jit
def _load4(ptrs, w, w_end, lane_w, MASKED: tl.constexpr, POLICY: tl.constexpr = 0):
    """The 4 words ptrs + w [T, 4] (ptrs at the lane's words lane_w; masked at words past w_end: 0) as
    4 tensors [T]; POLICY the weights' cache policy (``_wload``)."""
    return _four(_wload(ptrs + w, w + lane_w < w_end, MASKED, POLICY))


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
    POLICY: tl.constexpr = 0,
):
    """One m-tile over a group of 16 words a row (the group's word w; its weights at offset ww of
    the planes' pointers): its words loaded (POLICY: ``W_CACHE``), then ``_tile_steps``."""
    shift = ww - w  # 0 in rows; the tiled planes' offset (the masks stay x's)
    s_lo0, s_lo1, s_lo2, s_lo3 = _load4(sm_lo + shift, w, w_end, lane_w, MASKED, POLICY)
    s_hi0, s_hi1, s_hi2, s_hi3 = _load4(sm_hi + shift, w, w_end, lane_w, MASKED, POLICY)
    c_lo0, c_lo1, c_lo2, c_lo3 = _load4(code_lo + shift, w, w_end, lane_w, MASKED, POLICY)
    c_hi0, c_hi1, c_hi2, c_hi3 = _load4(code_hi + shift, w, w_end, lane_w, MASKED, POLICY)
    return _tile_steps(d0, d1, d2, d3, e0, e1, e2, e3, s_lo0, s_lo1, s_lo2, s_lo3, s_hi0, s_hi1, s_hi2, s_hi3,
                       c_lo0, c_lo1, c_lo2, c_lo3, c_hi0, c_hi1, c_hi2, c_hi3,
                       x00, x01, x02, x03, x10, x11, x12, x13, NT, ASM)


@triton.jit
def _tile_step_wide(d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, s_lo, c_lo, s_hi, c_hi,
                    x0, x1, x2, x3, ASM: tl.constexpr):
    """``_tile_step`` for 32 rows of x (``WIDE``): the word decoded once into the A fragment, then
    multiplied by the B fragments of 4 n-tiles (x0 -> d: x rows 0..7, x1 -> e: 8..15, x2 -> f:
    16..23, x3 -> h: 24..31)."""
    p02_lo, p13_lo = _pair_patterns(s_lo, c_lo.to(tl.int32), ASM)
    p02_hi, p13_hi = _pair_patterns(s_hi, c_hi.to(tl.int32), ASM)
    b0, b1 = _b_fragment(x0, ASM)
    d0, d1, d2, d3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, d0, d1, d2, d3, ASM)
    b0, b1 = _b_fragment(x1, ASM)
    e0, e1, e2, e3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, e0, e1, e2, e3, ASM)
    b0, b1 = _b_fragment(x2, ASM)
    f0, f1, f2, f3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, f0, f1, f2, f3, ASM)
    b0, b1 = _b_fragment(x3, ASM)
    h0, h1, h2, h3 = _mma(p02_lo, p02_hi, p13_lo, p13_hi, b0, b1, h0, h1, h2, h3, ASM)
    return d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3


@triton.jit
def _tile_group_wide(
    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end,
    lane_w, x_row0, x_row1, x_row2, x_row3, MASKED: tl.constexpr, ASM: tl.constexpr,
    POLICY: tl.constexpr = 0,
):
    """``_tile_group`` for 32 rows of x (``WIDE``): the group's words loaded and each decoded once for
    the 4 n-tiles."""
    shift = ww - w
    s_lo = _load4(sm_lo + shift, w, w_end, lane_w, MASKED, POLICY)
    s_hi = _load4(sm_hi + shift, w, w_end, lane_w, MASKED, POLICY)
    c_lo = _load4(code_lo + shift, w, w_end, lane_w, MASKED, POLICY)
    c_hi = _load4(code_hi + shift, w, w_end, lane_w, MASKED, POLICY)
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
    x_row2=None, x_row3=None, WIDE: tl.constexpr = False, POLICY: tl.constexpr = 0,
):
    """A 16-word group of the warp's m-tiles (accumulators d, e: tile 0; f, h: tile 1; e and h the
    second n-tile's), x's words loaded once for all. WIDE (one m-tile): f and h x rows 16..31's."""
    if WIDE:
        d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _tile_group_wide(
            d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, sm_lo, code_lo, sm_hi, code_hi, ww, w,
            w_end, lane_w, x_row0, x_row1, x_row2, x_row3, MASKED, ASM, POLICY)
    else:
        x00, x01, x02, x03, x10, x11, x12, x13 = _x_words(x_row0, x_row1, w, w_end, lane_w, NT, MASKED)
        d0, d1, d2, d3, e0, e1, e2, e3 = _tile_group(
            d0, d1, d2, d3, e0, e1, e2, e3, sm_lo, code_lo, sm_hi, code_hi, ww, w, w_end, lane_w,
            x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM, POLICY)
    if TILES == 2:
        f0, f1, f2, f3, h0, h1, h2, h3 = _tile_group(
            f0, f1, f2, f3, h0, h1, h2, h3, sm_lo2, code_lo2, sm_hi2, code_hi2, ww, w, w_end, lane_w,
            x00, x01, x02, x03, x10, x11, x12, x13, NT, MASKED, ASM, POLICY)
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
def _words_ahead(sm_lo, code_lo, sm_hi, code_hi, ww, live, POLICY: tl.constexpr = 0):
    """A group's [T, 4] words and codes of rows g and g + 8 at offset ww, loaded a chunk ahead of
    their use (``AHEAD``): zeros, and no memory access, where live [T, 4] is false."""
    return (_wload(sm_lo + ww, live, True, POLICY), _wload(code_lo + ww, live, True, POLICY),
            _wload(sm_hi + ww, live, True, POLICY), _wload(code_hi + ww, live, True, POLICY))


@triton.jit
def _prefetch_l1(ptr, live):
    """Ask L1 for the line holding each lane's ptr [T] where live [T] (int32) is nonzero; a hint,
    nothing held in registers (GPU only: the interpreter runs no PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L1 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), live], dtype=tl.int32, is_pure=False, pack=1,
    )


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


@triton.jit
def _tile_loaded(d0, d1, d2, d3, e0, e1, e2, e3, s_lo, c_lo, s_hi, c_hi, x_row0, x_row1, w, w_end, lane_w,
                 NT: tl.constexpr, ASM: tl.constexpr):
    """``_tile_steps`` on a group loaded by ``_words_ahead``, x's words loaded here."""
    x00, x01, x02, x03, x10, x11, x12, x13 = _x_words(x_row0, x_row1, w, w_end, lane_w, NT, False)
    s_lo0, s_lo1, s_lo2, s_lo3 = _four(s_lo)
    s_hi0, s_hi1, s_hi2, s_hi3 = _four(s_hi)
    c_lo0, c_lo1, c_lo2, c_lo3 = _four(c_lo)
    c_hi0, c_hi1, c_hi2, c_hi3 = _four(c_hi)
    return _tile_steps(d0, d1, d2, d3, e0, e1, e2, e3, s_lo0, s_lo1, s_lo2, s_lo3, s_hi0, s_hi1, s_hi2, s_hi3,
                       c_lo0, c_lo1, c_lo2, c_lo3, c_hi0, c_hi1, c_hi2, c_hi3,
                       x00, x01, x02, x03, x10, x11, x12, x13, NT, ASM)


# --- the epilogue: every tensor [T], one element a thread ----------------------------------------
# The accumulators d0..d3 (n-tile 0) and e0..e3 (n-tile 1) of an m-tile are [T] tensors in the 1-D
# layout the loop leaves them in; element c of a lane is (W row g for c0, c1, g + 8 for c2, c3; x row
# 2 q for c0, c2, 2 q + 1 for c1, c3; n-tile 1: x rows + 8). A [T] load or store is already in the
# layout Triton's coalescing pass wants, so nothing here converts layouts (the module docstring).


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
               NT: tl.constexpr, UNROLL: tl.constexpr, first, STRIDE: tl.constexpr):
    """The sums (e, s) carried on through escapes begin + first, begin + first + STRIDE, ... of rows rl
    and rh (``_esc_rows``), each row's in order, one walk as long as the block's longest row, UNROLL
    escapes a step (their loads in flight at once)."""
    for j0 in range(begin, tl.max(tl.maximum(cnt_l, cnt_h)), UNROLL * STRIDE):
        for jj in tl.static_range(UNROLL):  # in order: the sums as one escape a step
            j = j0 + jj * STRIDE + first
            col_l, val_l, has_l = _entry(esc_idx_ptr, esc_val_ptr, start_l, j, cnt_l, K)
            col_h, val_h, has_h = _entry(esc_idx_ptr, esc_val_ptr, start_h, j, cnt_h, K)
            e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _walk_one(
                e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, xr0, xr1, xr2, xr3,
                col_l, val_l, has_l, col_h, val_h, has_h, NT)
    return e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _table_walk(start_l, cnt_l, start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K,
                NT: tl.constexpr, UNROLL: tl.constexpr, first, STRIDE: tl.constexpr):
    """The escapes of rows rl and rh (``_esc_rows``) from the CSR table for x rows xr0..xr3
    (pointers): (Σ x · w, Σ x · 2^-15) of each of the m-tile's 8 elements, each row's escapes in
    order, one walk as long as the block's longest row, UNROLL escapes a step (their loads in
    flight at once). Escapes first, first + STRIDE, ... of each row: all of them from 0 a stride
    of 1, one share (``ESC_SPLIT``) from its index a stride of the shares (first a scalar, or [T]
    with ``WARP_K``: each warp's own)."""
    z = tl.zeros(start_l.shape, dtype=tl.float32)
    return _walk_from(z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, 0, start_l, cnt_l, start_h, cnt_h,
                      xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, UNROLL, first, STRIDE)


@triton.jit
def _early_entries(esc_idx_ptr, esc_val_ptr, start_l, cnt_l, start_h, cnt_h, K):
    """``ESC_EARLY``: the first 4 escapes of rows rl and rh, their loads in flight together: (column,
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
                      start_h, cnt_h, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, UNROLL, 0, 1)


@triton.jit
def _escaped(a, xr, row, ok, lanes_ptr, K, y_scale, LANES: tl.constexpr, LANE_GROUP: tl.constexpr, e, s):
    """One element's y from its biased sum a: the lanes' walk where LANES, else the table's (e, s)."""
    if LANES:
        s, e = _lane_walk(a, lanes_ptr, row, xr, 1, ok, K, LANES, LANE_GROUP)
    return (a - s) * y_scale + e


@triton.jit
def _walk_share(a0, a1, a2, a3, b0, b1, b2, b3, m0, m1, m2, m3, rl, rh, vl, vh, x_ptr, stride_xm, esc_row_ptr,
                esc_idx_ptr, esc_val_ptr, M, K, pid_k, SPLIT_K: tl.constexpr, NT: tl.constexpr,
                UNROLL: tl.constexpr):
    """``ESC_SPLIT``: share pid_k's part of the table's escapes of rows rl and rh (escapes pid_k,
    pid_k + SPLIT_K, ... of each row; with ``WARP_K`` pid_k is each warp's share, SPLIT_K the shares):
    the m-tile's sums a, b with the share's spurious x · 2^-15 taken back, then the share's Σ x · w
    of each element (8 [T] tensors, the partials' order)."""
    xr0, xr1, xr2, xr3 = _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm)
    sl, cl, sh, ch = _esc_rows(esc_row_ptr, rl, rh, vl, vh)
    e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _table_walk(
        sl, cl, sh, ch, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, UNROLL, pid_k, SPLIT_K)
    return (a0 - s0, a1 - s1, a2 - s2, a3 - s3, b0 - s4, b1 - s5, b2 - s6, b3 - s7,
            e0, e1, e2, e3, e4, e5, e6, e7)


@triton.jit
def _out1(g, u, m, col, ok, inv, res, hw, y_ptr, stride_ym, xg_ptr, stride_xg, M,
          GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAND_IN: tl.constexpr,
          HAND_OUT: tl.constexpr, ROUND_BF16: tl.constexpr, EXPF: tl.constexpr):
    """Store one element (gated: g and u its gate and up sums) of x row m at output column col; the
    stored value where stored, else 0. inv, res and hw: the element's handed-in inv, residual and
    handed-out norm weight (``_finish`` loads them all before the first store)."""
    mask = (m < M) & ok
    if GATED or RESIDUAL or HAND_IN:  # u12_fused_linear's epilogue
        DTYPE: tl.constexpr = y_ptr.dtype.element_ty
        if HAND_IN:  # rmsnorm's inv of row m (``_lane_invs``), factored out of the sums (x = dtype(stream · weight))
            g = g * inv
            u = u * inv
        y = _epilogue(g, u, y_ptr + m * stride_ym + col, mask, DTYPE, GATED, RESIDUAL, ROUND_BF16, EXPF,
                      res=res, RES_LOADED=True)
        if HAND_OUT:  # xg = dtype(y · the norm's weight)
            tl.store(xg_ptr + m * stride_xg + col, _to_dtype(y * hw, DTYPE, ROUND_BF16).to(DTYPE), mask=mask)
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
    x_ptr, esc_idx_ptr, esc_val_ptr, lanes_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale,
    LANES: tl.constexpr, LANE_GROUP: tl.constexpr, hw_ptr, xg_ptr, stride_xg,
    GATED: tl.constexpr, RESIDUAL: tl.constexpr, HAND_IN: tl.constexpr, HAND_OUT: tl.constexpr,
    ROUND_BF16: tl.constexpr, EXPF: tl.constexpr, NT: tl.constexpr, ESC_UNROLL: tl.constexpr,
    WALKED: tl.constexpr, w0, w1, w2, w3, w4, w5, w6, w7,
):
    """y from one m-tile's biased sums a (n-tile 0) and b (n-tile 1), [T] tensors: per element, the
    escapes of its W row take back their spurious x · 2^-15 and add x · w exactly, then the scale,
    then kernels/u12_fused_linear.py's epilogue where asked (``_out1``). Rows rl and rh are clamped,
    vl and vh where they are the block's; gated, rl is the output column's gate row and rh its up
    row; sl, cl, sh, ch their escapes' ``_esc_rows`` (unused where WALKED). WALKED (``ESC_SPLIT``):
    a and b are the splits' sums with their spurious terms taken back, w0..w7 their escapes' summed
    Σ x · w. Returns the stored values of x rows m0..m3 at rows rl (and, not gated, rh): 0 where not
    stored."""
    xr0, xr1, xr2, xr3 = _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm)
    z = tl.zeros(rl.shape, dtype=tl.float32)
    e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z
    if WALKED:  # ESC_SPLIT: the splits took back their spurious terms; the escapes' Σ x · w handed in
        e0, e1, e2, e3, e4, e5, e6, e7 = w0, w1, w2, w3, w4, w5, w6, w7
    elif not LANES:
        e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7 = _table_walk(
            sl, cl, sh, ch, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, ESC_UNROLL, 0, 1)
    a0 = _escaped(a0, xr0, rl, vl, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e0, s0)
    a1 = _escaped(a1, xr1, rl, vl, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e1, s1)
    a2 = _escaped(a2, xr0, rh, vh, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e2, s2)
    a3 = _escaped(a3, xr1, rh, vh, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e3, s3)
    if NT == 2:
        b0 = _escaped(b0, xr2, rl, vl, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e4, s4)
        b1 = _escaped(b1, xr3, rl, vl, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e5, s5)
        b2 = _escaped(b2, xr2, rh, vh, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e6, s6)
        b3 = _escaped(b3, xr3, rh, vh, lanes_ptr, K, y_scale, LANES, LANE_GROUP, e7, s7)
    # gated: an element's gate sum with row g + 8's up sum at output column rl (rows g + 8 store
    # nothing of their own); else every element its own sum at its own row
    u0, u1, u4, u5 = a0, a1, b0, b1
    if GATED:
        u0, u1, u4, u5 = a2, a3, b2, b3
    # every load of the epilogue before its first store (a load after a store that may alias waits
    # for it: 8 residual loads one after another cost o 1.5 µs a call, bench/results/tried/layer16_bff8915_h100.json)
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
    reduction. The block's [BLOCK_M] inv reduced across the program and then gathered by every sum
    took 16 barriers against 8 on qkv's consumer (bench/results/tried/kernel_static_fused_tiles_sm90_triton36_bff8915.json)
    and 4.4 µs a call (bench/results/tried/layer16_bff8915_h100.json)."""
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
def _warp_sums(a0, a1, a2, a3, b0, b1, b2, b3, WARPS: tl.constexpr):
    """``WARP_K``: an m-tile's 8 accumulators [T], each lane's summed over the warps, every warp holding
    the sums: one [T, 8] reduction through shared memory (8 reductions apart each took barriers of their own)."""
    T: tl.constexpr = 32 * WARPS
    v = tl.join(tl.join(tl.join(a0, a1), tl.join(a2, a3)), tl.join(tl.join(b0, b1), tl.join(b2, b3)))
    s = tl.sum(tl.reshape(v, (WARPS, 32, 8)), axis=0)  # [lane, 8]
    p, q = tl.split(tl.reshape(tl.broadcast_to(s[None], (WARPS, 32, 8)), (T, 2, 2, 2)))
    p0, p1 = tl.split(p)
    q0, q1 = tl.split(q)
    a0, a1 = tl.split(p0)
    a2, a3 = tl.split(p1)
    b0, b1 = tl.split(q0)
    b2, b3 = tl.split(q1)
    return a0, a1, a2, a3, b0, b1, b2, b3


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
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, part_ptr, count_ptr,
    hw_ptr, xg_ptr, parts_ptr,  # the epilogue's norm handoff (u12_fused_linear's NormHandoff); else unused
    trace_ptr,  # TRACE: int64 [programs, TRACE_SLOTS] phase stamps; else unused
    M, N, K, n_words, y_scale, words_per_split, n_out, inv_k, eps, n_parts,
    stride_xm, stride_sm, stride_codes, stride_ym, stride_xg,
    BLOCK_M: tl.constexpr,  # rows of x a program: 8 (one n-tile of mma.m16n8k16), 16 (two) or 32 (four: ``WIDE``)
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
    ESC_UNROLL: tl.constexpr = 2,  # escapes a step of the table's walk (``_table_walk``)
    AHEAD: tl.constexpr = False,  # the next chunk's words loaded before this one's MMAs (one m-tile, BLOCK_W <= 32)
    AHEAD_X: tl.constexpr = False,  # AHEAD: the next chunk's x words prefetched into L1 too (GPU only)
    ESC_SPLIT: tl.constexpr = False,  # SPLIT_K > 1 or WARP_K, the table: each split (warp) walks its share of the escapes
    WARP_K: tl.constexpr = False,  # the warps share the program's rows and split its words (``WARP_K``)
    TRACE: tl.constexpr = False,  # phase stamps into trace_ptr (``TRACE_SLOTS``; GPU only)
    EARLY: tl.constexpr = False,  # the table's escapes: pointers before the loop, first 4 a row after it (``ESC_EARLY``)
    W_POLICY: tl.constexpr = 0,  # the weight loads' cache policy (``W_CACHE_MODES``: 0 L1 and L2, 1 L2 only, 2 L1 evict-first)
):
    pdl_enter(PDL)
    TILES: tl.constexpr = BLOCK_N // 16 if WARP_K else BLOCK_N // (16 * WARPS)  # m-tiles a warp: 1 or 2
    WIDE: tl.constexpr = BLOCK_M == 32  # x rows 16..31 in f and h, each word decoded once for all 32 (``WIDE``)
    NT: tl.constexpr = 2 if WIDE else BLOCK_M // 8  # n-tiles (8 rows of x each) of a 16-row half: 1 or 2
    tl.static_assert(not WIDE or (TILES == 1 and not WARP_K and not ESC_SPLIT and not AHEAD),
                     "WIDE: one m-tile a warp, no WARP_K, ESC_SPLIT or AHEAD")
    T: tl.constexpr = 32 * WARPS
    pid_m = tl.program_id(0)  # the M blocks of a W block and split side by side (``MAX_M``)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    t = tl.arange(0, T)
    _stamp(trace_ptr, 0, t, t, TRACE)
    _stamp_sm(trace_ptr, t, TRACE)
    lane = t % 32
    g = lane // 4
    q = lane % 4
    warp_rows = 0 if WARP_K else t // 32  # WARP_K: every warp on the program's rows
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
    if WARP_K:  # warp i takes words i · span .. of the split (launch_hmma: whole chunks each), from its pointers
        tl.static_assert(EVEN_K, "WARP_K: every warp's share whole chunks")
        # whole chunks (launch_hmma), said so: Triton's alignment analysis divides words_per_split's
        # divisibility (16) by WARPS, and at 8 warps the 2 words left split the loop's [T, 4] loads in two
        span = tl.multiple_of(words_per_split // WARPS, BLOCK_W)
        koff = (t // 32) * span  # [T]: the warp's first word after the split's
        kw = _col_words(koff, TILED)[:, None]
        sm_lo, sm_hi, code_lo, code_hi = sm_lo + kw, sm_hi + kw, code_lo + kw, code_hi + kw
        sm_lo2, sm_hi2, code_lo2, code_hi2 = sm_lo2 + kw, sm_hi2 + kw, code_lo2 + kw, code_hi2 + kw
        x_row0, x_row1 = x_row0 + koff[:, None], x_row1 + koff[:, None]
        full_end = w_begin + span
        w_end = full_end
    zero = tl.zeros((T,), dtype=tl.float32)
    d0, d1, d2, d3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    f0, f1, f2, f3, h0, h1, h2, h3 = zero, zero, zero, zero, zero, zero, zero, zero
    esl, ecl, esh, ech = rl0, rl0, rl0, rl0  # EARLY: rows rl0 and rh0's escapes in the table (``_esc_rows``)
    if EARLY:  # 4 registers through the loop, so the escapes' loads after it need no round trip for them
        tl.static_assert(TILES == 1 and not LANES and not ESC_SPLIT and not WARP_K, "EARLY: one m-tile a warp, the table")
        esl, ecl, esh, ech = _esc_rows(esc_row_ptr, rl0, rh0, vl0, vh0)
    if AHEAD:  # a register double buffer: chunk c + 1's words in flight while chunk c decodes and multiplies
        tl.static_assert(TILES == 1 and BLOCK_W <= 32, "AHEAD: one m-tile a warp, at most 2 groups a chunk")
        live = (lane_w * 0 + w_begin) < full_end  # [T, 4] (a scalar mask does not run in the interpreter)
        w, ww = _group_at(w_begin, 0, BLOCK_W, TILED)
        a0, a1, a2, a3 = _words_ahead(sm_lo, code_lo, sm_hi, code_hi, ww, live, W_POLICY)
        b0, b1, b2, b3 = a0, a1, a2, a3
        if BLOCK_W == 32:
            w, ww = _group_at(w_begin, 1, BLOCK_W, TILED)
            b0, b1, b2, b3 = _words_ahead(sm_lo, code_lo, sm_hi, code_hi, ww, live, W_POLICY)
        lane_x = 4 * q if TILED else (BLOCK_W // 4) * q  # a lane's first x word of a group (lane_w's column 0)
        xb0 = x64 + tl.minimum(pid_m * BLOCK_M + g, M - 1) * (stride_xm // 4) + lane_x
        xb1 = x64 + tl.minimum(pid_m * BLOCK_M + 8 + g, M - 1) * (stride_xm // 4) + lane_x
        if WARP_K:
            xb0, xb1 = xb0 + koff, xb1 + koff
        for start in range(w_begin, full_end, BLOCK_W):
            nxt = start + BLOCK_W
            live = (lane_w * 0 + nxt) < full_end
            w, ww = _group_at(nxt, 0, BLOCK_W, TILED)
            na0, na1, na2, na3 = _words_ahead(sm_lo, code_lo, sm_hi, code_hi, ww, live, W_POLICY)
            nb0, nb1, nb2, nb3 = b0, b1, b2, b3
            if BLOCK_W == 32:
                w, ww = _group_at(nxt, 1, BLOCK_W, TILED)
                nb0, nb1, nb2, nb3 = _words_ahead(sm_lo, code_lo, sm_hi, code_hi, ww, live, W_POLICY)
            if AHEAD_X and ASM:  # the next chunk's x lines into L1, a group at a time
                x_live = ((lane_x * 0 + nxt) < full_end).to(tl.int32)
                for u in tl.static_range(BLOCK_W // 16):
                    w, ww = _group_at(nxt, u, BLOCK_W, TILED)
                    _prefetch_l1(xb0 + w, x_live)
                    if NT == 2:
                        _prefetch_l1(xb1 + w, x_live)
            w, ww = _group_at(start, 0, BLOCK_W, TILED)
            d0, d1, d2, d3, e0, e1, e2, e3 = _tile_loaded(d0, d1, d2, d3, e0, e1, e2, e3, a0, a1, a2, a3,
                                                          x_row0, x_row1, w, w_end, lane_w, NT, ASM)
            if BLOCK_W == 32:
                w, ww = _group_at(start, 1, BLOCK_W, TILED)
                d0, d1, d2, d3, e0, e1, e2, e3 = _tile_loaded(d0, d1, d2, d3, e0, e1, e2, e3, b0, b1, b2, b3,
                                                              x_row0, x_row1, w, w_end, lane_w, NT, ASM)
            a0, a1, a2, a3 = na0, na1, na2, na3
            b0, b1, b2, b3 = nb0, nb1, nb2, nb3
    else:
        for start in range(w_begin, full_end, BLOCK_W):
            for u in tl.static_range(BLOCK_W // 16):
                w, ww = _group_at(start, u, BLOCK_W, TILED)
                d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3 = _group(
                    d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3, h0, h1, h2, h3, ww, w, w_end, lane_w,
                    x_row0, x_row1, sm_lo, code_lo, sm_hi, code_hi, sm_lo2, code_lo2, sm_hi2, code_hi2,
                    TILES, NT, False, ASM, x_row2, x_row3, WIDE, W_POLICY)
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
                    TILES, NT, True, ASM, x_row2, x_row3, WIDE, W_POLICY)

    _stamp(trace_ptr, 1, d0, t, TRACE)
    ents = _early_entries(esc_idx_ptr, esc_val_ptr, esl, ecl, esh, ech, K) if EARLY else 0
    mb = pid_m * BLOCK_M + 2 * q
    m0, m1, m2, m3 = mb, mb + 1, mb + 8, mb + 9  # x rows of d0 / d2, d1 / d3, e0 / e2, e1 / e3
    n0, n1, n2, n3 = m0 + 16, m1 + 16, m2 + 16, m3 + 16  # WIDE: those of f and h
    w0, w1, w2, w3, w4, w5, w6, w7 = zero, zero, zero, zero, zero, zero, zero, zero  # ESC_SPLIT: the escapes'
    v0, v1, v2, v3, v4, v5, v6, v7 = zero, zero, zero, zero, zero, zero, zero, zero  # Σ x · w, m-tiles 0 and 1
    if ESC_SPLIT:  # this split's share of the escapes (WARP_K: each warp's share of its split's)
        tl.static_assert(LANES == 0, "ESC_SPLIT walks the table")
        share = pid_k
        WAYS: tl.constexpr = SPLIT_K * WARPS if WARP_K else SPLIT_K
        if WARP_K:
            share = pid_k * WARPS + t // 32
        d0, d1, d2, d3, e0, e1, e2, e3, w0, w1, w2, w3, w4, w5, w6, w7 = _walk_share(
            d0, d1, d2, d3, e0, e1, e2, e3, m0, m1, m2, m3, rl0, rh0, vl0, vh0, x_ptr, stride_xm, esc_row_ptr,
            esc_idx_ptr, esc_val_ptr, M, K, share, WAYS, NT, ESC_UNROLL)
        if TILES == 2:
            f0, f1, f2, f3, h0, h1, h2, h3, v0, v1, v2, v3, v4, v5, v6, v7 = _walk_share(
                f0, f1, f2, f3, h0, h1, h2, h3, m0, m1, m2, m3, rl1, rh1, vl1, vh1, x_ptr, stride_xm,
                esc_row_ptr, esc_idx_ptr, esc_val_ptr, M, K, share, WAYS, NT, ESC_UNROLL)
    if WARP_K:  # the warps' sums, held by every warp; warp 0 stores them (the others' rows masked)
        d0, d1, d2, d3, e0, e1, e2, e3 = _warp_sums(d0, d1, d2, d3, e0, e1, e2, e3, WARPS)
        if ESC_SPLIT:
            w0, w1, w2, w3, w4, w5, w6, w7 = _warp_sums(w0, w1, w2, w3, w4, w5, w6, w7, WARPS)
        if TILES == 2:
            f0, f1, f2, f3, h0, h1, h2, h3 = _warp_sums(f0, f1, f2, f3, h0, h1, h2, h3, WARPS)
            if ESC_SPLIT:
                v0, v1, v2, v3, v4, v5, v6, v7 = _warp_sums(v0, v1, v2, v3, v4, v5, v6, v7, WARPS)
        first = t < 32
        vl0, vh0, vl1, vh1 = vl0 & first, vh0 & first, vl1 & first, vh1 & first
    if SPLIT_K > 1:  # the serial split-K semaphore: the last program sums the partials in split order
        pk = part_ptr + pid_k * M * N
        if ESC_SPLIT:  # the share's Σ x · w a second partial, SPLIT_K slots on
            pe = pk + SPLIT_K * M * N
            _part_store(pe, w0, w1, w2, w3, w4, w5, w6, w7, m0, m1, m2, m3, lo0, hi0, vl0, vh0, M, N, NT)
            if TILES == 2:
                _part_store(pe, v0, v1, v2, v3, v4, v5, v6, v7, m0, m1, m2, m3, lo1, hi1, vl1, vh1, M, N, NT)
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
            if ESC_SPLIT:
                pe = part_ptr + SPLIT_K * M * N
                w0, w1, w2, w3, w4, w5, w6, w7 = _part_sum(pe, last, m0, m1, m2, m3, lo0, hi0, vl0, vh0, M, N,
                                                           SPLIT_K, NT)
                if TILES == 2:
                    v0, v1, v2, v3, v4, v5, v6, v7 = _part_sum(pe, last, m0, m1, m2, m3, lo1, hi1, vl1, vh1,
                                                               M, N, SPLIT_K, NT)
            _stamp(trace_ptr, 3, d0, t, TRACE)
            tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA graph replays)
    else:
        last = pid_k == 0
    if last:
        i0, i1, i2, i3 = d0, d0, d0, d0  # (unused without HAND_IN)
        if HAND_IN:  # each lane's x rows' inv, in the sums' layout
            i0, i1, i2, i3 = _lane_invs(parts_ptr, m0, m1, m2, m3, M, n_parts, inv_k, eps, WARPS, BLOCK_P, NT)
        WALKED: tl.constexpr = ESC_SPLIT or EARLY
        if EARLY:  # the rows' first escapes in registers since the loop: their x gathers go out with the
            # partials' loads; the walk's sums bit for bit, the spurious terms taken back here (as ESC_SPLIT's)
            xr0, xr1, xr2, xr3 = _x_rows(x_ptr, m0, m1, m2, m3, M, stride_xm)
            w0, w1, w2, w3, w4, w5, w6, w7, s0, s1, s2, s3, s4, s5, s6, s7 = _early_walk(
                ents, esl, ecl, esh, ech, xr0, xr1, xr2, xr3, esc_idx_ptr, esc_val_ptr, K, NT, ESC_UNROLL)
            d0, d1, d2, d3, e0, e1, e2, e3 = d0 - s0, d1 - s1, d2 - s2, d3 - s3, e0 - s4, e1 - s5, e2 - s6, e3 - s7
        sl0, cl0, sh0, ch0 = rl0, rl0, rl0, rl0  # (unused where WALKED or LANES)
        if not WALKED and not LANES:
            sl0, cl0, sh0, ch0 = _esc_rows(esc_row_ptr, rl0, rh0, vl0, vh0)
        sl1, cl1, sh1, ch1 = sl0, cl0, sh0, ch0
        if TILES == 2 and not WALKED and not LANES:
            sl1, cl1, sh1, ch1 = _esc_rows(esc_row_ptr, rl1, rh1, vl1, vh1)
        y0, y1, y2, y3, y4, y5, y6, y7 = _finish(
            d0, d1, d2, d3, e0, e1, e2, e3, m0, m1, m2, m3, rl0, rh0, vl0, vh0, i0, i1, i2, i3, sl0, cl0, sh0, ch0,
            x_ptr, esc_idx_ptr, esc_val_ptr, lanes_ptr, y_ptr, M, K, stride_xm, stride_ym, y_scale,
            LANES, LANE_GROUP, hw_ptr, xg_ptr, stride_xg, GATED, RESIDUAL, HAND_IN, HAND_OUT,
            ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED, w0, w1, w2, w3, w4, w5, w6, w7)
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
                x_ptr, esc_idx_ptr, esc_val_ptr, lanes_ptr, y_ptr, M, K, stride_xm, stride_ym,
                y_scale, LANES, LANE_GROUP, hw_ptr, xg_ptr, stride_xg, GATED, RESIDUAL, HAND_IN,
                HAND_OUT, ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED, wz0, wz1, wz2, wz3, wz4, wz5, wz6, wz7)
        if TILES == 2:
            z0, z1, z2, z3, z4, z5, z6, z7 = _finish(
                f0, f1, f2, f3, h0, h1, h2, h3, m0, m1, m2, m3, rl1, rh1, vl1, vh1, i0, i1, i2, i3, sl1, cl1, sh1, ch1,
                x_ptr, esc_idx_ptr, esc_val_ptr, lanes_ptr, y_ptr, M, K, stride_xm, stride_ym,
                y_scale, LANES, LANE_GROUP, hw_ptr, xg_ptr, stride_xg, GATED, RESIDUAL, HAND_IN,
                HAND_OUT, ROUND_BF16, EXPF, NT, ESC_UNROLL, WALKED, v0, v1, v2, v3, v4, v5, v6, v7)
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
    """Rows of x a program of M: 8 (one n-tile) where NARROW and M <= 8, 32 (``WIDE``) past 16 where the
    warps hold one m-tile (tiles 1), else 16."""
    if m > MAX_ROWS and WIDE and tiles == 1:
        return 2 * MAX_ROWS
    return 8 if NARROW and m <= 8 else MAX_ROWS


def launch_hmma(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config, gated: bool = False,
                residual: bool = False, hand_in=None, hand_out=None, trace: torch.Tensor | None = None) -> None:
    """y = x · Wᵀ by ``_u12_hmma_kernel`` (``hmma_applies`` holds); grid (M blocks, N blocks, splits).
    With kernels/u12_fused_linear.py's epilogue: gated (t is [gate; up], y [M, N / 2] is
    silu(gate) · up), residual (y is the residual, added into in place), hand_in / hand_out (a
    ``NormHandoff`` consumed, or produced: its xg and parts, one a warp, allocated here). trace: an
    int64 [programs, TRACE_SLOTS] buffer for the phase stamps (``TRACE_SLOTS``; a CUDA GPU only)."""
    m, k = x.shape
    n = t.shape[0]
    n_words = k // 4
    x = aligned_rows(x, True)
    lanes, n_lanes = lanes_args(t, block=True)
    if cfg.warp_k and n_words % (cfg.split_k * cfg.num_warps * cfg.block_w):  # shares of whole chunks only:
        cfg = dataclasses.replace(cfg, warp_k=False, block_n=cfg.block_n * cfg.num_warps)  # the warps on rows
    ahead = cfg.ahead or (AHEAD and cfg.rows_a_warp() == 16 and cfg.block_w <= 32)
    # the escapes walked in shares: by the splits where asked, and by WARP_K's warps (else idle in the walk)
    esc_split = (cfg.esc_split or ESC_SPLIT or cfg.warp_k) and not n_lanes and t.esc_idx.numel() > 0
    chunk = cfg.block_w * cfg.num_warps if cfg.warp_k else cfg.block_w  # a split's words a multiple of it
    one_tile = cfg.rows_a_warp() == 16 and not cfg.warp_k and not esc_split and not ahead  # WIDE's
    block_m = hmma_rows(m, 1 if one_tile else 2)
    grid, words_per_split, part, counters = _split_k_plan(t, cfg, m, n_words, block_m, 1 + esc_split, chunk)
    native = on_native(x)  # the interpreter runs no PTX
    sm, codes = t.sm.contiguous().view(torch.int32), t.codes.contiguous().view(torch.int16)
    epi, flags, fused = epilogue_args(x, y, native, grid[0] * cfg.num_warps, gated, residual, hand_in, hand_out)
    hw, xg, parts, n_out, inv_k, eps, n_parts, stride_xg = epi
    if trace is not None and (not native or trace.dtype != torch.int64 or trace.numel() < grid[0] * grid[1] * grid[2] * TRACE_SLOTS):
        raise ValueError(f"launch_hmma: trace: expected a CUDA int64 buffer of {grid[0] * grid[1] * grid[2]} x "
                         f"{TRACE_SLOTS} stamps, got {trace.dtype} {list(trace.shape)} on {trace.device}")
    _u12_hmma_kernel[(grid[2], grid[0], grid[1])](  # M blocks first: a W block's programs neighbours (``MAX_M``)
        x, sm, codes,
        _nonempty(t.esc_idx), _nonempty(t.esc_val), t.esc_row_ptr, lanes, y, part, counters, hw, xg, parts,
        trace if trace is not None else part,
        m, n, k, n_words, biased_scale(t.base), words_per_split, n_out, inv_k, eps, n_parts,
        x.stride(0), n_words, n_words, y.stride(0), stride_xg,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, WARPS=cfg.num_warps, SPLIT_K=grid[1],
        EVEN_K=n_words % cfg.block_w == 0, ASM=native,
        **cfg.launch_options(native, fp_fusion=not fused),
        **pdl_args(x.device), LANES=n_lanes, LANE_GROUP=lane_group(n_lanes), TILED=t.layout == "tiles", **flags,
        ESC_UNROLL=ESC_UNROLL, AHEAD=ahead, AHEAD_X=cfg.ahead_x or (ahead and AHEAD_X),
        ESC_SPLIT=esc_split and (grid[1] > 1 or cfg.warp_k), WARP_K=cfg.warp_k, TRACE=trace is not None,
        EARLY=_early(grid[1]) and cfg.block_n == 16 * cfg.num_warps and not cfg.warp_k and not n_lanes and not esc_split,
        **_w_cache(cfg.w_cache or W_CACHE),
    )


def _w_cache(mode: str) -> dict:
    """The kernel's W_POLICY for a ``W_CACHE`` mode."""
    if mode not in W_CACHE_MODES:
        raise ValueError(f"u12_hmma.W_CACHE: expected one of {', '.join(map(repr, W_CACHE_MODES))}, got {mode!r}")
    return dict(W_POLICY=W_CACHE_MODES[mode])


def _early(splits: int) -> bool:
    """Whether a launch of `splits` ways over K takes its escapes early (``ESC_EARLY``)."""
    if ESC_EARLY not in _EARLY_MODES:
        raise ValueError(f"u12_hmma.ESC_EARLY: expected one of {', '.join(_EARLY_MODES)}, got {ESC_EARLY!r}")
    return ESC_EARLY == "all" or (ESC_EARLY == "split-k" and splits > 1)


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
        _case(17, 9, 32, torch.bfloat16, "few"),  # M past 16: two 16-row blocks side by side (MAX_M)
        _case(8, 17, 64, torch.bfloat16, "all"),  # base 241, not biased: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=_plant_wrong_weight,
    description="u12_linear with an hmma config: 1..64 rows by mma.sync on fragments decoded in registers, "
                "escapes exact",
))
