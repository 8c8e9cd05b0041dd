"""y = x · Wᵀ with W in the u12 format, decoded in registers.

Four kernels. ``_u12_linear_kernel`` ("tile") multiplies M ≤ 4 rows of x on the CUDA cores (GEMV)
and feeds M ≥ 5 decoded [BLOCK_N, BLOCK_K] tiles to ``tl.dot`` (bf16 operands on the GPU, fp32
under the interpreter) with up to 64 rows of x per program, so each weight is decoded once per
program. ``_u12_gemv_kernel`` ("gemv2", chosen by ``U12Config.kernel``) is a second GEMV for M ≤ 4
on the scaled path with K % 4 == 0; kernels/u12_mma.py ("mma") is a tensor-core kernel on that
path (16 rows of x a program at least), its decoded planes fed to wgmma from registers, and
kernels/u12_hmma.py ("hmma") one for 1..64 rows (16 or 32 a program) by mma.sync on fragments decoded in registers; by
default they serve TENSOR_CORE_ROWS rows and more, gemv2 fewer. ``u12_linear`` gives other cases to
the tile kernel.

Loads. The sign/mantissa plane is read as int32 words (4 weights) and the code plane as int16
words (their 4 codes) when K % 4 == 0, so both planes load contiguously and one thread's code
nibbles line up with its bytes without a layout change; the tile kernel decodes the 4 weights of a
word in registers (two pair registers joined, or [BN, BW, 4] by constant shifts) and reshapes them
to k order. Other K read bytes.

Decode (the tile and mma kernels). Where the base's window holds only normal finite exponents (1 ≤ base ≤ 240:
every tensor of trained or N(0, σ) weights), a weight decodes with the exponent field equal to its
code, so no per-weight add or select is needed: code 0 (an escape, whose sign/mantissa byte is 0) is +0.0, and
code c is the weight times 2^-(base-1). The default ("pairs") builds the bf16 patterns of weights
(0, 2) and (1, 3) of a word in one 32-bit register each, with two multiplies that repeat bytes and
spread nibbles and two masks (``_decode_pairs``), about 3.5 integer ops a weight with the split to
fp32; "single" builds one weight per register. x is scaled by 2^64 once per element and the fp32
sum by 2^(base-65) once per output: exact (powers of two) while |x| < 2^64 and the scaled products
stay normal (|x| ≳ 2^-59 · 2^-c), which holds for any activation worth the name. Other bases (0: a
window reaching subnormals; 241: reaching inf/NaN) use the exact exponent ``code + (base - 1)``
with code 0 mapped to 0 and unit scales.

Split-K. The grid is (N blocks, SPLIT_K, M blocks). With SPLIT_K > 1 each program stores its fp32
partial, and the last program of an N block to arrive (an acq_rel counter per block, the serial
split-K semaphore of CUTLASS: barrier, then one release by one thread) sums the partials in split
order, adds the escapes, casts and stores, and resets the counter to 0. One launch, no memset, no
host sync, deterministic; counters live with the weight (per U12Tensor), so two streams must not
run the same weight at the same time.

Escapes: after the sum, the program that writes an output block adds the exact contributions
``x[:, k] * w[n, k]`` of its rows' escapes. Escapes are about 0.015% of N(0, 0.02) weights, yet
finding them cost a GEMV memory round trips after its loop, where a one-wave launch has nothing
else in flight. Where a weight has no lanes (below) or ``ESC_LANES`` says "table", the kernels walk the
side table: CSR row pointers (``U12Tensor.esc_row_ptr``), then indices and values, then x at
their columns, three dependent loads, scattered by a one-hot product (one escape at a time when a
chunk holds inf/NaN contributions). The u12 AR step ran 3.437 ms with no escape step at all (an
ablation, wrong outputs) against 3.676 with it
(bench/results/tried/step_ab_u12_noesc_ablation_h200.json); the GEMVs load the row pointers
before their loop (``ESC_AHEAD``: 3.600 ms against 3.618 with all three after it,
bench/results/tried/step_ab_u12_escapes_h200.json). Issuing the other two under the loop cost
more than it hid, every way tried there: a chunk apart inside the loop by branches (4.063 ms) or
by predicated loads (4.352), or between the loop's thirds (3.823). Nor did a slot table (each
row's first 4 escapes at fixed places, loaded with the row pointers before the loop and
scattered as the table's: commit 75db576, reverted): 3.718 ms against 3.644, its registers up
(gate_up 90 -> 124) (bench/results/tried/step_ab_u12_escape_slots_h200.json).

Lanes (``ESC_LANES``, every kernel's default). ``U12Tensor.esc_lanes`` holds every escape of a row in
the row's lanes, one int32 each (``column | bf16 bits << 16``), as many as the fullest row needs
rounded up to a power of two (8 for N(0, 0.02) rows of 4096, 16 of 14336: a GEMV reads
12.036-12.062 bits a weight, the zoo's narrow rows up to 12.49, bench/results/u12_stats.json),
none past 16 a row or K past 65535 (a lane's column is 16 bits), where the table stays. A GEMV loads its rows'
lanes [BM, BN, LANES] before its loop at addresses it knows up front (``_lanes_load``: nothing
waits on it there), gathers x at their columns after it (``_lanes_gather``: one round trip, from
L2) and reduces both escape sums in one pass, with no row pointers, no one-hot product and no
non-finite path: each lane belongs to one row, so inf/NaN stay in it (``_lanes_finish``).
The u12 AR step, interleaved (bench/results/tried/step_ab_0cf1235_h200.json; 3.438 against 4.117 at 451e309,
bench/results/tried/step_ab_451e309_h200.json):
3.427 ms against 3.546 with the table and bf16's 4.098 (1.196x). Tried and dropped there: x's
gather issued after a peeled first chunk, so the loop hides it (3.629: the peel costs the loop
more than the round trip), and the weight loads ``.cg`` or L1 ``evict_first`` (3.523, 3.529);
x's gather in u12_fused_linear's loop, a load masked off but in its last chunk, the values carried
through the loop (o and gate|up then take 94 registers against 72, gate|up past its one wave: the
H100's AR step 4.772 ms against 4.489, 4.563 with gate|up left out; 8726774,
bench/results/tried/step_ab_parts_after_h100.json);
and, at 2840cfa (bench/results/tried/step_ab_u12_escape_lanes_h200.json), the lanes in the
accumulator's shape, so the escapes fold into its own reduction (4.041 ms after the loop, 3.925
before it: masked [BM, BN, BW] loads and gathers for a few lanes), and in their own shape loaded
after the loop (3.452 against 3.439 before it). The block kernels (tile, mma: ``_store_block``'s
``_lanes_block``; hmma: its ``_finish``) add the escapes in the program that stores the block, after
the loop and, with split-K, after the partials: ``LANE_GROUP`` lanes of every row a step, the
step's lane loads at known addresses, then x at their columns, all of a step in flight at once, in
place of the table walk's row pointers, then one more pair of round trips per ``ESC_BLOCK`` escapes
of the block (not yet timed on a GPU: bench/step_ab.py --q 16 compares it with the table and with 8
and 16 lanes a step). Lanes are derived on first use with a host sync: a launch captured in a CUDA
graph before any eager one walks the table (``lanes_args``).

Tried and dropped: early lanes (``EARLY_LANES``, removed in 08fbe99): under PDL
the lanes loaded before the PDL wait and x gathered at them right after it, so the gather's round
trip ran under the loop; the AR step in PDL mode 2 ran 4.792 ms against 4.487 late (H100, 8cc6200,
bench/results/tried/step_ab_early_lanes_parts_h100.json) and 3.750 against 3.411 (H200, 0bc2353,
bench/results/tried/step_ab_0bc2353_h200.json).

gemv2. One program owns BLOCK_N rows of W and every row of x (M ≤ 4), so each weight is decoded
once and used M times, and loops over K in chunks of BLOCK_W words. The 4 weights of a word
decode into four fp32 planes (plane j: weight 4 w + j), each multiplied with the matching plane
of x (bf16 x read as one int64 word per w) into one [BM, BN, BW] accumulator by FMAs, reduced
once after the loop: no join, reshape or layout conversion. The decode (``_decode_planes``) is 12
integer ops a word: prmt byte repeats, multiply-adds that spread the code nibbles and add a bias,
and one lop3 bit-select per pair of weights, by inline PTX on the GPU and a shift-and-mask
emulation of the same bits under the interpreter. It is biased: the exponent field is 112 + code
(the bias is the multiplies' addend, no extra op), so a weight decodes to w · 2^(113-base), in
[2^-14, 2), x is used as it is, and the fp32 sums are scaled by 2^(base-113) once per output
(``biased_scale``): exact while the products stay normal (|x| ≳ 2^-112), with no bound on |x|
and no multiply per x element (the tile kernel's 2^64 cost one FMUL per x element and thread,
about 1 instruction a weight at BLOCK_N 4: sm_90 SASS, 7.0 -> 5.9 instructions a weight in the
loop). An escape (code 0, byte 0) decodes to 2^-15; the escape step subtracts x · 2^-15, the
exact product the loop added, before the scale, then adds x · w (``_apply_escapes``). Rows past M
and N re-read the last row, so the loop has no masks; only a last partial chunk of K is masked.
In the sm_90 SASS the tile kernel's M = 1 loop makes a shared-memory round trip per chunk for
its reshape and issues about twice gemv2's instructions a weight; gemv2 touches no shared memory.

Configs are data (``U12Config``: block_n, block_w words = 4 weights each, split_k, warps, stages,
decode, kernel); ``default_config`` picks one per (M, N, K) (``TUNED`` first, filled from the H200
sweep) and bench/u12_linear.py sweeps ``SWEEP_GEMV`` / ``SWEEP_DOT`` × ``SPLIT_KS``, for
M ≤ 4 ``SWEEP_GEMV2`` and, asked for (``--kernels mma``), from 3 rows ``SWEEP_MMA`` × ``SPLIT_KS_MMA``
against cuBLAS. TUNED's M = 16 rows are mma configs from its H200 sweep.

Speed (H200, triton 3.6). gemv2 at M = 1 (bench/results/u12_linear_gemv2_m1_h200.json, commit
b170131): 1.27x (qkv), 1.30x (o), 1.23x (gate_up), 1.22x (down), 1.31x (lm_head) of cuBLAS bf16,
up to 4.14 TB/s of packed bytes; all linears of a Llama-3.1-8B step in one CUDA graph: 3.14 ms
against 3.97 ms (1.26x). Each config timed in a CUDA graph instead, with the escapes from the
lanes (bench/results/u12_linear_gemv2_graph_h200.json, commit 0cf1235): 1.37x, 1.38x, 1.30x
(TUNED's tile 1.25x), 1.29x, 1.57x, up to 4.38 TB/s (lm_head: two rows a one-warp program), all
linears in one graph 1.32x (3.01 ms against 3.99); with the table
(bench/results/tried/u12_linear_gemv2_graph_1f0a597_h200.json): 1.20x, 1.29x, 1.36x, 1.20x,
1.54x. The whole fused AR step with every linear in u12 (u12_fused_linear's epilogues around
this loop, the norms apart, the escapes from the table) runs 3.704 ms against 4.138 ms for the bf16 step with
fused_linear, interleaved in one run (1.117x; bench/results/tried/step_ab_5b12e69_h200.json, commit 5b12e69;
3.674 against 4.131, 1.124x, with qkv and o at TUNED's 4 words a thread, ac79ccb;
3.673 against 4.176, 1.137x, at f6a43e7 before the bf16 step's o and down took 128 registers;
3.72 ms, 1.124x, at 52a0fe1 before the biased decode); in the step's profile the u12 GEMVs read
3.43 TB/s of packed bytes (3.06 ms) against 3.94 TB/s for the bf16 ones
(bench/results/step_times_llama_h200.json). The biased decode took 16% of the loop's
instructions away and about 1.3% of its time: the loop is not bound by its instruction count,
nor by its loads' placement (at 80 or 128 registers ptxas issues them all before the first FMA,
and the step ran 3.86 and 3.99 ms against 3.71; bench/step_ab.py's docstring). At M = 4 gemv2 runs 0.73-0.88x (per-row FMAs: the
decode is shared, the multiply is not), still ahead of the tile kernel there. The tile kernel
(bench/results/u12_linear_nvidia_h200.json, 457 configs, commit da24869): 0.69-0.97x at M = 1 and
0.39-0.85x at M = 16 and 64 (TUNED still takes its M = 64 rows); split-K never won at M <= 4. The
mma kernel at M = 16 (bench/results/u12_linear_mma_h200.json): 0.67-0.96x on the layer shapes,
1.18x on lm_head, 0.83x for all linears of a step.
Correct on the GPU for every swept config (each checked against the reference first) and in the
GPU test runs; under the interpreter the tests walk split-K, both decodes, word and byte loads,
the PTX emulation, and the decodes' bits on all 65536 patterns. Tried for gemv2 and dropped:
prefetching the next chunk's words into registers in the Triton source (the compiled loop issues
those loads at its end, beside the register swap, and runs 10-17% more instructions); x as fp32
planes [M, 4, K/4] (plane j holding x[m, 4 w + j], for a producer to write), four contiguous loads
and no conversion in the loop (5.9 -> 5.0 instructions a weight): the 32-layer linears proxy ran
3.60 ms against 3.16 with bf16 rows (bench/results/tried/u12_linear_planes_h200.json, commit
f6a43e7; reverted in 963d148), twice the x bytes through L1 for every program costing more than
the conversions; and, in the step (step_ab's TILE_VARIANTS), two rows a thread for qkv, o and
down (3.671 ms against 3.673), one-warp programs (3.756) and BLOCK_N 8 (3.755). At M = 16 the
hmma kernel (kernels/u12_hmma.py: mma.sync on fragments decoded in registers, no shared memory)
was written against the mma kernel's per-chunk wgmma wait; it wins o only. Open: M = 16 beyond
that, M = 4 and 64, a tile-major layout.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import MAX_BASE, U12Tensor, pack_u12, unpack_u12

from .overlap import pdl_args, pdl_enter
from .registry import KernelSpec, register
from .target import native as on_native
from .rmsnorm import _normalize
from .tuning import nearest_tuned

X_SCALE_LOG2 = 64  # the tile and mma kernels' scaled decode scales x by 2^64 (see the module docstring)
EXP_BIAS = 112  # gemv2's and u12_fused_linear's decode: exponent field 112 + code (biased_scale)
PAIR_BIAS = tl.constexpr((EXP_BIAS << 7) | (EXP_BIAS << 23))  # both halves of a pair register: 0x38003800
ESC_DECODED = tl.constexpr(2.0 ** (EXP_BIAS - 127))  # an escape (code 0, byte 0) in the biased decode: 2^-15


@triton.jit
def _decode_pairs(s, c, TO_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """The scaled decode two weights per 32-bit op: bf16 patterns of weights (0, 2) and (1, 3).

    (s & 0x00FF00FF) · 0x0101 = [b2 b2 b0 b0], masked 0x807F807F: both signs and mantissas placed.
    (c & 0x0F0F) · 0x8080 puts c0 at bits 7..10 and c2 at 23..26 (the cross terms land in 15..19),
    masked 0x07800780: both exponent fields. About 3.5 integer ops a weight with the fp32 split.
    """
    p02 = (((s & 0x00FF00FF) * 0x0101) & -0x7F807F81) | (((c & 0x0F0F) * 0x8080) & 0x07800780)
    p13 = ((((s >> 8) & 0x00FF00FF) * 0x0101) & -0x7F807F81) | ((((c >> 4) & 0x0F0F) * 0x8080) & 0x07800780)
    if TO_BF16:
        w0 = p02.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w2 = (p02 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w1 = p13.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w3 = (p13 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w0 = (p02 << 16).to(tl.float32, bitcast=True)
        w2 = (p02 & -0x10000).to(tl.float32, bitcast=True)
        w1 = (p13 << 16).to(tl.float32, bitcast=True)
        w3 = (p13 & -0x10000).to(tl.float32, bitcast=True)
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [BN, BW, a, b] holds weight 4 w + 2 a + b
    return tl.reshape(w, (BLOCK_N, 4 * BLOCK_W))


@triton.jit
def _decode_words(
    s, c, base, SCALED: tl.constexpr, PAIRS: tl.constexpr, TO_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """[BN, BW] int32 words of 4 sign/mantissa bytes and their 4 codes -> [BN, 4 BW] weights in k order.

    SCALED: exponent field = code (weight · 2^-(base-1); escapes, code 0 and byte 0, are +0.0),
    by pairs (PAIRS) or one weight per 32-bit op. Else the exact exponent code + base - 1, 0 for code 0.
    """
    if SCALED and PAIRS:
        return _decode_pairs(s, c, TO_BF16, BLOCK_N, BLOCK_W)
    j = tl.arange(0, 4)
    b = (s[:, :, None] >> (8 * j)[None, None, :]) & 0xFF
    code = (c[:, :, None] >> (4 * j)[None, None, :]) & 0xF
    if SCALED:
        e = code
    else:
        e = code + (base - 1) * tl.minimum(code, 1)
    # b · 0x0101 repeats the byte, so one mask puts the sign in the top bit and the mantissa in the
    # low 7 (the multiply runs on the FMA pipe, beside the integer ALU that the decode is bound by).
    if TO_BF16:
        w = (((b * 0x0101) & 0x807F) | (e << 7)).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w = (((b * 0x01010000) & -0x7F810000) | (e << 23)).to(tl.float32, bitcast=True)  # mask 0x807F0000
    return tl.reshape(w, (BLOCK_N, 4 * BLOCK_W))


@triton.jit
def _scatter_escapes(acc, contrib, rows, offs_n, USE_DOT: tl.constexpr):
    """acc[:, n] += sum of contrib[:, e] over escapes e in row n, for finite contrib [BM, EB]."""
    hit = rows[:, None] == offs_n[None, :]  # [EB, BN]
    if USE_DOT:
        # One-hot product: exact in fp32 (each output gets one nonzero term per escape).
        return tl.dot(contrib, hit.to(tl.float32), acc, input_precision="ieee")
    else:
        return acc + tl.sum(tl.where(hit[None, :, :], contrib[:, :, None], 0.0), axis=1)


@triton.jit
def _escape_range(esc_row_ptr, n0, N, BLOCK_N: tl.constexpr):
    """[start, end): the escapes of rows [n0, min(n0 + BLOCK_N, N)) of W in its side table (CSR row pointers)."""
    return tl.load(esc_row_ptr + n0), tl.load(esc_row_ptr + tl.minimum(n0 + BLOCK_N, N))


@triton.jit
def _escape_load(esc_idx_ptr, esc_val_ptr, offs_e, mask_e):
    """The flat indices and fp32 values of escapes offs_e (0 where not mask_e)."""
    idx = tl.load(esc_idx_ptr + offs_e, mask=mask_e, other=0)
    val = (tl.load(esc_val_ptr + offs_e, mask=mask_e, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return idx, val


@triton.jit
def _escape_gather(x_ptr, nw_ptr, idx, mask_e, offs_m, mask_m, K, stride_xm, stride_xk,
                   ESC_BLOCK: tl.constexpr, NORM: tl.constexpr):
    """x [BM, ESC_BLOCK] (fp32) at the columns of the escapes idx (``_escape_load``), and NORM
    the norm weight there (else zeros)."""
    cols = idx % K
    xg = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
        mask=mask_m[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=mask_e, other=0.0).to(tl.float32)
    else:
        nw = tl.zeros((ESC_BLOCK,), dtype=tl.float32)
    return xg, nw


@triton.jit
def _escape_block(
    esc, spur, idx, val, xg, nw, e0, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, BIASED: tl.constexpr,
):
    """Escapes e0 .. e0 + ESC_BLOCK - 1 (< end), loaded and gathered (``_escape_load``,
    ``_escape_gather``), into esc (Σ x · w) and, BIASED, spur (Σ x · 2^-15), both [BM, BN] by the
    rows offs_n. One escape at a time, reloaded, when the block holds inf/NaN contributions."""
    mask_e = e0 + tl.arange(0, ESC_BLOCK) < end
    rows = tl.where(mask_e, idx // K, -1)
    if NORM:
        xg = _normalize(xg, inv[:, None], nw[None, :], DTYPE, ROUND_BF16)
    contrib = xg * val[None, :]
    n_nonfinite = tl.sum(tl.sum((contrib - contrib != 0).to(tl.int32), axis=1), axis=0)
    if n_nonfinite == 0:
        esc = _scatter_escapes(esc, contrib, rows, offs_n, USE_DOT)
        if BIASED:  # finite too: x is finite wherever x · w is
            spur = _scatter_escapes(spur, xg * ESC_DECODED, rows, offs_n, USE_DOT)
    else:
        for e in range(e0, tl.minimum(e0 + ESC_BLOCK, end)):
            i = tl.load(esc_idx_ptr + e)
            v = (tl.load(esc_val_ptr + e).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            xcol = tl.load(x_ptr + offs_m * stride_xm + (i % K) * stride_xk, mask=mask_m, other=0.0).to(tl.float32)
            if NORM:
                xcol = _normalize(xcol, inv, tl.load(nw_ptr + i % K).to(tl.float32), DTYPE, ROUND_BF16)
            hit = offs_n[None, :] == i // K
            esc += tl.where(hit, (xcol * v)[:, None], 0.0)
            if BIASED:
                spur += tl.where(hit, (xcol * ESC_DECODED)[:, None], 0.0)
    return esc, spur


@triton.jit
def _escape_blocks(
    esc, spur, first, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, BIASED: tl.constexpr,
):
    """``_escape_block`` over escapes first .. end - 1, ESC_BLOCK at a time, each loaded and gathered in turn."""
    for e0 in range(first, end, ESC_BLOCK):
        offs_e = e0 + tl.arange(0, ESC_BLOCK)
        idx, val = _escape_load(esc_idx_ptr, esc_val_ptr, offs_e, offs_e < end)
        xg, nw = _escape_gather(x_ptr, nw_ptr, idx, offs_e < end, offs_m, mask_m, K, stride_xm, stride_xk,
                                ESC_BLOCK, NORM)
        esc, spur = _escape_block(
            esc, spur, idx, val, xg, nw, e0, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
            stride_xm, stride_xk, ESC_BLOCK, USE_DOT, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, BIASED,
        )
    return esc, spur


@triton.jit
def _escape_sums(acc, BIASED: tl.constexpr):
    """The escape step's two sums, esc and spur (``_escape_block``): zeros for the biased decode;
    else esc is acc itself (y's units already, the escapes decoded to +0.0) and spur unused."""
    if BIASED:
        return tl.zeros_like(acc), tl.zeros_like(acc)
    else:
        return acc, acc


@triton.jit
def _escape_finish(acc, esc, spur, y_scale, BIASED: tl.constexpr):
    """y from the loop's sums and the escape sums: (acc - spur) · y_scale + esc for the biased
    decode (the scale exact: a power of two), else esc (acc with the escapes added)."""
    if BIASED:
        return (acc - spur) * y_scale + esc
    else:
        return esc


@triton.jit
def _escape_ahead_init(idx_ptr, BLOCK_M: tl.constexpr, ESC_BLOCK: tl.constexpr):
    """The first escape block's registers before its loads (``_escape_stage``): offs_e, end, idx, val, x, nw."""
    zeros = tl.zeros((ESC_BLOCK,), dtype=tl.int32)
    return (zeros, zeros, tl.zeros((ESC_BLOCK,), dtype=idx_ptr.dtype.element_ty),
            tl.zeros((ESC_BLOCK,), dtype=tl.float32), tl.zeros((BLOCK_M, ESC_BLOCK), dtype=tl.float32),
            tl.zeros((ESC_BLOCK,), dtype=tl.float32))


@triton.jit
def _escape_stage(
    step, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
    mask_m, K, stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    """Step ``step`` of the loads of the first ESC_BLOCK escapes of rows [n0, min(n0 + BLOCK_N, N)),
    three dependent round trips: 0 the row pointers (offs_e, the first escape's offset in the table,
    and end, each an [ESC_BLOCK] tensor), 1 the indices and values (``_escape_load``), 2 x and NORM
    the norm weight at their columns (``_escape_gather``). With ``ESC_AHEAD`` the GEMVs issue step 0
    before their loop and the rest after it (``_escape_stages_left``); without, all three after it.
    (Written for any split of the steps around the loop; the splits that put steps 1 and 2 under
    it measured slower and are gone, see the module docstring. Folding this into two plain helpers
    changed the kernels' sm_90 SASS, so the measured form stays.) The row pointers are
    tensors, not scalars: a scalar goes to a uniform register, whose move waited for the load on
    the spot (sm_90 SASS)."""
    if step == 0:
        zero = tl.zeros((ESC_BLOCK,), dtype=tl.int32)
        offs_e = tl.load(esc_row_ptr + n0 + zero)
        end = tl.load(esc_row_ptr + tl.minimum(n0 + BLOCK_N, N) + zero)
    if step == 1:
        offs = offs_e + tl.arange(0, ESC_BLOCK)
        idx, val = _escape_load(esc_idx_ptr, esc_val_ptr, offs, offs < end)
    if step == 2:
        xg, nw = _escape_gather(x_ptr, nw_ptr, idx, offs_e + tl.arange(0, ESC_BLOCK) < end, offs_m, mask_m, K,
                                stride_xm, stride_xk, ESC_BLOCK, NORM)
    return offs_e, end, idx, val, xg, nw


@triton.jit
def _escape_stages_left(
    FIRST: tl.constexpr, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
    mask_m, K, stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    """The ``_escape_stage`` steps from ``FIRST`` on (those the kernel did not issue before its loop)."""
    for step in tl.static_range(FIRST, 3):
        offs_e, end, idx, val, xg, nw = _escape_stage(
            step, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
            mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, NORM,
        )
    return offs_e, end, idx, val, xg, nw


@triton.jit
def _escapes_ahead(
    acc, offs_e, end, idx, val, xg, nw, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr,
    ROUND_BF16: tl.constexpr, y_scale,
):
    """``_apply_escapes`` (biased decode, no dot) for a GEMV that loaded the first ESC_BLOCK escapes
    of its rows by ``_escape_stage``: that block from its registers, any further ones loaded here
    (past ESC_BLOCK escapes in a program's rows: rare, about 0.6 a row of 4096 N(0, 0.02) weights)."""
    e0 = tl.min(offs_e, 0)
    e_end = tl.max(end, 0)
    esc, spur = _escape_sums(acc, True)
    esc, spur = _escape_block(
        esc, spur, idx, val, xg, nw, e0, e_end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, False, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, True,
    )
    esc, spur = _escape_blocks(
        esc, spur, e0 + ESC_BLOCK, e_end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, False, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, True,
    )
    return _escape_finish(acc, esc, spur, y_scale, True)


@triton.jit
def _apply_escapes(
    acc, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
    stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
    BIASED: tl.constexpr = False, y_scale=1.0,
):
    """Add the exact contributions of the escaped weights in rows [n0, min(n0 + BLOCK_N, N)) of W
    (offs_n: those rows' indices in W, so a block of the up half of [gate; up] passes n0, offs_n and
    N shifted by the gate rows). NORM: x at an escape's column is normalised as the fused kernel's
    x planes are (kernels/u12_fused_linear.py), dtype(nw · dtype(x · inv)) with inv [BM] per row.

    BIASED: acc holds the biased decode's sums (its units: y / y_scale), in which every escape
    decoded to 2^-15 (``ESC_DECODED``). That term is taken back in those units, where it is the
    exact product the loop added, before the scale: y = (acc - Σ x 2^-15) · y_scale + Σ x w. Else
    acc is y's sums already and the escapes decoded to +0.0: y = acc + Σ x w.

    Three dependent memory round trips (row pointers, then indices and values, then x at their
    columns); the GEMVs issue the first before their loops (``_escape_stage``, ``_escapes_ahead``)."""
    esc, spur = _escape_sums(acc, BIASED)
    start, end = _escape_range(esc_row_ptr, n0, N, BLOCK_N)
    esc, spur = _escape_blocks(
        esc, spur, start, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, USE_DOT, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, BIASED,
    )
    return _escape_finish(acc, esc, spur, y_scale, BIASED)


@triton.jit
def _lane_sums(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _lanes_load(lanes_ptr, rows_n, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The escape lanes (``U12Tensor.esc_lanes``: LANES a row, ``column | bf16 bits << 16``) of
    the W rows rows_n [1, BN, 1], as [BM, BN, LANES] int32. Their addresses need no other load,
    so the GEMVs issue this before their loop and use it after."""
    offs_l = tl.arange(0, LANES)[None, None, :]
    return tl.load(tl.broadcast_to(lanes_ptr + rows_n * LANES + offs_l, (BLOCK_M, BLOCK_N, LANES)))


@triton.jit
def _lanes_x(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, NORM: tl.constexpr):
    """x (rows_m [BM, 1, 1]) and, NORM, the norm weight at the columns of ``lanes``
    (``_lanes_load``) as loaded, 0 in empty lanes (column 0xFFFF >= K): the loads of
    ``_lanes_gather``, one memory round trip (x, from L2)."""
    col = lanes & 0xFFFF
    ok = col < K
    xv = tl.load(x_ptr + rows_m * stride_xm + col, mask=ok, other=0.0)
    nw = tl.load(nw_ptr + col, mask=ok, other=0.0) if NORM else xv
    return xv, nw


@triton.jit
def _lanes_terms(lanes, xv, nw, K, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``_lanes_gather``'s terms from ``_lanes_x``'s loads."""
    ok = (lanes & 0xFFFF) < K
    xv = xv.to(tl.float32)
    if NORM:
        xv = _normalize(xv, inv, nw.to(tl.float32), DTYPE, ROUND_BF16)
    w = (lanes & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(ok, xv * ESC_DECODED, 0.0), tl.where(ok, xv * w, 0.0)


@triton.jit
def _lanes_gather(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, inv,
                  NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """(x · 2^-15, x · w) [BM, BN, LANES] fp32 for the escapes in ``lanes`` (``_lanes_load``), 0 in
    empty lanes (column 0xFFFF >= K): x at each lane's column (rows_m [BM, 1, 1]; NORM: normalised
    as the loop's x, with inv [BM, 1, 1] and the norm weight there). One memory round trip (x, from L2)."""
    xv, nw = _lanes_x(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, NORM)
    return _lanes_terms(lanes, xv, nw, K, inv, NORM, DTYPE, ROUND_BF16)


@triton.jit
def _lanes_finish(acc, spur, esc, y_scale):
    """y [BM, BN] from the biased decode's sums acc [BM, BN, BW] and the escapes' terms
    (``_lanes_gather``): y = (Σ acc - Σ x · 2^-15) · y_scale + Σ x · w, the 2^-15 the loop added for
    each escape taken back before the scale (as ``_apply_escapes``). Both escape sums in one
    reduction; inf/NaN flow as IEEE has them (no one-hot product mixes rows here)."""
    spur, esc = tl.reduce((spur, esc), 2, _lane_sums)
    return (tl.sum(acc, axis=2) - spur) * y_scale + esc


@triton.jit
def _lane_walk(acc, lanes_ptr, rows, x_rows, stride_xk, ok, K, LANES: tl.constexpr, GROUP: tl.constexpr):
    """(Σ x · 2^-15, Σ x · w) shaped as acc over the escapes in the lanes of W rows `rows` (clamped;
    ok where the output is the block's), x from x_rows (pointers to the outputs' x rows; rows and
    x_rows broadcast to acc's shape), GROUP lanes of every row a step: the step's lane loads need no
    other load, then x at their columns, all in flight at once (two round trips a step, where the
    table walk takes one and two more per ``ESC_BLOCK`` escapes of the block). Each output sums its
    own row's escapes, so inf/NaN stay in it. The block kernels' escape step (``_lanes_block``,
    kernels/u12_hmma.py's ``_finish``)."""
    esc = tl.zeros_like(acc)
    spur = tl.zeros_like(acc)
    for j0 in range(0, LANES, GROUP):
        for jj in tl.static_range(GROUP):
            lane = tl.load(lanes_ptr + rows * LANES + j0 + jj)
            col = lane & 0xFFFF
            has = ok & (col < K)  # an empty lane's column 0xFFFF is never < K
            xv = tl.load(x_rows + col * stride_xk, mask=has, other=0.0).to(tl.float32)
            esc += tl.where(has, xv * (lane & -0x10000).to(tl.float32, bitcast=True), 0.0)
            spur += tl.where(has, xv * ESC_DECODED, 0.0)
    return spur, esc


@triton.jit
def _lanes_block(out, lanes_ptr, rows_n, x_ptr, offs_m, mask_m, stride_xm, stride_xk, K, LANES: tl.constexpr,
                 GROUP: tl.constexpr, BIASED: tl.constexpr, y_scale):
    """y [BM, BN] from a program's fp32 sums out [BM, BN] and the escapes of its W rows rows_n [BN]
    (clamped to N - 1) read from their lanes (``_lane_walk``). BIASED: out is the biased decode's
    sums, y = (out - Σ x · 2^-15) · y_scale + Σ x · w (``_lanes_finish``); else y's units with the
    escapes decoded to +0.0, y = out + Σ x · w."""
    spur, esc = _lane_walk(out, lanes_ptr, rows_n[None, :], x_ptr + offs_m[:, None] * stride_xm, stride_xk,
                           mask_m[:, None], K, LANES, GROUP)
    if BIASED:
        return (out - spur) * y_scale + esc
    else:
        return out + esc


@triton.jit
def _u12_linear_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, y_ptr, part_ptr, count_ptr,
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
    LANES: tl.constexpr = 0,  # > 0: the escapes from W's lanes (U12Tensor.esc_lanes, LANES a row), not the table
    LANE_GROUP: tl.constexpr = 4,  # lanes a step of the epilogue's walk (module LANE_GROUP)
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
            at = _col_words(offs_w, TILED)[None, :]
            s = tl.load(sm_ptr + _row_words(offs_n, stride_sm, TILED)[:, None] + at, mask=w_mask, other=0)
            c = tl.load(codes_ptr + _row_words(offs_n, stride_codes, TILED)[:, None] + at, mask=w_mask,
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
        w = _decode_words(s, c, base, SCALED, PAIRS, DOT_BF16, BLOCK_N, BLOCK_W)  # [BN, 4 BW]
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

    _store_block(
        out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr, offs_m, mask_m, offs_n, mask_n,
        n0, pid_n, pid_k, pid_m, M, N, K, SPLIT_K, stride_xm, stride_xk, stride_ym,
        BLOCK_M, BLOCK_N, ESC_BLOCK, USE_DOT, False, 1.0, lanes_ptr, LANES, LANE_GROUP,
    )


@triton.jit
def _block_escapes(
    out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, offs_m, mask_m, offs_n, n0, N, K,
    stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    DTYPE: tl.constexpr, BIASED: tl.constexpr, y_scale, LANES: tl.constexpr, LANE_GROUP: tl.constexpr,
):
    """``_store_block``'s escape step: from the lanes (LANES > 0, LANE_GROUP at a time) or from the table."""
    if LANES:
        return _lanes_block(out, lanes_ptr, tl.minimum(offs_n, N - 1), x_ptr, offs_m, mask_m, stride_xm, stride_xk,
                            K, LANES, LANE_GROUP, BIASED, y_scale)
    else:
        return _apply_escapes(
            out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
            stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, USE_DOT, x_ptr, 1.0, False, DTYPE, False, BIASED, y_scale,
        )


@triton.jit
def _split_k_sum(out, part_ptr, count_ptr, offs_m, offs_n, mask_out, pid_n, pid_k, pid_m, M, N,
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
def _store_block(
    out, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr, part_ptr, count_ptr, offs_m, mask_m, offs_n, mask_n,
    n0, pid_n, pid_k, pid_m, M, N, K, SPLIT_K: tl.constexpr, stride_xm, stride_xk, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    BIASED: tl.constexpr = False, y_scale=1.0, lanes_ptr=None, LANES: tl.constexpr = 0,
    LANE_GROUP: tl.constexpr = 4,
):
    """Store a program's fp32 sums ``out`` [BM, BN] (y's units, or BIASED the biased decode's, which
    the escape step scales by y_scale; ``_apply_escapes``): the program that holds the block's
    whole sum (``_split_k_sum``) adds the escapes, from W's lanes where LANES > 0
    (``_lanes_block``), else from the table, and stores y. Shared by the tile kernel and the mma
    kernel (kernels/u12_mma.py)."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    last, total = _split_k_sum(out, part_ptr, count_ptr, offs_m, offs_n, mask_out, pid_n, pid_k, pid_m, M, N, SPLIT_K)
    if last:
        total = _block_escapes(
            total, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, lanes_ptr, offs_m, mask_m, offs_n, n0, N, K,
            stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, USE_DOT, y_ptr.dtype.element_ty, BIASED, y_scale, LANES, LANE_GROUP,
        )
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask_out)


# --- the GEMV kernel for M <= 4 ("gemv2") ----------------------------------------------------

@triton.jit
def _prmt(a, b, SELECTOR: tl.constexpr, ASM: tl.constexpr):
    """PTX ``prmt.b32`` in its default mode: byte i of the result is byte ``(SELECTOR >> 4 i) & 7``
    of the pair {b, a} (bytes 0-3 from a, 4-7 from b). ASM: the instruction; else the same bytes by
    shifts and masks (the interpreter runs no inline assembly). Selectors here never set bit 3 (the
    sign-replicating form)."""
    if ASM:
        return tl.inline_asm_elementwise(
            f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1,
        )
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):  # no constexpr assignment in the loop: Triton 3.6 refuses its reassignment
            src = a if ((SELECTOR >> (4 * i)) & 7) < 4 else b
            out |= ((src >> (8 * ((SELECTOR >> (4 * i)) & 3))) & 0xFF) << (8 * i)
        return out


@triton.jit
def _select_bits(mask_src, other, MASK: tl.constexpr, ASM: tl.constexpr):
    """Bits of ``mask_src`` where MASK is 1, of ``other`` elsewhere. ASM: one ``lop3.b32``; LLVM
    turns the portable form into two LOP3s (one per constant), seen in the sm_90 SASS."""
    if ASM:
        return tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, $2, {MASK}, 0xE4;", "=r,r,r", [mask_src, other], dtype=tl.int32, is_pure=True, pack=1,
        )
    else:
        return other ^ ((other ^ mask_src) & MASK)


@triton.jit
def _pair_patterns(s, c, ASM: tl.constexpr, BIASED: tl.constexpr = True):
    """The bf16 bit patterns of weights (0, 2) (low, high half) and (1, 3) of each word, biased decode
    (``_decode_planes`` says how); BIASED off: exponent field = code, the tile and mma kernels' scaled
    decode (escapes +0.0, weight times 2^-(base-1))."""
    if BIASED:
        e02 = (c & 0x0F0F) * 0x8080 + PAIR_BIAS  # one IMAD: the bias is the multiply's addend
        e13 = (c & 0xF0F0) * 0x0808 + PAIR_BIAS
    else:
        e02 = (c & 0x0F0F) * 0x8080
        e13 = (c & 0xF0F0) * 0x0808
    p02 = _select_bits(e02, _prmt(s, s, 0x2200, ASM), 0x7F807F80, ASM)
    p13 = _select_bits(e13, _prmt(s, s, 0x3311, ASM), 0x7F807F80, ASM)
    return p02, p13


@triton.jit
def _decode_planes(s, c, ASM: tl.constexpr, BIASED: tl.constexpr = True):
    """The biased decode of int32 words ``s`` (4 sign/mantissa bytes) and their int16 code words
    ``c`` (4 nibbles) into four fp32 planes, plane j holding weight 4 w + j times 2^(113-base)
    (exponent field 112 + code; an escape, code 0 and byte 0, is 2^-15); no join or reshape, so no
    layout change.

    The bf16 patterns of weights (0, 2) and (1, 3) are built in one 32-bit register each:
    prmt repeats bytes ([b2 b2 b0 b0]: sign at bit 15, mantissa at bits 0-6 of each half),
    (c & 0x0F0F) · 0x8080 + 0x38003800 puts code 0 at bits 7-10 and code 2 at bits 23-26 with the
    bias 112 = 0b1110000 beside each (bits 11-13, 27-29; the cross terms land in bits 15-19), and one
    bit-select takes both exponent fields (mask 0x7F807F80) from there. 12 integer ops a word of 4
    weights: 2 masks, 2 multiply-adds, 2 prmt, 2 bit-selects, 4 to split the pairs to fp32.
    """
    p02, p13 = _pair_patterns(s, c, ASM, BIASED)
    w0 = (p02 << 16).to(tl.float32, bitcast=True)
    w1 = (p13 << 16).to(tl.float32, bitcast=True)
    w2 = (p02 & -0x10000).to(tl.float32, bitcast=True)
    w3 = (p13 & -0x10000).to(tl.float32, bitcast=True)
    return w0, w1, w2, w3


@triton.jit
def bf16x4_to_fp32(v):
    """An int64 word of 4 bf16 (little-endian: element j in bits 16 j..16 j + 15) as 4 fp32 values,
    by shifts and masks (exact). Shared with fused_linear's weight loads."""
    lo = v.to(tl.int32)
    hi = (v >> 32).to(tl.int32)
    return ((lo << 16).to(tl.float32, bitcast=True), (lo & -0x10000).to(tl.float32, bitcast=True),
            (hi << 16).to(tl.float32, bitcast=True), (hi & -0x10000).to(tl.float32, bitcast=True))


@triton.jit
def _x_planes(x_rows, offs_w, mask, X_WORDS: tl.constexpr, MASKED: tl.constexpr):
    """x[m, 4 w + j] for j = 0..3 as fp32. X_WORDS: bf16 x read as one int64 word per w (4 bf16),
    split in registers; else four strided element loads."""
    if X_WORDS:
        if MASKED:
            xw = tl.load(x_rows + offs_w, mask=mask, other=0)
        else:
            xw = tl.load(x_rows + offs_w)
        x0, x1, x2, x3 = bf16x4_to_fp32(xw)
    else:
        x_k = x_rows + 4 * offs_w
        if MASKED:
            x0 = tl.load(x_k, mask=mask, other=0.0).to(tl.float32)
            x1 = tl.load(x_k + 1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_k + 2, mask=mask, other=0.0).to(tl.float32)
            x3 = tl.load(x_k + 3, mask=mask, other=0.0).to(tl.float32)
        else:
            x0 = tl.load(x_k).to(tl.float32)
            x1 = tl.load(x_k + 1).to(tl.float32)
            x2 = tl.load(x_k + 2).to(tl.float32)
            x3 = tl.load(x_k + 3).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def _row_words(rows, stride, TILED: tl.constexpr):
    """Where each row starts in a plane, in words: rows · stride; TILED (U12Tensor.layout "tiles"), its
    16-row tile's start plus its 16 words of a group (specpilot/formats/u12.py)."""
    if TILED:
        return (rows // 16) * (16 * stride) + (rows % 16) * 16
    else:
        return rows * stride


@triton.jit
def _col_words(w, TILED: tl.constexpr):
    """Where word w of a row sits after the row's start: w; TILED, 256 words (16 rows) a 16-word
    group, so runs of 16 words stay contiguous."""
    if TILED:
        return (w // 16) * 256 + w % 16
    else:
        return w


@triton.jit
def _fma_planes(acc, sm_rows, code_rows, offs_w, mask, x0, x1, x2, x3, MASKED: tl.constexpr, ASM: tl.constexpr,
                TILED: tl.constexpr = False):
    """acc += Σ_j x_j · plane j of the decoded words offs_w of the rows sm_rows / code_rows (the
    rows' starts, ``_row_words``)."""
    at = _col_words(offs_w, TILED)
    if MASKED:
        s = tl.load(sm_rows + at, mask=mask, other=0)
        c = tl.load(code_rows + at, mask=mask, other=0).to(tl.int32)
    else:
        s = tl.load(sm_rows + at)
        c = tl.load(code_rows + at).to(tl.int32)
    w0, w1, w2, w3 = _decode_planes(s, c, ASM)
    acc = tl.fma(x0, w0, acc)
    acc = tl.fma(x1, w1, acc)
    acc = tl.fma(x2, w2, acc)
    acc = tl.fma(x3, w3, acc)
    return acc


@triton.jit
def _gemv_chunk(
    acc, start, sm_rows, code_rows, x_rows, n_words,
    BLOCK_W: tl.constexpr, X_WORDS: tl.constexpr, MASKED: tl.constexpr, ASM: tl.constexpr, TILED: tl.constexpr,
):
    """acc[m, n, w] += sum over j of x[m, 4 w + j] · w[n, 4 w + j] 2^(113-base), for the words
    w in [start, start + BLOCK_W); MASKED: words past K read as 0 (2^-15 weights, 0 activations)."""
    offs_w = (start + tl.arange(0, BLOCK_W))[None, None, :]
    mask = offs_w < n_words
    x0, x1, x2, x3 = _x_planes(x_rows, offs_w, mask, X_WORDS, MASKED)
    return _fma_planes(acc, sm_rows, code_rows, offs_w, mask, x0, x1, x2, x3, MASKED, ASM, TILED)


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
    ESC_AHEAD: tl.constexpr = False,  # the escapes' row pointers loaded before the loop (module ESC_AHEAD)
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
    sm_rows = tl.broadcast_to(sm_ptr + _row_words(rows_n, stride_sm, TILED), shape)
    code_rows = tl.broadcast_to(codes_ptr + _row_words(rows_n, stride_codes, TILED), shape)
    if X_WORDS:
        x_rows = tl.broadcast_to(x_ptr.to(tl.pointer_type(tl.int64)) + rows_m * (stride_xm // 4), shape)
    else:
        x_rows = tl.broadcast_to(x_ptr + rows_m * stride_xm, shape)

    # The first escape block's row pointers load before the loop (ESC_AHEAD), the rest after it.
    e0, e_end, idx, val, xg, nw = _escape_ahead_init(esc_idx_ptr, BLOCK_M, ESC_BLOCK)
    if ESC_AHEAD and not LANES:
        e0, e_end, idx, val, xg, nw = _escape_stage(
            0, e0, e_end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, x_ptr,
            offs_m, mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, False,
        )
    if LANES:
        lanes = _lanes_load(lanes_ptr, rows_n, LANES, BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_W), dtype=tl.float32)  # reduced once, after the loop
    full_words = n_words - n_words % BLOCK_W
    for start in range(0, full_words, BLOCK_W):
        acc = _gemv_chunk(acc, start, sm_rows, code_rows, x_rows, n_words, BLOCK_W, X_WORDS, False, ASM, TILED)
    if LANES:  # x at the lanes' columns, after the loop (before it, the lanes' load would stall the loop's start)
        spur, esc = _lanes_gather(lanes, x_ptr, x_ptr, rows_m, stride_xm, K, 1.0, False, y_ptr.dtype.element_ty, False)
    else:
        e0, e_end, idx, val, xg, nw = _escape_stages_left(
            1 if ESC_AHEAD else 0, e0, e_end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr,
            x_ptr, offs_m, mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, False,
        )
    if not EVEN_K:
        acc = _gemv_chunk(acc, full_words, sm_rows, code_rows, x_rows, n_words, BLOCK_W, X_WORDS, True, ASM, TILED)
    if LANES:  # scales the sums to y's
        out = _lanes_finish(acc, spur, esc, y_scale)
    else:
        out = _escapes_ahead(  # scales the sums to y's
            tl.sum(acc, axis=2), e0, e_end, idx, val, xg, nw, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n,
            K, stride_xm, stride_xk, ESC_BLOCK, x_ptr, 1.0, False, y_ptr.dtype.element_ty, False, y_scale,
        )
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, out.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class U12Config:
    """One launch configuration; block_w counts 32-bit words of the byte plane (4 weights each).

    kernel "tile": ``_u12_linear_kernel`` (any M, split-K, both decodes); "gemv2": ``_u12_gemv_kernel``
    (M <= 4, no split-K, ``decode`` unused); "mma": ``kernels/u12_mma.py`` (any M, split-K, ``decode``
    unused); "hmma": ``kernels/u12_hmma.py`` (1 <= M <= 64 rows of bf16 x, split-K, block_n 16 or 32
    rows a warp, block_w a multiple of 16). ``u12_linear`` runs gemv2, mma and hmma where they apply
    (K % 4 == 0, 1 <= base <= 240, and their M) and otherwise replaces them by the tile kernel's
    default config.
    """

    block_n: int
    block_w: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    decode: str = "pairs"  # or "single": one weight per 32-bit op (the scaled decode only)
    kernel: str = "tile"  # or "gemv2", "mma", "hmma"
    maxnreg: int = 0  # registers a thread ptxas may use (PTX .maxnreg; gemv2, mma, hmma on the GPU); 0: its choice
    ahead: bool = False  # hmma: the register double buffer (kernels/u12_hmma.py's AHEAD) for this shape
    ahead_x: bool = False  # hmma with ahead: the next chunk's x prefetched into L1 (u12_hmma.AHEAD_X)
    esc_split: bool = False  # hmma, split-K: the splits walk the table's escapes (u12_hmma.ESC_SPLIT) for this shape
    warp_k: bool = False  # hmma: the warps share block_n rows (16 or 32) and split the words (u12_hmma.WARP_K)
    w_cache: str = ""  # hmma: the weight loads' cache policy (u12_hmma.W_CACHE_MODES: "ca", "cg", "ef"); "": the module's

    def __post_init__(self) -> None:
        if self.decode not in ("pairs", "single"):
            raise ValueError(f"U12Config.decode: expected 'pairs' or 'single', got {self.decode!r}")
        if self.kernel not in ("tile", "gemv2", "mma", "hmma"):
            raise ValueError(f"U12Config.kernel: expected 'tile', 'gemv2', 'mma' or 'hmma', got {self.kernel!r}")
        if (self.ahead or self.ahead_x or self.esc_split or self.warp_k or self.w_cache) and self.kernel != "hmma":
            raise ValueError(f"U12Config: ahead, ahead_x, esc_split, warp_k and w_cache are the hmma kernel's, "
                             f"got kernel {self.kernel!r}")
        if self.w_cache not in ("", "ca", "cg", "ef"):
            raise ValueError(f"U12Config.w_cache: expected '' (u12_hmma.W_CACHE's), 'ca', 'cg' or 'ef', got {self.w_cache!r}")
        if self.kernel == "hmma" and (self.rows_a_warp() not in (16, 32) or self.block_w % 16 or self.block_w <= 0):
            rows = "16 or 32" if self.warp_k else f"{16 * self.num_warps} or {32 * self.num_warps} at {self.num_warps} warps"
            raise ValueError(f"U12Config: the hmma kernel takes block_n 16 or 32 rows a warp ({rows}) and "
                             f"block_w a multiple of 16, got block_n {self.block_n}, block_w {self.block_w}")
        if self.ahead_x and not self.ahead:
            raise ValueError("U12Config.ahead_x: the x prefetch goes with the double buffer: expected ahead=True")
        if self.ahead and (self.rows_a_warp() != 16 or self.block_w > 32):
            raise ValueError(f"U12Config.ahead: the double buffer takes one m-tile a warp (16 rows) and "
                             f"block_w <= 32, got {self.rows_a_warp()} rows a warp, block_w {self.block_w}")
        if self.kernel == "gemv2" and self.split_k != 1:
            raise ValueError(f"U12Config.split_k: the gemv2 kernel has no split-K, got {self.split_k}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"U12Config.maxnreg: expected 0 (the compiler's choice) or 24..255, got {self.maxnreg}")

    def rows_a_warp(self) -> float:
        """W rows each warp multiplies (hmma): block_n with warp_k (every warp on them), else its share."""
        return self.block_n if self.warp_k else self.block_n / self.num_warps

    def launch_options(self, native: bool, fp_fusion: bool = True) -> dict:
        """num_warps, num_stages and (native) fp fusion and maxnreg where set, as Triton's launch
        options. Fusion is the default Triton 3.6-3.9 compiles with, asked for by name because 3.10
        turns the default off (3.9 warns): the loops' multiply-adds stay FMAs. Off (fp_fusion False)
        for u12_fused_linear's epilogues, as fused_linear: Σ · (1/K) + eps and 1 + exp(-g) round as
        torch's do."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if native:
            opts["enable_fp_fusion"] = fp_fusion
        if native and self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def __str__(self) -> str:
        regs = f"-r{self.maxnreg}" if self.maxnreg else ""
        if self.kernel == "gemv2":
            return f"gemv2-bn{self.block_n}-bw{self.block_w}-w{self.num_warps}-s{self.num_stages}{regs}"
        if self.kernel in ("mma", "hmma"):
            knobs = "-wk" * self.warp_k + "-ahead" * self.ahead + "-x" * self.ahead_x + "-escsplit" * self.esc_split
            knobs += f"-w{self.w_cache}" if self.w_cache else ""
            return (f"{self.kernel}-bn{self.block_n}-bw{self.block_w}-sk{self.split_k}-w{self.num_warps}"
                    f"-s{self.num_stages}{regs}{knobs}")
        return f"bn{self.block_n}-bw{self.block_w}-sk{self.split_k}-w{self.num_warps}-s{self.num_stages}-{self.decode}"


SM_COUNT_H200 = 132

# The benchmark's sweep (bench/u12_linear.py crosses each tile with split_k in SPLIT_KS); the GEMV
# tiles keep the [BM, BN, 4 BW] fp32 accumulator within 64 registers a thread at BM = 4 (16 at BM = 1).
SWEEP_GEMV = [
    U12Config(8, 64, num_warps=4), U12Config(16, 32, num_warps=4), U12Config(16, 64, num_warps=8),
    U12Config(4, 128, num_warps=4), U12Config(32, 32, num_warps=8), U12Config(8, 64, num_warps=4, num_stages=3),
]
SWEEP_DOT = [
    U12Config(64, 16, num_warps=4), U12Config(64, 32, num_warps=4), U12Config(128, 16, num_warps=8),
    U12Config(128, 32, num_warps=8), U12Config(64, 32, num_warps=4, num_stages=3),
]
SPLIT_KS = (1, 2, 4, 8)
# The gemv2 sweep (M <= 4; bench/u12_linear.py keeps the configs within 64 accumulator registers a
# thread, gemv2_acc_registers). Grouped by the words a thread decodes a chunk, block_n · block_w /
# (32 · warps): more words a thread spread the loop's fixed instructions over more weights. In the
# sm_90 SASS (triton 3.9) num_stages 1 to 4 compiled to the same loop, so only two configs vary it,
# in case the H200's Triton pipelines these loads.
SWEEP_GEMV2 = [
    U12Config(bn, bw, num_warps=w, num_stages=1, kernel="gemv2") for bn, bw, w in (
        (8, 256, 2), (16, 256, 4), (16, 128, 2), (32, 128, 4), (32, 256, 8), (32, 64, 2),  # 32 words
        (4, 256, 2), (8, 256, 4), (8, 128, 2), (16, 128, 4), (16, 256, 8), (16, 64, 2),  # 16 words
        (32, 64, 4), (32, 128, 8),
        (4, 128, 2), (4, 256, 4), (8, 128, 4), (8, 256, 8), (16, 64, 4), (32, 32, 4),  # 8 words
        (4, 128, 4), (8, 64, 4),  # 4 words
        (4, 256, 1), (8, 128, 1), (4, 128, 1), (2, 256, 1),  # one warp a program: 32, 32, 16, 16 words
    )
] + [
    U12Config(16, 256, num_warps=4, num_stages=3, kernel="gemv2"),
    U12Config(8, 256, num_warps=4, num_stages=3, kernel="gemv2"),
]
# Tried for tiled weights and dropped (5ba8e66): 16 and 32 words a row, so that a warp's load covers 8
# (4) rows' 64-byte runs of a tile, at 16-64 rows and 2-8 warps. Far slower at one row on the H200
# (bench/results/u12_linear_gemv2_tiles_h200.json: down 64-164 µs against 26.8 at the best tiled
# config and 23.8 on rows; gate_up 47.7-60.8 against 46.8 and 43.4).
# The mma sweep (3 rows up; bench/u12_linear.py crosses each with SPLIT_KS_MMA), chosen from the sm_90
# compile (triton 3.6) and swept on the H200 at M = 16 (bench/results/u12_linear_mma_h200.json). block_n >= 64 a warp group (wgmma's M), so block_n 64 runs
# 4 warps only (8 would decode each weight twice). No loop spills at BLOCK_M 16, 32 or 64; at 64 the
# block_n 128 (4 warps) and 256 tiles spill in the epilogue. The loop issues 12-19 instructions a word
# at BLOCK_M 16 (the most words a thread, the fewest), 15-28 at 64 (x's planes grow with BLOCK_M).
# Shared memory: (stages - 1) chunks of 6 bytes a word in flight plus x, 18-120 KB at BLOCK_M 16.
SWEEP_MMA = [
    U12Config(bn, bw, num_warps=w, num_stages=s, kernel="mma") for bn, bw, w, s in (
        (64, 16, 4, 3), (64, 16, 4, 4), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3),
        (128, 16, 4, 3), (128, 16, 4, 4), (128, 16, 8, 3), (128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 8, 3),
        (128, 32, 8, 4), (128, 64, 8, 2), (128, 64, 8, 3),
        (256, 16, 4, 3), (256, 16, 8, 3), (256, 16, 8, 4), (256, 32, 8, 2), (256, 32, 8, 3),
    )
]
SPLIT_KS_MMA = (1, 2, 4)
# The hmma sweep (3 <= M <= 16; bench/u12_linear.py crosses each with SPLIT_KS_HMMA): one or two
# m-tiles (16 rows of W) a warp, 1 to 4 warps, chunks of 16 to 64 words a row (a quad reads them
# contiguous), and register budgets. sm_90 ptxas (triton 3.6): 12.6-14.8 loop instructions a word,
# no shared memory, shuffle or barrier in the loop; at its own choice 79-90 registers (one m-tile a
# warp) and 111-112 (two), and at 64 words a row it issues 8 of the chunk's 32 loads before the
# first MMA, 24 at 168 registers (144 used); no loop spill at 64 (one m-tile) or 96 (two).
SWEEP_HMMA = [
    U12Config(bn, bw, num_warps=w, num_stages=1, kernel="hmma", maxnreg=r) for bn, bw, w, r in (
        (16, 16, 1, 0), (64, 16, 4, 0), (64, 32, 4, 0), (16, 64, 1, 0), (32, 64, 2, 0), (64, 64, 4, 0),  # 1 m-tile
        (16, 64, 1, 168), (32, 64, 2, 168), (64, 64, 4, 168), (64, 32, 4, 128),
        (64, 32, 4, 168),
        (32, 16, 1, 0), (64, 16, 2, 0), (32, 64, 1, 0), (64, 64, 2, 0), (32, 64, 1, 200), (64, 64, 2, 200),  # 2
        (64, 32, 2, 128), (128, 32, 4, 128), (128, 32, 4, 168),
        (64, 32, 4, 96), (64, 32, 4, 80),  # 5 and 6 programs an SM (sm_90 ptxas, triton 3.6: no spill at either)
    )
]
SPLIT_KS_HMMA = (1, 2, 4, 8)

# Best configs measured by bench/u12_linear.py on the H200, keyed (BLOCK_M, N, K): Llama-3.1-8B's
# linear shapes. (The 4-row entries are gemv2's at 3..4 rows: ``gemv_config``, for u12_fused_linear's
# GEMV, fp32 x, and bf16 x where TENSOR_CORE_ROWS is raised past 4.) M = 1, 4: the gemv2 sweep
# (commit 34c2fbf; bench/results/u12_linear_gemv2_h200.json), where gemv2 beat the tile kernel on every row; its o rows are not used: every config there, the tile
# kernel's included, ran ~75 µs where the tile kernel had run 26 µs before and o in the whole-step
# graph runs far below that. M = 16: the mma sweep (bench/results/u12_linear_mma_h200.json), o and
# down from the hmma sweep timed in CUDA graphs (bench/results/tried/u12_linear_hmma_ed31e59_h200.json:
# 17.0 and 39.5 µs against 23.7 and 43.9 for the mma configs; bench/results/u12_linear_hmma_h200.json,
# 89d4609: the mma configs still win qkv, gate_up and lm_head, by 3%, 5% and 10%). M = 1 qkv and o: 4 words a thread (every lane's
# 16-byte loads side by side) from the whole u12 step interleaved (bench/step_ab.py, commit ac79ccb:
# 3.674 ms against 3.701 with 8 words; 4 words for every linear ran 3.870, for gate_up alone 3.745).
# M = 1 o, gate_up and lm_head: the gemv2 sweep timed in CUDA graphs (bench/u12_linear.py --ms 1
# --graph, bench/results/tried/u12_linear_gemv2_graph_1f0a597_h200.json, commit 1f0a597: 9.9, 45.4
# and 180.3 µs against 10.1, 46.2 and 207.5), taken after the AR step interleaved (bench/step_ab.py --u12-tuned,
# bench/results/step_ab_u12_tuned_h200.json): 3.626 ms against 3.648. The sweep again with the
# escapes from the lanes (bench/results/u12_linear_gemv2_graph_h200.json, 0cf1235) kept every M = 1
# tile but gate_up's (bn4-bw256-w2, 44.3 µs against 46.0); the step with it ran 3.501 ms against
# 3.427 (bench/results/tried/step_ab_0cf1235_h200.json), so TUNED keeps gate_up's.
# M = 32 and 64: the mma and tile sweep timed in CUDA graphs (bench/u12_linear.py --ms 32,64 --kernels
# mma,tile --graph, bench/results/u12_linear_mma_m32_64_graph_h200.json, commit 4cea20f): the mma
# kernel won every row, 0.41-1.13x cuBLAS against 0.30-0.68x for the tile kernel's configs before
# (M = 32 had no entry: the tile heuristic; e.g. gate_up 67.8 µs against 129.5).
TUNED: dict[tuple[int, int, int], U12Config] = {
    (1, 6144, 4096): U12Config(4, 128, num_warps=4, num_stages=1, kernel="gemv2"),  # qkv
    (4, 6144, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # qkv
    (16, 6144, 4096): U12Config(64, 64, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # qkv
    (32, 6144, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # qkv
    (64, 6144, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=4, kernel="mma"),  # qkv
    (1, 4096, 4096): U12Config(8, 256, num_warps=4, num_stages=1, kernel="gemv2"),  # o
    (4, 4096, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # o: qkv's (see above)
    (16, 4096, 4096): U12Config(64, 32, split_k=8, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # o
    (32, 4096, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # o
    (64, 4096, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # o
    (1, 28672, 4096): U12Config(16, 64, num_warps=2, num_stages=1, kernel="gemv2"),  # gate_up
    (4, 28672, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # gate_up
    (16, 28672, 4096): U12Config(64, 32, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (32, 28672, 4096): U12Config(64, 64, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (64, 28672, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (1, 4096, 14336): U12Config(4, 256, num_warps=4, num_stages=1, kernel="gemv2"),  # down
    (4, 4096, 14336): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # down
    (16, 4096, 14336): U12Config(64, 32, split_k=8, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # down
    (32, 4096, 14336): U12Config(64, 64, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # down
    (64, 4096, 14336): U12Config(64, 32, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # down
    (1, 128256, 4096): U12Config(2, 256, num_warps=1, num_stages=1, kernel="gemv2"),  # lm_head
    (4, 128256, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # lm_head
    (16, 128256, 4096): U12Config(64, 64, num_warps=4, num_stages=3, kernel="mma"),  # lm_head
    (32, 128256, 4096): U12Config(64, 64, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # lm_head
    (64, 128256, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=4, kernel="mma"),  # lm_head
}

# The best configs for tiled weights (U12Tensor.layout "tiles") at 3..16 rows, keyed (16, N, K): the
# hmma kernel won every Llama-3.1-8B shape on them at M = 16, each against cuBLAS bf16 and the row
# planes' best (H200, CUDA graphs, bench/u12_linear.py --ms 16 --kernels mma,hmma,stream at a291905;
# bench/results/u12_linear_tiles_h200.json): qkv 19.1 µs (rows: mma 19.5), o 15.9 (hmma 16.9),
# gate_up 52.0 (mma 64.4), down 35.6 (hmma 40.4), lm_head 202 (mma 218); cuBLAS 15.4, 12.7, 58.5,
# 32.4, 284. The step's linears in one graph: 4.10 ms against cuBLAS's 4.08. verify(16) interleaved
# with every weight tiled (bench/step_ab.py's u12-tiles, 753d9c4): 4.613 ms against the bf16 step's
# 4.446 and the row planes' 5.151 (bench/results/tried/step_ab_verify16_753d9c4_h200.json; at 0bc2353
# 4.637, 4.510 and 5.262: bench/results/tried/step_ab_verify16_0bc2353_h200.json); the AR step on tiles ran 3.820
# against 3.405 (tried/step_ab_753d9c4_h200.json; 3.811 against 3.402 at 0bc2353): gemv2 reads tiles 4-12% slower at one row, each shape
# at its best config on either (bench/results/u12_linear_gemv2_tiles_h200.json, 5ba8e66), hence a
# layout per deployment (weights-u12's auto). From 32 rows the mma kernel reads both alike (qkv's
# best: 21.9 µs on tiles against 21.4 at 32 rows, 38.8 against 38.9 at 64;
# bench/results/u12_linear_mma_tiles_m32_64_h200.json, the other shapes past its time budget).
# The layer shapes in 32-row programs of 2 warps since b5fd050 (the same warps in flight, twice the
# programs; 64 rows and 4 warps before, qkv at 168 registers): on the H200
# (c566ca9, bench/results/u12_hmma_knobs_w2_h200.json, CUDA graphs) o 12.32 µs against 12.67, down
# 30.33 / 31.16, qkv 16.16 / 16.28, gate_up 51.05 / 51.13; on an H100 each shape faster too
# (u12_hmma_knobs_w2_h100.json); verify(16) interleaved on the H200 4.238 ms against 4.306 the plain
# way, 4.175-4.177 against 4.219-4.221 in the fused way in PDL mode 2 (bench/results/step_ab_verify16_h200.json
# and tried/step_ab_verify16_before_wait_b0165d5_h200.json); on an H100 5.151 against 5.272 the plain way
# (aceaf62, tried/step_ab_verify16_aceaf62_h100.json). bench/step_ab.py's u12-tiles-w4 keeps the 64-row configs.
TUNED_TILES: dict[tuple[int, int, int], U12Config] = {
    (16, 6144, 4096): U12Config(32, 64, split_k=4, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # qkv
    (16, 4096, 4096): U12Config(32, 32, split_k=8, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # o
    (16, 28672, 4096): U12Config(32, 32, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # gate_up
    (16, 4096, 14336): U12Config(32, 32, split_k=8, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # down
    (16, 128256, 4096): U12Config(128, 32, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # lm_head
}

_INTERPRETER_CONFIG = U12Config(16, 8, split_k=2)  # small tiles; split-K exercised on the CPU too
_ESC_BLOCK = 16
# The GEMVs (gemv2, u12_fused_linear) load their first escape block's row pointers before the loop
# (``_escape_stage``); off, all three of its loads run after it. Read at launch (bench/step_ab.py
# compares the two).
ESC_AHEAD = True
# Where the u12 kernels find their escapes: "gemv" (the GEMVs from ``U12Tensor.esc_lanes`` where the
# weight has them, the block kernels tile, mma and hmma from the table), "lanes" (every kernel from
# the lanes) or "table" (every kernel from the CSR side table; in the GEMVs as ESC_AHEAD says). On the
# H200 (bench/step_ab.py, 451e309) the lanes won the AR step (3.438 ms against 3.551 from the table,
# bench/results/tried/step_ab_451e309_h200.json) and lost verify(16) (5.543 against 5.250,
# bench/results/tried/step_ab_verify16_451e309_h200.json; again at 3353acd, 5.158 against 5.442:
# bench/results/tried/step_ab_verify16_3353acd_h200.json; at 0bc2353 5.262 against 5.555,
# bench/results/tried/step_ab_verify16_0bc2353_h200.json), hence
# "gemv". Read at launch; SPECPILOT_ESC_LANES sets it for a process.
ESC_LANES = os.environ.get("SPECPILOT_ESC_LANES", "gemv")
_LANE_MODES = ("gemv", "lanes", "table")
# The block kernels (tile, mma, hmma) walk a block's lanes this many at a time after their loop:
# each step's lane loads, then its x gathers, all in flight at once. More lanes a step, fewer round
# trips and more registers, which with split-K 1 the loop's occupancy pays for. Read at launch;
# bench/step_ab.py's verify variants compare.
LANE_GROUP = 4


def lane_group(n_lanes: int) -> int:
    """Lanes a step of the block kernels' escape walk (``LANE_GROUP``, at most the weight's)."""
    if LANE_GROUP not in (1, 2, 4, 8, 16):
        raise ValueError(f"u12_linear.LANE_GROUP: expected 1, 2, 4, 8 or 16, got {LANE_GROUP!r}")
    return max(1, min(n_lanes, LANE_GROUP))


def lanes_args(t: U12Tensor, block: bool = False) -> tuple[torch.Tensor, int]:
    """(the lanes pointer, the launch's LANES) for a kernel on t by ESC_LANES (`block`: a tile, mma
    or hmma launch, else a GEMV): LANES 0 (the table, and a pointer the kernel does not read) where
    the mode says the table, t has no lanes or has not derived them yet inside a CUDA graph capture."""
    if ESC_LANES not in _LANE_MODES:
        raise ValueError(f"u12_linear.ESC_LANES: expected one of {_LANE_MODES}, got {ESC_LANES!r}")
    # Lanes are derived on first use, with a host sync a CUDA graph capture does not allow: a launch
    # captured before any eager one walks the table (as exact, slower).
    capturing = t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    wanted = ESC_LANES == "lanes" or (ESC_LANES == "gemv" and not block)
    use = wanted and (not capturing or "esc_lanes" in t.__dict__)
    lanes = t.esc_lanes if use else None
    return (t.esc_row_ptr, 0) if lanes is None else (lanes, lanes.shape[1])


def epilogue_args(x: torch.Tensor, y: torch.Tensor, native: bool, parts_out: int, gated: bool = False,
                  residual: bool = False, hand_in=None, hand_out=None) -> tuple[tuple, dict, bool]:
    """The mma and hmma kernels' arguments for kernels/u12_fused_linear.py's epilogue: (hw, xg, parts,
    n_out, inv_k, eps, n_parts, stride_xg) in their order, placeholders of the right types where
    unused; the constexpr flags; and whether any epilogue runs (then without fp fusion:
    ``U12Config.launch_options``). hand_out (a ``NormHandoff``) gets its xg and `parts_out` parts
    allocated here."""
    hw, xg, parts, n_parts, eps = x, x, y, 0, 0.0
    if hand_out is not None:
        hand_out._alloc(y, parts_out)
        hw, xg, parts, eps = hand_out.weight.contiguous(), hand_out.xg, hand_out.parts, hand_out.eps
    elif hand_in is not None:
        parts, n_parts, eps = hand_in.parts, hand_in.parts.shape[0], hand_in.eps
    flags = dict(GATED=gated, RESIDUAL=residual, HAND_IN=hand_in is not None, HAND_OUT=hand_out is not None,
                 # a chunk of parts: all 1024 at once held the registers of a tile
                 BLOCK_P=min(256, triton.next_power_of_2(max(1, n_parts))),
                 ROUND_BF16=not native and x.dtype == torch.bfloat16, EXPF=native)
    fused = gated or residual or hand_in is not None or hand_out is not None
    return (hw, xg, parts, y.shape[1], 1.0 / x.shape[1], eps, n_parts, xg.stride(0)), flags, fused


def _block_m(m: int) -> int:
    """Rows of x per program: up to 4 on the multiply-and-sum path, else 16..64 for tl.dot."""
    if m <= 4:
        return triton.next_power_of_2(m)
    return min(64, max(16, triton.next_power_of_2(m)))


# From this many rows of x up, default_config takes the tensor-core configs (TUNED's 16-row ones:
# mma for qkv, gate_up and lm_head, hmma for o and down) where the shape has them, not gemv2's, whose
# per-row FMAs grow with M while a tensor-core kernel's cost barely moves below 16 rows. On the H200
# the u12 verify(4) step, gemv2 at four rows, ran 6.344 ms against the bf16 step's 4.572 (0.72x), and
# verify(8), the 16-row configs at eight rows, 5.109 against 4.643 (0.91x), interleaved at 4cea20f
# (bench/results/tried/step_ab_verify{4,8}_4cea20f_h200.json): the 16-row configs at 8 rows took 1.2 ms less
# than gemv2 at 4 (and verify(8) does more attention). Three rows run gemv2's 4-row block (the same
# cost as four), two its 2-row one, which no step has timed against them. At 3353acd verify(4) ran
# 4.877 ms this way against 6.009 with gemv2 (bench/results/step_ab_verify4_h200.json). Read at call
# time (bench/step_ab.py's verify(4) variants compare).
TENSOR_CORE_ROWS = 3
# Up to this many rows a tiled weight takes TUNED_TILES' (16-row) hmma config: past 16 the hmma
# kernel runs blocks of 16 rows side by side, each W block's programs neighbours so that W comes
# from DRAM once (u12_hmma.MAX_M), where the mma kernel (TUNED's 32-row configs) reads it once but
# through shared memory. H100 verify(32) (c82ea2b, bench/results/step_ab_verify32_wide_h100.json):
# 6.333 ms against 7.021 with the mma kernel past 16 rows. Read at call time.
TILES_MAX_ROWS = 32


def gemv_config(m: int, n: int, k: int) -> U12Config:
    """gemv2's config at M <= 4 rows: TUNED's at the rows' bucket where measured, or at the nearest
    measured shape (kernels/tuning.py), else the tiles that won most of the H200 sweep (u12_linear
    falls back to the tile kernel where gemv2 does not apply)."""
    tuned = nearest_tuned(TUNED, (_block_m(m), n, k))
    if tuned is not None and tuned.kernel == "gemv2":
        return tuned
    return U12Config(8, 128, num_warps=2, num_stages=1, kernel="gemv2") if m == 1 else \
        U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2")


def default_config(m: int, n: int, k: int, on_gpu: bool = True, layout: str = "rows") -> U12Config:
    """On a GPU: below TENSOR_CORE_ROWS rows gemv2 (``gemv_config``); from there to 4 rows TUNED's
    tensor-core config at the rows' bucket or else at 16 rows where the shape has one, else gemv2;
    above, TUNED at the rows' bucket where measured or at the nearest measured shape
    (kernels/tuning.py), else the tile kernel's heuristic (``_tile_config``). A tiled weight
    (`layout` "tiles") takes TUNED_TILES' entry first from TENSOR_CORE_ROWS rows up to TILES_MAX_ROWS (past
    16 rows its 32-row entry where it has one, else the 16-row one). Under
    the interpreter the tile kernel's small tiles."""
    if not on_gpu:
        return _tile_config(m, n, k, on_gpu)
    if layout == "tiles" and TENSOR_CORE_ROWS <= m <= TILES_MAX_ROWS:
        for bucket in (32, 16) if m > 16 else (16,):  # past 16 rows a 32-row entry where measured
            tuned = nearest_tuned(TUNED_TILES, (bucket, n, k))
            if tuned is not None:
                return tuned
    if m <= 4:
        for bucket in (_block_m(m), 16) if m >= TENSOR_CORE_ROWS else ():  # a few-row entry first
            tuned = nearest_tuned(TUNED, (bucket, n, k))
            if tuned is not None and tuned.kernel in ("mma", "hmma"):
                return tuned
        return gemv_config(m, n, k)
    tuned = nearest_tuned(TUNED, (_block_m(m), n, k))
    return tuned if tuned is not None else _tile_config(m, n, k, on_gpu)


def _tile_config(m: int, n: int, k: int, on_gpu: bool) -> U12Config:
    """The tile kernel's heuristic: enough programs for ~8 (GEMV) or ~2 (dot) a SM."""
    if not on_gpu:
        return _INTERPRETER_CONFIG
    block_m = _block_m(m)
    if block_m <= 4:  # 32 (BM = 1, 2) or 64 (BM = 4) accumulator registers a thread
        # no split-K: on the H200 sweep split_k = 1 won every GEMV row (M = 1, 4; five shapes), the
        # heuristic's split-K default ran 0.22-0.97x cuBLAS where the best ran 0.69-0.97x
        return U12Config(16 if block_m <= 2 else 8, 64, num_warps=4)
    tile, per_sm = U12Config(64, 32, num_warps=4), 2
    n_blocks = triton.cdiv(n, tile.block_n) * triton.cdiv(m, block_m)
    split = max(1, min(8, SM_COUNT_H200 * per_sm // n_blocks, triton.cdiv(k, 4 * tile.block_w * 4)))
    return dataclasses.replace(tile, split_k=split)


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even when the escape table is empty."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def split_counters(owner, size: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters of the split-K semaphore, kept with `owner` (a U12Tensor, or a weight's
    storage, so views of one concatenated weight share them); the kernels leave them 0. A larger
    request allocates a new buffer and keeps the old ones alive (a captured CUDA graph may still
    point at them). Shared by u12_linear, u12_mma and fused_linear."""
    bufs = _COUNTERS.setdefault(owner, [])
    if not bufs or bufs[-1].numel() < size:
        bufs.append(torch.zeros(max(size, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def aligned_rows(x: torch.Tensor, words: bool) -> torch.Tensor:
    """x with unit stride along its rows and, for `words` (read as int64 words of 4 bf16), a row
    stride % 4 == 0 and an 8-byte aligned start; copied if not."""
    ok = x.stride(-1) == 1 and (not words or (x.data_ptr() % 8 == 0 and (x.dim() == 1 or x.stride(0) % 4 == 0)))
    return x if ok else x.clone(memory_format=torch.contiguous_format)


def _scales(base: int) -> tuple[bool, float, float, float]:
    """(scaled, x scale, y scale lo, y scale hi): y = (x 2^64 · w 2^-(base-1)) 2^(base-65)."""
    if not 1 <= base <= MAX_BASE - 1:
        return False, 1.0, 1.0, 1.0
    q = base - 1 - X_SCALE_LOG2  # in -64 .. 175: two factors keep each within fp32
    lo = min(q, 100)
    return True, 2.0**X_SCALE_LOG2, 2.0**lo, 2.0 ** (q - lo)


def biased_scale(base: int) -> float:
    """y's scale in the biased decode (gemv2, u12_fused_linear; 1 <= base <= 240): a weight
    decodes to w' = w · 2^(113-base), so y = (Σ x w') · 2^(base-113), a normal fp32 for every such base."""
    return 2.0 ** (base - 1 - EXP_BIAS)


def words_and_scales(k: int, base: int) -> bool:
    """Whether a weight can run the gemv2, mma and hmma kernels: word loads (K % 4 == 0) and a base
    their decodes scale back exactly (1 <= base <= 240)."""
    return k > 0 and k % 4 == 0 and _scales(base)[0]


def gemv2_applies(m: int, k: int, base: int) -> bool:
    """Whether a gemv2 config runs the gemv2 kernel: M <= 4 and ``words_and_scales``."""
    return m <= 4 and words_and_scales(k, base)


def gemv2_acc_registers(cfg: U12Config, block_m: int) -> int:
    """fp32 accumulator registers a thread of the gemv2 kernel holds: [BM, BN, BW] over 32 · warps threads."""
    return block_m * cfg.block_n * cfg.block_w // (32 * cfg.num_warps)


def _launch_gemv2(x: torch.Tensor, t: U12Tensor, y: torch.Tensor, cfg: U12Config) -> None:
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
        _nonempty(t.esc_idx), _nonempty(t.esc_val), t.esc_row_ptr, lanes, y,
        m, n, k, n_words, biased_scale(t.base),
        x.stride(0), x.stride(1), n_words, n_words, y.stride(0),
        BLOCK_M=_block_m(m), BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=_ESC_BLOCK,
        X_WORDS=x_words, EVEN_K=n_words % cfg.block_w == 0,
        # inline PTX on the GPU; the interpreter (TRITON_INTERPRET=1, read by Triton at import) runs none
        ASM=native, **cfg.launch_options(native), **pdl_args(x.device), ESC_AHEAD=ESC_AHEAD, LANES=n_lanes,
        TILED=t.layout == "tiles",
    )


def _split_k_plan(t: U12Tensor, cfg: U12Config, m: int, n_words: int, block_m: int, slots: int = 1,
                  chunk: int = 0):
    """(grid (N blocks, splits, M blocks), words per split, fp32 partials, counters) of a split-K launch:
    each split a whole number of chunks (block_w words unless `chunk` says), none empty; slots
    partials a split (2: the hmma kernel's ``ESC_SPLIT``); with one split the two buffers are
    placeholders (unused; an fp32 and an int32 pointer keep the compiled types)."""
    n = t.shape[0]
    chunk = chunk or cfg.block_w
    split = max(1, min(cfg.split_k, triton.cdiv(n_words, chunk)))
    words_per_split = triton.cdiv(triton.cdiv(n_words, split), chunk) * chunk if n_words else 1
    split = max(1, triton.cdiv(n_words, words_per_split))  # no empty splits
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    if split > 1:
        part = torch.empty((slots * split, m, n), dtype=torch.float32, device=t.device)
        counters = split_counters(t, grid[0] * grid[2], t.device)
    else:
        counters = t.esc_row_ptr
        part = counters.view(torch.float32)
    return grid, words_per_split, part, counters


def u12_linear(x: torch.Tensor, t: U12Tensor, config: U12Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) times the u12 weight [N, K] transposed: [M, N] in x.dtype, fp32 accumulation."""
    n, k = t.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"u12_linear: x must be [M, {k}], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"u12_linear: x must be bfloat16 or float32, got {x.dtype}")
    if x.device != t.device:
        raise ValueError(f"u12_linear: x on {x.device}, weight on {t.device}")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y

    cfg = config or default_config(m, n, k, on_native(x), t.layout)
    if config is None and m <= 4 and cfg.kernel in ("mma", "hmma") and x.dtype != torch.bfloat16:
        cfg = gemv_config(m, n, k)  # TENSOR_CORE_ROWS's configs are bf16 x's (hmma takes no other): gemv2, as before
    scaled, x_scale, y_lo, y_hi = _scales(t.base)
    if cfg.kernel == "gemv2" and gemv2_applies(m, k, t.base):
        _launch_gemv2(x, t, y, cfg)
        return y
    if cfg.kernel == "mma":
        from .u12_mma import launch_mma, mma_applies  # here: u12_mma imports this module's helpers
        if mma_applies(m, k, t.base):
            launch_mma(x, t, y, cfg)
            return y
    if cfg.kernel == "hmma":
        from .u12_hmma import hmma_applies, launch_hmma
        if hmma_applies(x, k, t.base):
            launch_hmma(x, t, y, cfg)
            return y
    if cfg.kernel != "tile":  # gemv2, mma or hmma where they do not apply (M, K % 4, base): the tile kernel's default
        cfg = _tile_config(m, n, k, on_native(x))
    block_m = _block_m(m)
    use_dot = block_m >= 16
    words = k % 4 == 0 and k > 0
    n_words = triton.cdiv(k, 4)
    grid, words_per_split, part, counters = _split_k_plan(t, cfg, m, n_words, block_m)
    split = grid[1]
    sm, codes = t.sm.contiguous(), t.codes.contiguous()
    lanes, n_lanes = lanes_args(t, block=True)
    _u12_linear_kernel[grid](
        x, sm.view(torch.int32) if words else sm, codes.view(torch.int16) if words else codes,
        _nonempty(t.esc_idx), _nonempty(t.esc_val), t.esc_row_ptr, lanes, y, part, counters,
        m, n, k, n_words, t.base, x_scale, y_lo, y_hi, words_per_split,
        x.stride(0), x.stride(1), n_words if words else k, n_words if words else codes.shape[1], y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, ESC_BLOCK=_ESC_BLOCK, SPLIT_K=split,
        PAIRS=cfg.decode == "pairs", WORDS=words, SCALED=scaled, USE_DOT=use_dot,
        DOT_BF16=use_dot and on_native(x) and x.dtype == torch.bfloat16,
        **cfg.launch_options(on_native(x)), **pdl_args(x.device),
        LANES=n_lanes, LANE_GROUP=lane_group(n_lanes), TILED=t.layout == "tiles",
    )
    return y


def u12_linear_reference(x: torch.Tensor, t: U12Tensor) -> torch.Tensor:
    """Unpack, multiply in fp32, cast to x.dtype."""
    return (x.to(torch.float32) @ unpack_u12(t).to(torch.float32).T).to(x.dtype)


# --- registry entry -------------------------------------------------------------------------

_SPECIALS = torch.tensor(
    [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0xBFC0, 0x2F00],  # ±0, subnormals, ±inf, NaN, 1, -1.5, 2^-33
    dtype=torch.int32,
)


def _make_inputs(case, device, seed):
    """x ~ N(0, 1) and W ~ N(0, 0.02) in bf16, W with planted escapes per ``case["escapes"]``.

    "none": as drawn; "few": a few weights set to ±1..2 or scaled by 2^-24 (exponents outside the
    bulk's window, 2^-18..2^-4; not larger, so that fp32 sums keep a useful relative tolerance);
    "special": ±0, subnormals, ±inf, NaN, large and tiny values planted; "all": packed with the
    base 241, whose window holds no finite weight, so every weight escapes.
    """
    g = torch.Generator().manual_seed(seed)
    m, n, k = case["M"], case["N"], case["K"]
    x = torch.randn(m, k, generator=g).to(case["dtype"])
    w = torch.randn(n, k, generator=g) * 0.02
    flat = w.view(-1)
    planted = torch.randint(0, n * k, (max(1, n * k // 50),), generator=g)
    base = None
    if case["escapes"] == "few":
        big = torch.arange(planted.numel()) % 2 == 0
        flat[planted] = torch.where(big, flat[planted].sign() * (1 + flat[planted].abs()), flat[planted] * 2.0**-24)
    w = w.to(torch.bfloat16)
    if case["escapes"] == "special":
        bits = _SPECIALS[torch.arange(planted.numel()) % len(_SPECIALS)]
        w.view(torch.int16).view(-1)[planted] = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    if case["escapes"] == "all":
        base = 241
    return x.to(device), pack_u12(w, base=base).to(device)


def _plant_wrong_weight(inputs):
    """Flip the sign of the weight that moves the output most (finite rows only)."""
    x, t = inputs
    w = unpack_u12(t).cpu()
    score = w.to(torch.float32).abs() * x.to(torch.float32).abs().amax(0).cpu()[None, :]
    score[~torch.isfinite(w).all(1)] = -1
    bits = w.view(torch.int16).clone()
    bits.view(-1)[int(score.argmax())] ^= -0x8000
    # Same base, so that the flipped weight stays where it was (in the planes or in the table).
    return x, pack_u12(bits.view(torch.bfloat16), base=t.base).to(t.device)


def _case(m, n, k, dtype, escapes):
    return {"M": m, "N": n, "K": k, "dtype": dtype, "escapes": escapes}


register(KernelSpec(
    name="u12_linear",
    run=u12_linear,
    reference=u12_linear_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(1, 1, 1, torch.bfloat16, "none"),
        _case(1, 7, 33, torch.bfloat16, "few"),
        _case(2, 33, 64, torch.float32, "special"),
        _case(3, 33, 257, torch.float32, "few"),
        _case(4, 67, 300, torch.bfloat16, "special"),
        _case(5, 17, 64, torch.bfloat16, "all"),
        _case(16, 64, 128, torch.float32, "few"),
        _case(17, 33, 257, torch.bfloat16, "few"),
        _case(33, 40, 96, torch.float32, "all"),
        _case(64, 65, 300, torch.bfloat16, "special"),
    ],
    # fp32: summation order only. bf16: the fp32 sums differ in order, so the final rounding may land
    # one bf16 step apart: up to 2^-7 relative (worst case measured on these cases under the
    # interpreter: 0.97 of 8e-3); atol covers the fp32 order error near zero at K <= 300.
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},
    corrupt=_plant_wrong_weight,
    description="y = x @ W.T, W in u12 planes decoded in registers, escapes added exactly",
))


_GEMV2_CHECK_CONFIG = U12Config(8, 16, num_warps=2, num_stages=1, kernel="gemv2")  # partial N blocks and K chunks below

register(KernelSpec(
    name="u12_gemv2",
    run=functools.partial(u12_linear, config=_GEMV2_CHECK_CONFIG),
    reference=u12_linear_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(1, 7, 36, torch.bfloat16, "none"),  # 9 words: a masked last chunk; N < BLOCK_N
        _case(1, 16, 128, torch.bfloat16, "few"),  # no masked chunk, N a multiple of BLOCK_N
        _case(2, 33, 64, torch.float32, "special"),
        _case(3, 33, 300, torch.float32, "few"),  # BLOCK_M 4: one re-read row of x
        _case(4, 67, 300, torch.bfloat16, "special"),
        _case(4, 24, 256, torch.bfloat16, "few"),
        _case(2, 9, 33, torch.bfloat16, "few"),  # K % 4 != 0: the tile kernel
        _case(4, 17, 64, torch.bfloat16, "all"),  # base 241, not scaled: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=_plant_wrong_weight,
    description="u12_linear with a gemv2 config: M <= 4 rows against the planes, escapes added exactly",
))
