"""Attention for short queries (T new tokens, about 1-64) over a long KV cache, split over the cache.

Flash-decoding: a query block is too small to fill the GPU with one program per head, so the
cached keys are cut into `splits` contiguous chunks, and the T new tokens get a program of their
own. The grid is (row block, split, batch · kv head): splits 0..n-1 stream the cached slots,
split n the new tokens. Each program holds the T · group query rows of one kv head's GQA group
(head-major: row r = j·T + t is head kv_head·group + j, query t; at most BLOCK_M = 64 rows a
program, more rows take more row blocks, which read the same K/V tiles close in time, from L2),
streams its keys once in tiles with an online softmax in fp32, and writes its partial (max, sum,
unnormalised output); a second kernel combines the partials per row (combining them in the split
kernel's last program instead measured slower: _combine_kernel). With nothing cached the new
tokens' program is the only one and normalises itself.

With `rope` (kernels/rope_attention.py) q comes from the fused q|k|v projection and every
program ropes (and qk-norms) its query rows on load; the new tokens' program ropes their keys
from the projection too, attends to them there and, in row block 0, writes k and v into the
cache. The cached splits never read slots >= past, so no program waits on another's write.
q and k are held in a padded-halves layout (position c·BLOCK_H + h holds dim c·HALF + h, so
RoPE's pairs of dims h, HALF + h sit BLOCK_H apart and one dot spans the head dim).

Visibility: the T new tokens sit at key slots past..past+T-1; every cached slot
< past is visible to every query, and among the new tokens `mask` says: "causal" (query t sees
new tokens <= t), "full" (block non-causal: all of them), or a bool tensor [T, T] / [B, T, T]
(a tree: entry [t, u] says whether query t sees new token u). A query that sees no key at all
is undefined (a tree's mask holds its diagonal). Only the new tokens' program reads the mask.

`past` is an int (then S = past + T) or an int32/int64 device tensor [], [1] or [B] (one past per
batch row) for CUDA graphs: one captured launch serves every step. Then S is the cache capacity,
the grid (how many splits) is planned for it, and each program reads past and cuts the past cached
keys into those splits in whole tiles (cut for the capacity instead, a 16-token verify over 512
of 2048 slots ran 14.8 µs a layer against 11.3: bench/results/attention_variants_h200.json).
A split with no key left writes a neutral partial (m = -inf, l = 0) that the
combine weighs 0 (past COMBINE_CHUNK splits it cuts the keys as the splits did and reads only the
filled ones). Slots from past + T on are never read (they may hold anything, NaN included).

Numerics: q·kᵀ and p·v on tensor cores for bf16/fp16 (p rounded to the input dtype before the
p·v product, as FlashAttention does; the softmax sum keeps fp32 p), fp32 ("ieee") dots for fp32
inputs; max, sum and accumulator in fp32; the output is cast to q's dtype once. Under Triton's
interpreter every dot runs in fp32 (its bf16 dot is wrong), with p still rounded to the input
dtype, so interpreter runs check the GPU's rounding.

Splits (`split_count`): enough programs for two per SM, but no more splits than BLOCK_N tiles
in the cache, and few enough that the fp32 partials (written and read: 8 bytes per row per head
dim) stay under the bf16 K/V bytes read (4 bytes per key per head dim), i.e.
splits <= S / (2 · T · group). Each split covers a whole number of tiles (`plan`). BLOCK_N 64,
2 stages, NUM_WARPS 4; bench/kernels/attention_variants.py measures the choices, and
docs/experiments/attention-split-kv.md what was tried.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .overlap import Launch, pdl_args, pdl_enter
from .registry import KernelSpec, register
from .rope_kv import head_norm, rope_halves
from .rounding import round_bf16
from .target import native as on_native

BLOCK_M = 64  # query rows a program, at most
BLOCK_N = 64  # keys a tile
WAVES = 2  # programs per SM that the split rule aims for
NUM_WARPS = 4  # 8 measured slower in every shape (docs/experiments/tried/attention_variants_h200_98e7d7d.json)
COMBINE_CHUNK = 16  # more splits than this: the combine reads only the filled ones, this many at a time (_combine_kernel)
_CPU_SMS = 4  # nominal SM count under the interpreter, so that the rule still splits

_MASK_FULL, _MASK_CAUSAL, _MASK_TENSOR = 0, 1, 2


@triton.jit
def _join_rows(a, b, BLOCK_H: tl.constexpr):
    """[R, BLOCK_H] halves -> [R, 2·BLOCK_H]: a's columns, then b's (the padded-halves layout)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (a.shape[0], 2 * BLOCK_H))


@triton.jit
def _join_cols(a, b, BLOCK_H: tl.constexpr):
    """[BLOCK_H, C] halves -> [2·BLOCK_H, C]: a's rows, then b's (the padded-halves layout)."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * BLOCK_H, a.shape[1]))


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc, DOT_FP32: tl.constexpr, ROUND_BF16: tl.constexpr):
    """One tile of scores s (log2 domain, -inf where hidden) and values v into (max, sum, output)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = tl.math.exp2(s - m_base[:, None])
    alpha = tl.math.exp2(m_i - m_base)
    l_i = l_i * alpha + tl.sum(p, 1)
    if ROUND_BF16:
        p = round_bf16(p)
    p_lo = p.to(v.dtype)  # what the tensor cores multiply (a no-op for fp32)
    if DOT_FP32:
        acc = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p_lo, v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _roped(x1, x2, cos_ptr, sin_ptr, cs, ok, w_ptr, offs_h, eps, inv_d, HALF: tl.constexpr, AXIS: tl.constexpr,
           dt: tl.constexpr, QK_NORM: tl.constexpr, ROUND_BF16: tl.constexpr):
    """rope_qkv's math on fp32 halves of heads laid along AXIS (1: rows are heads, 0: columns are):
    qk-norm with weight w_ptr if QK_NORM, then RoPE with the cos/sin tables at offsets cs."""
    if QK_NORM:
        inv = tl.expand_dims(tl.math.rsqrt((tl.sum(x1 * x1, AXIS) + tl.sum(x2 * x2, AXIS)) * inv_d + eps), AXIS)
        w1 = tl.load(w_ptr + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_h, mask=offs_h < HALF, other=0.0).to(tl.float32)
        if AXIS == 1:
            x1, x2 = head_norm(x1, x2, w1[None, :], w2[None, :], inv, dt, ROUND_BF16)
        else:
            x1, x2 = head_norm(x1, x2, w1[:, None], w2[:, None], inv, dt, ROUND_BF16)
    c1 = tl.load(cos_ptr + cs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=ok, other=0.0).to(tl.float32)
    return rope_halves(x1, x2, c1, c2, s1, s2, dt, ROUND_BF16)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, past_ptr,
    cos_ptr, sin_ptr, qw_ptr, kw_ptr, seq_ptr, slot_ptr,
    T, past, G, HKV, split_len, qk_scale, stride_pb, eps, inv_d,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_mb, stride_mt,
    stride_ob, stride_oh, stride_ot,
    stride_cb, stride_ct,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,  # new tokens a tile (<= BLOCK_N: a decode step's one token needs no 64-wide tile)
    MASK: tl.constexpr,  # 0 full, 1 causal, 2 tensor [B or 1, T, T] (int8)
    DOT_FP32: tl.constexpr,  # fp32 dots (fp32 inputs, or the interpreter)
    SINGLE: tl.constexpr,  # no cached split: the new tokens' program normalises and writes the output
    ROUND_BF16: tl.constexpr,  # bf16 under the interpreter: round before casting (round_bf16)
    PAST_TENSOR: tl.constexpr,  # past read from past_ptr[b · stride_pb]
    ROPE: tl.constexpr,  # q_ptr is the q|k|v projection: rope it, take the new K/V from it, write them
    QK_NORM: tl.constexpr,  # with ROPE: per-head RMSNorm of q and k first (weights qw_ptr, kw_ptr)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    RAGGED: tl.constexpr = False,  # packed rows: request b's queries at seq_ptr[b].., its keys in cache row slot_ptr[b]
):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)  # cached splits 0..n-2, then the new tokens' program
    bh = tl.program_id(2)
    num_splits = tl.num_programs(1)
    b = (bh // HKV).to(tl.int64)  # batch strides of a large cache pass 2^31 elements
    kvh = bh % HKV
    if RAGGED:
        q_start = tl.load(seq_ptr + b).to(tl.int64)
        t_b = (tl.load(seq_ptr + b + 1) - tl.load(seq_ptr + b)).to(tl.int32)  # this request's new tokens
        kv_b = tl.load(slot_ptr + b).to(tl.int64)
    else:
        q_start = 0
        t_b = T
        kv_b = b
    if PAST_TENSOR:
        past = tl.load(past_ptr + b * stride_pb).to(tl.int32)
        # the grid is planned for the capacity: cut the keys cached now into the splits
        split_len = tl.cdiv(tl.cdiv(past, tl.maximum(num_splits - 1, 1)), BLOCK_N) * BLOCK_N
    dt = k_ptr.dtype.element_ty
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    j = rows // T  # head within the group
    t = rows % T  # query index among the new tokens
    row_ok = (rows < T * G) & (t < t_b)
    # q and k in the padded-halves layout: position c·BLOCK_H + h holds dim c·HALF + h (ROPE pairs
    # dims h and HALF + h); v and the output plainly, dim d at d
    offs_h = tl.arange(0, BLOCK_H)
    h1_ok = offs_h < HALF
    h2_ok = offs_h < HEAD_DIM - HALF
    offs_hh = tl.arange(0, 2 * BLOCK_H)
    dim_hh = (offs_hh // BLOCK_H) * HALF + offs_hh % BLOCK_H
    hh_ok = (offs_hh % BLOCK_H) < tl.where(offs_hh < BLOCK_H, HALF, HEAD_DIM - HALF)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = q_ptr + b * stride_qb + q_start * stride_qt + (kvh * G + j)[:, None] * stride_qh + t[:, None] * stride_qt
    if ROPE:
        q1, q2 = _roped(tl.load(q_rows + offs_h[None, :], mask=row_ok[:, None] & h1_ok[None, :], other=0.0).to(tl.float32),
                        tl.load(q_rows + HALF + offs_h[None, :], mask=row_ok[:, None] & h2_ok[None, :], other=0.0).to(tl.float32),
                        cos_ptr, sin_ptr, b * stride_cb + t[:, None] * stride_ct + offs_h[None, :],
                        row_ok[:, None] & h1_ok[None, :], qw_ptr, offs_h, eps, inv_d, HALF, 1, dt, QK_NORM, ROUND_BF16)
        q = _join_rows(q1.to(dt), q2.to(dt), BLOCK_H)
    else:
        q = tl.load(q_rows + dim_hh[None, :], mask=row_ok[:, None] & hh_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + kv_b * stride_kb + kvh * stride_kh
    v_base = v_ptr + kv_b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if split < num_splits - 1:  # cached slots, visible to every query: no mask
        start = split * split_len
        end = tl.minimum(start + split_len, past)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < end
            kt = tl.load(k_base + offs_n[None, :] * stride_ks + dim_hh[:, None],
                         mask=hh_ok[:, None] & n_ok[None, :], other=0.0)  # [2·BLOCK_H, BLOCK_N]
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if DOT_FP32:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_FP32, ROUND_BF16)
    else:  # the T new tokens at slots past..past+T-1: the mask decides
        for n0 in range(0, T, BLOCK_T):
            new = n0 + tl.arange(0, BLOCK_T)  # index among the new tokens
            n_ok = new < t_b
            if ROPE:  # k head kvh is q|k|v's head H + kvh, v head kvh its head H + Hkv + kvh
                ok1 = h1_ok[:, None] & n_ok[None, :]
                ok2 = h2_ok[:, None] & n_ok[None, :]
                kp = q_ptr + b * stride_qb + new[None, :] * stride_qt + (HKV * G + kvh) * stride_qh + offs_h[:, None]
                k1t, k2t = _roped(tl.load(kp, mask=ok1, other=0.0).to(tl.float32),
                                  tl.load(kp + HALF, mask=ok2, other=0.0).to(tl.float32), cos_ptr, sin_ptr,
                                  b * stride_cb + new[None, :] * stride_ct + offs_h[:, None], ok1,
                                  kw_ptr, offs_h, eps, inv_d, HALF, 0, dt, QK_NORM, ROUND_BF16)
                k1t, k2t = k1t.to(dt), k2t.to(dt)
                kt = _join_cols(k1t, k2t, BLOCK_H)
                v = tl.load(q_ptr + b * stride_qb + new[:, None] * stride_qt + (HKV * G + HKV + kvh) * stride_qh
                            + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                if pid_m == 0:  # one program a kv head keeps them: roped k and raw v into the cache
                    slot = past + new
                    kc = k_base + slot[None, :] * stride_ks + offs_h[:, None]
                    tl.store(kc, k1t, mask=ok1)
                    tl.store(kc + HALF, k2t, mask=ok2)
                    tl.store(v_base + slot[:, None] * stride_vs + offs_d[None, :], v, mask=n_ok[:, None] & d_ok[None, :])
            else:
                slot = past + new
                kt = tl.load(k_base + slot[None, :] * stride_ks + dim_hh[:, None], mask=hh_ok[:, None] & n_ok[None, :],
                             other=0.0)
                v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :],
                            mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_FP32:
                s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = s * qk_scale
            if MASK == 0:
                visible = tl.broadcast_to(n_ok[None, :], (BLOCK_M, BLOCK_T))
            elif MASK == 1:
                visible = n_ok[None, :] & (new[None, :] <= t[:, None])
            else:
                seen = tl.load(mask_ptr + b * stride_mb + t[:, None] * stride_mt + new[None, :],
                               mask=n_ok[None, :] & row_ok[:, None], other=0)
                visible = n_ok[None, :] & (seen != 0)
            s = tl.where(visible, s, float("-inf"))
            m_i, l_i, acc = _online_softmax(s, v, m_i, l_i, acc, DOT_FP32, ROUND_BF16)

    o = o_ptr + b * stride_ob + (q_start + t)[:, None] * stride_ot + (kvh * G + j)[:, None] * stride_oh + offs_d[None, :]
    o_ok = row_ok[:, None] & d_ok[None, :]
    if SINGLE:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l = 0 only in padding rows
        if ROUND_BF16:
            out = round_bf16(out)
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=o_ok)
    else:
        part = (bh * num_splits + split) * (T * G) + rows
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=o_ok)


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, past_ptr, seq_ptr,
    T, G, HKV, NUM_SPLITS, past, split_len, stride_pb,
    stride_ob, stride_oh, stride_ot,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits a load: all of them (next power of two), or FILLED_ONLY's chunk
    FILLED_ONLY: tl.constexpr,  # read only the cached splits holding keys, BLOCK_S at a time
    PAST_TENSOR: tl.constexpr, ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    RAGGED: tl.constexpr = False,  # packed rows (the split kernel's RAGGED)
):
    """out = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) l_s for one row, M the largest m_s (empty
    splits, m = -inf, weigh 0).

    One program per (query row, batch · kv head). Every split's partial in one load, the new
    tokens' split last: one round trip to memory. FILLED_ONLY (more splits than COMBINE_CHUNK):
    the cached splits are counted as the split kernel cut them (the device past) and only those
    holding keys are read, COMBINE_CHUNK at a time, then the new tokens' split (an AR layer over 512
    cached keys in 33 splits: 2.12 µs against 2.94 reading all 33; bench/results/attention_variants_h200_parts.json)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // HKV).to(tl.int64)
    kvh = bh % HKV
    rows = T * G
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    part0 = bh * NUM_SPLITS * rows + row  # split s's partial of this row at part0 + s · rows
    part = part0 + offs_s * rows
    if FILLED_ONLY:
        cached = NUM_SPLITS - 1
        if PAST_TENSOR:
            past = tl.load(past_ptr + b * stride_pb).to(tl.int32)
            # as the split kernel cut them (at least a tile: a request with nothing cached divides by it)
            split_len = tl.maximum(tl.cdiv(tl.cdiv(past, tl.maximum(cached, 1)), BLOCK_N), 1) * BLOCK_N
        filled = tl.minimum(tl.cdiv(past, split_len), cached)  # cached splits holding keys: 0..filled-1
        new = part0 + cached * rows
        m_new = tl.load(m_ptr + new)
        l_new = tl.load(l_ptr + new)
        acc_new = tl.load(acc_ptr + new * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        ok = offs_s < filled
        m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + part, mask=ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None] & d_ok[None, :],
                      other=0.0)
        m_max = tl.maximum(tl.max(m, 0), m_new)
        for c in range(BLOCK_S, filled, BLOCK_S):  # more filled splits than a chunk: their maxima first
            m_max = tl.maximum(m_max, tl.max(tl.load(m_ptr + part + c * rows, mask=c + offs_s < filled,
                                                     other=float("-inf")), 0))
        base = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - base)
        l_sum = tl.sum(w * l, 0)
        out = tl.sum(w[:, None] * acc, 0)
        for c in range(BLOCK_S, filled, BLOCK_S):
            ok = c + offs_s < filled
            w = tl.math.exp2(tl.load(m_ptr + part + c * rows, mask=ok, other=float("-inf")) - base)
            l_sum += tl.sum(w * tl.load(l_ptr + part + c * rows, mask=ok, other=0.0), 0)
            out += tl.sum(w[:, None] * tl.load(acc_ptr + (part + c * rows)[:, None] * HEAD_DIM + offs_d[None, :],
                                               mask=ok[:, None] & d_ok[None, :], other=0.0), 0)
        w_new = tl.math.exp2(m_new - base)
        l_sum += w_new * l_new
        out += w_new * acc_new
    else:
        s_ok = offs_s < NUM_SPLITS
        m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
        m_max = tl.max(m, 0)
        w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
        l_sum = tl.sum(w * tl.load(l_ptr + part, mask=s_ok, other=0.0), 0)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                      other=0.0)
        out = tl.sum(w[:, None] * acc, 0)
    out = out / tl.where(l_sum == 0.0, 1.0, l_sum)
    if ROUND_BF16:
        out = round_bf16(out)
    j = row // T
    t = row % T
    if RAGGED:  # rows past this request's new tokens hold no partials: nothing to write
        q_start = tl.load(seq_ptr + b).to(tl.int64)
        o = o_ptr + (q_start + t) * stride_ot + (kvh * G + j) * stride_oh + offs_d
        t_ok = (offs_d * 0 + t) < tl.load(seq_ptr + b + 1) - tl.load(seq_ptr + b)
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=d_ok & t_ok)
    else:
        o = o_ptr + b * stride_ob + (kvh * G + j) * stride_oh + t * stride_ot + offs_d
        tl.store(o, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def split_count(s: int, rows: int, programs: int, sms: int) -> int:
    """KV splits for `s` cached keys, `rows` = T · group query rows per kv head, `programs` =
    batch · kv heads · row blocks before splitting, on `sms` SMs (rule in the module docstring);
    0 when nothing is cached."""
    if s == 0:
        return 0
    want = triton.cdiv(WAVES * sms, programs)
    cap = min(triton.cdiv(s, BLOCK_N), max(1, s // (2 * rows)))
    return max(1, min(want, cap))


class Plan(NamedTuple):
    block_m: int  # query rows a program
    row_blocks: int
    splits: int  # of the cached keys; the new tokens' program comes on top
    split_len: int  # keys a split: whole BLOCK_N tiles


def plan(b: int, h: int, hkv: int, t: int, s: int, sms: int, splits: int | None = None) -> Plan:
    """How a call over `s` cached keys is cut: the rule's splits (`split_count`, trailing empty
    splits dropped), or exactly `splits` if given."""
    rows = t * (h // hkv)
    block_m = max(16, min(BLOCK_M, triton.next_power_of_2(rows)))  # tl.dot needs 16
    row_blocks = triton.cdiv(rows, block_m)
    chosen = split_count(s, rows, b * hkv * row_blocks, sms) if splits is None else splits
    if chosen < (1 if s else 0):
        raise ValueError(f"attention_split_kv: splits must be >= 1 over {s} cached keys, got {chosen}")
    split_len = triton.cdiv(triton.cdiv(s, chosen), BLOCK_N) * BLOCK_N if chosen else BLOCK_N
    if splits is None and chosen:
        chosen = triton.cdiv(s, split_len)
    return Plan(block_m, row_blocks, chosen, split_len)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _mask_args(mask, b: int, t: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    if isinstance(mask, str):
        if mask not in ("causal", "full"):
            raise ValueError(f"attention_split_kv: mask must be 'causal', 'full' or a bool tensor, got {mask!r}")
        return (_MASK_CAUSAL if mask == "causal" else _MASK_FULL), None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"attention_split_kv: a mask tensor must be bool, got {getattr(mask, 'dtype', type(mask))}")
    m = mask[None] if mask.dim() == 2 else mask
    if m.dim() != 3 or m.shape[1:] != (t, t) or m.shape[0] not in (1, b):
        raise ValueError(f"attention_split_kv: mask tensor must be [T, T] or [B, T, T] with T={t}, B={b}, "
                         f"got {list(mask.shape)}")
    return _MASK_TENSOR, m.to(device).contiguous().view(torch.int8)  # no copy when already there


def check_past(past: int | torch.Tensor, b: int, s: int, t: int, device: torch.device, exact: bool,
                who: str = "attention_split_kv") -> None:
    """An int past must leave room for the T new tokens in S slots (exactly, where `exact`);
    a past tensor must be int32/int64 [], [1] or [B] on `device`."""
    if isinstance(past, torch.Tensor):
        if past.dtype not in (torch.int32, torch.int64) or past.dim() > 1 or past.numel() not in (1, b):
            raise ValueError(f"{who}: a past tensor must be int32/int64 of shape [], [1] or [B={b}], "
                             f"got {past.dtype} {list(past.shape)}")
        if past.device != device:
            raise ValueError(f"{who}: past on {past.device}, q on {device}")
        if s < t:
            raise ValueError(f"{who}: a cache of {s} slots cannot hold T={t} new tokens")
    elif exact and s != past + t:
        raise ValueError(f"{who}: the cache must hold past + T = {past} + {t} keys, got S={s}")
    elif not exact and not 0 <= past <= s - t:
        raise ValueError(f"{who}: past + T = {past} + {t} must fit the cache's S={s} slots")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int | torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"attention_split_kv: q must be [B, H, T, D] and k, v [B, Hkv, S, D], got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    (b, h, t, d), (bk, hkv, s, dk) = q.shape, k.shape
    if bk != b or dk != d or hkv == 0 or h % hkv:
        raise ValueError(f"attention_split_kv: q {list(q.shape)} does not fit k, v {list(k.shape)} "
                         "(same B and D, heads a multiple of kv heads)")
    check_past(past, b, s, t, q.device, exact=True)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"attention_split_kv: q, k, v must share a float32/bfloat16/float16 dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"attention_split_kv: q on {q.device}, k on {k.device}, v on {v.device}")


def launch_split_kv(
    q_src: torch.Tensor, q_strides: tuple[int, int, int], k: torch.Tensor, v: torch.Tensor, *,
    heads: int, t: int, past: int | torch.Tensor, mask: str | torch.Tensor, scale: float | None,
    splits: int | None, rope: dict | None = None, launch: Launch | None = None,
    ragged: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The kernel over k, v [B, Hkv, S, D]: q head h, token t at q_src + b·qs[0] + h·qs[1] + t·qs[2]
    (`q_strides` qs), roped there first when `rope` (cos, sin, [B or 1, T, D] tables with unit
    last stride, q_norm, k_norm weights or None, eps: then q_src is q|k|v and the new K/V are
    taken from it and written at slots past..past+T-1). Checked by the callers. -> [B, H, T, D].
    `ragged` (cu_seqlens [B+1], slots [B], N): packed rows, request b's queries at rows
    cu[b]..cu[b+1]-1 (t the longest), its keys in cache row slots[b]; -> [N, H, D]."""
    (b, hkv, s, d), dtype, device = k.shape, k.dtype, k.device
    g = heads // hkv
    if ragged is not None:
        b = ragged[1].shape[0]
    mode, mask_t = _mask_args(mask, b, t, device)
    if ragged is None:
        # [B, H, T, D] over [B, T, H, D] memory: the o projection's [B, T, H·D] input is then a view (no copy)
        out = torch.empty((b, t, heads, d), dtype=dtype, device=device).transpose(1, 2)
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        seq_t = slot_t = out  # unused pointers
    else:
        out = torch.empty((ragged[2], heads, d), dtype=dtype, device=device)
        o_strides = (0, out.stride(1), out.stride(0))
        seq_t, slot_t = ragged[0], ragged[1]
    if out.numel() == 0:
        return out
    past_tensor = isinstance(past, torch.Tensor)
    cached = s - t if past_tensor else past  # the grid is planned for the most keys the call may cache
    block_m, row_blocks, splits, split_len = plan(b, heads, hkv, t, cached, sm_count(device), splits)
    rows, block_d = t * g, max(16, triton.next_power_of_2(d))
    half = (d + 1) // 2
    single = splits == 0
    if single:
        m_part = l_part = acc_part = out  # unused pointers
    else:
        m_part = torch.empty((b * hkv, splits + 1, rows), dtype=torch.float32, device=device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((b * hkv, splits + 1, rows, d), dtype=torch.float32, device=device)
    if past_tensor:
        past_t, stride_pb, past = past.reshape(-1), (past.stride(-1) if past.numel() > 1 else 0), 0
    else:
        past_t, stride_pb = out, 0  # unused pointer
    if mask_t is None:
        mask_t, stride_mb, stride_mt = out, 0, 0  # unused pointer
    else:
        stride_mb, stride_mt = (mask_t.stride(0) if mask_t.shape[0] > 1 else 0), mask_t.stride(1)
    if rope is None:
        cos = sin = qw = kw = out  # unused pointers
        stride_cb = stride_ct = 0
        eps, qk_norm = 0.0, False
    else:
        cos, sin, qw, kw, eps = rope["cos"], rope["sin"], rope["q_norm"], rope["k_norm"], rope["eps"]
        stride_cb, stride_ct = (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)
        qk_norm = kw is not None
        kw = kw if qk_norm else out
        qw = qw if qw is not None else kw
    qk_scale = (d ** -0.5 if scale is None else scale) * math.log2(math.e)
    native = on_native(device)
    round_bf16 = not native and dtype == torch.bfloat16
    launch_opts = dict(num_warps=NUM_WARPS, num_stages=2) if native else {}
    # RoPE must not fuse a product into the sum: torch rounds each (with fusion on, the H200 wrote
    # 141 of 640 bf16 keys one step off rope_qkv's in tests/test_fused_kernels.py)
    fusion = dict(enable_fp_fusion=rope is None) if native else {}
    _split_kernel[(row_blocks, splits + 1, b * hkv)](
        q_src, k, v, mask_t, out, m_part, l_part, acc_part, past_t, cos, sin, qw, kw, seq_t, slot_t,
        t, past, g, hkv, split_len, qk_scale, stride_pb, eps, 1.0 / d,
        *q_strides,
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_mb, stride_mt,
        *o_strides,
        stride_cb, stride_ct,
        HEAD_DIM=d, HALF=half, BLOCK_H=max(16, triton.next_power_of_2(half)), BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_T=max(16, min(BLOCK_N, triton.next_power_of_2(t))), MASK=mode,
        DOT_FP32=dtype == torch.float32 or not native, SINGLE=single, ROUND_BF16=round_bf16,
        PAST_TENSOR=past_tensor, ROPE=rope is not None, QK_NORM=qk_norm, RAGGED=ragged is not None,
        **launch_opts, **fusion, **pdl_args(device, launch),
    )
    if not single:
        filled_only = splits + 1 > COMBINE_CHUNK  # _combine_kernel: where it measured faster
        _combine_kernel[(rows, b * hkv)](
            m_part, l_part, acc_part, out, past_t, seq_t, t, g, hkv, splits + 1, past, split_len, stride_pb,
            *o_strides, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=BLOCK_N,
            BLOCK_S=COMBINE_CHUNK if filled_only else triton.next_power_of_2(splits + 1), FILLED_ONLY=filled_only,
            PAST_TENSOR=past_tensor, ROUND_BF16=round_bf16, RAGGED=ragged is not None, **launch_opts,
            **(dict(enable_fp_fusion=True) if native else {}), **pdl_args(device, launch),  # Triton 3.6-3.9's default, by name
        )
    return out


def attention_split_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, past: int | torch.Tensor,
    mask: str | torch.Tensor = "causal", scale: float | None = None, splits: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """q [B, H, T, D] over k, v [B, Hkv, S, D] (grouped heads) -> [B, H, T, D] in q.dtype.

    `past`: an int with S = past + T, or an int32/int64 device tensor [], [1] or [B] with S the
    cache capacity (past + T <= S is the caller's to keep; checking it would sync). `mask`:
    visibility among the T new tokens ("causal", "full", bool [T, T] or [B, T, T]); all `past`
    cached slots are visible. `scale` defaults to D^-0.5. `splits` (of the cached keys) overrides
    split_count. `launch`: PDL (kernels/overlap.py).
    """
    _check(q, k, v, past)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return launch_split_kv(q, (q.stride(0), q.stride(1), q.stride(2)), k, v, heads=q.shape[1], t=q.shape[2],
                           past=past, mask=mask, scale=scale, splits=splits, launch=launch)


def _weights(q: torch.Tensor, k: torch.Tensor, *, past: int | torch.Tensor, mask: str | torch.Tensor,
             scale: float | None = None) -> torch.Tensor:
    """Attention weights [B, H, T, S] in fp32, from an explicit [B or 1, 1, T, S] mask (0 at slots
    past + T and beyond, for a past tensor)."""
    _check(q, k, k, past)
    if isinstance(past, torch.Tensor):  # row by row on the first past + T slots (.tolist() syncs)
        b, t, s = q.shape[0], q.shape[2], k.shape[2]
        rows = []
        for i, p in enumerate(past.reshape(-1).expand(b).tolist()):
            m = mask[i] if isinstance(mask, torch.Tensor) and mask.dim() == 3 and mask.shape[0] > 1 else mask
            w = _weights(q[i:i + 1], k[i:i + 1, :, :p + t], past=p, mask=m, scale=scale)
            rows.append(torch.nn.functional.pad(w, (0, s - p - t)))
        return torch.cat(rows)
    (b, h, t, d), hkv, s = q.shape, k.shape[1], k.shape[2]
    mode, mask_t = _mask_args(mask, b, t, q.device)
    visible = torch.ones(mask_t.shape[0] if mask_t is not None else 1, t, s, dtype=torch.bool, device=q.device)
    if mode == _MASK_CAUSAL:
        visible[:, :, past:] = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    elif mode == _MASK_TENSOR:
        visible[:, :, past:] = mask_t.bool()
    scores = (q.float() @ k.float().repeat_interleave(h // hkv, dim=1).transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    return scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)


def attention_split_kv_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, past: int, mask: str | torch.Tensor = "causal",
    scale: float | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """The same math in fp32 with an explicit mask: softmax(q·kᵀ·scale) v per head, cast once
    (`launch` is the kernel's argument, unused here)."""
    _check(q, k, v, past)
    weights = _weights(q, k, past=past, mask=mask, scale=scale)
    if isinstance(past, torch.Tensor):  # slots past + T and beyond may hold anything, inf or NaN
        v = v.masked_fill((weights.view(*k.shape[:2], -1, k.shape[2]).amax(2) == 0)[..., None], 0)
    return (weights @ v.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)).to(q.dtype)



def _check_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  past: torch.Tensor, max_t: int) -> None:
    if q.dim() != 3 or k.dim() != 4 or k.shape != v.shape or q.shape[1] % max(k.shape[1], 1) or q.shape[2] != k.shape[3]:
        raise ValueError(f"attention_split_kv_ragged: q must be [N, H, D] and k, v [R, Hkv, S, D] (H a multiple of "
                         f"Hkv), got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    b = slots.shape[0]
    for name, x, n in (("cu_seqlens", cu_seqlens, b + 1), ("slots", slots, b), ("past", past, b)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or list(x.shape) != [n] \
                or x.device != q.device:
            raise ValueError(f"attention_split_kv_ragged: {name} must be an int32/int64 tensor [{n}] on {q.device}, "
                             f"got {getattr(x, 'dtype', type(x))} {list(getattr(x, 'shape', []))}")
    if not 1 <= max_t <= k.shape[2]:
        raise ValueError(f"attention_split_kv_ragged: max_t must be in 1..{k.shape[2]} (the cache's slots), got {max_t}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"attention_split_kv_ragged: q, k, v must share a float32/bfloat16/float16 dtype, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")


def attention_split_kv_ragged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, slots: torch.Tensor,
    past: torch.Tensor, max_t: int, mask: str | torch.Tensor = "causal", scale: float | None = None,
    splits: int | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """Packed queries of B requests, q [N, H, D], over a slot cache k, v [R, Hkv, S, D] -> [N, H, D].

    Request b's T_b = cu_seqlens[b+1] - cu_seqlens[b] new tokens are rows cu_seqlens[b].. of q; its
    keys are cache row slots[b]: past[b] cached slots (all visible) and its new tokens at slots
    past[b]..past[b]+T_b-1, already written; among them `mask` says ("causal", "full", or bool
    [B, max_t, max_t] with request b's tree in its top-left T_b x T_b corner). `max_t` >= every T_b
    (a host int: the grid is planned for it, so one captured launch serves every split of a CUDA-graph
    bucket). Rows past cu_seqlens[B] are left as they are (uninitialised). No padding is computed:
    a program's rows past its request's T_b are masked.
    """
    _check_ragged(q, k, v, cu_seqlens, slots, past, max_t)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    return launch_split_kv(q, (0, q.stride(1), q.stride(0)), k, v, heads=q.shape[1], t=max_t, past=past, mask=mask,
                           scale=scale, splits=splits, launch=launch, ragged=(cu_seqlens, slots, q.shape[0]))


def attention_split_kv_ragged_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor, slots: torch.Tensor,
    past: torch.Tensor, max_t: int, mask: str | torch.Tensor = "causal", scale: float | None = None,
    splits: int | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """The same per request with attention_split_kv_reference (host reads of the lengths); rows past
    cu_seqlens[B] come out zero."""
    _check_ragged(q, k, v, cu_seqlens, slots, past, max_t)
    out = torch.zeros_like(q)
    cu, sl, pa = cu_seqlens.tolist(), slots.tolist(), past.tolist()
    for i in range(len(sl)):
        t = cu[i + 1] - cu[i]
        if t == 0:
            continue
        m = mask if isinstance(mask, str) else mask[i, :t, :t]
        qi = q[cu[i]:cu[i + 1]].transpose(0, 1)[None]
        o = attention_split_kv_reference(qi, k[sl[i]:sl[i] + 1, :, :pa[i] + t], v[sl[i]:sl[i] + 1, :, :pa[i] + t],
                                         past=pa[i], mask=m, scale=scale)
        out[cu[i]:cu[i + 1]] = o[0].transpose(0, 1)
    return out

# --- registry entry -------------------------------------------------------------------------

def _make_inputs(case, device, seed):
    """q, k, v ~ N(0, 1); `past` = S - T, an int, or with a capacity `cap` a device tensor: int32
    [] ("scalar"), int64 [1] ("one") or int32 [B] ("batch", row i's past 7·i less), over a cache of
    `cap` slots whose slots from past + T on hold NaN (never to be read); a "tree" mask is the
    ancestor mask of a random tree per batch row (node u's parent drawn from 0..u-1)."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, t, s, d = case["B"], case["Hkv"], case["T"], case["S"], case["D"]
    h = hkv * case["group"]
    cap = case.get("cap") or s
    q = torch.randn(b, h, t, d, generator=g).to(case["dtype"])
    k = torch.randn(b, hkv, cap, d, generator=g).to(case["dtype"])
    v = torch.randn(b, hkv, cap, d, generator=g).to(case["dtype"])
    past = s - t
    if case.get("cap"):
        kind = case["past"]
        past = (torch.tensor(past, dtype=torch.int32) if kind == "scalar" else
                torch.tensor([past]) if kind == "one" else
                torch.tensor([max(0, past - 7 * i) for i in range(b)], dtype=torch.int32))
        for i, p in enumerate(past.reshape(-1).expand(b).tolist()):
            k[i, :, p + t:] = v[i, :, p + t:] = float("nan")
        past = past.to(device)
    mask = case["mask"]
    if mask == "tree":
        mask = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
        for row in range(b):
            for u in range(1, t):
                parent = int(torch.randint(0, u, (1,), generator=g))
                mask[row, u] |= mask[row, parent]
    mask = mask.to(device) if isinstance(mask, torch.Tensor) else mask
    return q.to(device), k.to(device), v.to(device), past, mask, case["splits"]


def _run(q, k, v, past, mask, splits):
    return attention_split_kv(q, k, v, past=past, mask=mask, splits=splits)


def _reference(q, k, v, past, mask, splits):
    return attention_split_kv_reference(q, k, v, past=past, mask=mask)


def _plant_wrong_value(inputs):
    """Flip the sign of the value element that moves some output most: the largest attention
    weight times |v| over visible keys."""
    q, k, v, past, mask, *rest = inputs
    b, hkv, s, d = k.shape
    weights = _weights(q, k, past=past, mask=mask).view(b, hkv, -1, s).amax(2)  # [B, Hkv, S]
    score = (weights[..., None] * v.float().abs()).nan_to_num(0.0)
    v = v.clone()
    v.view(-1)[int(score.argmax())] *= -1
    return q, k, v, past, mask, *rest


def _case(b, hkv, group, t, s, d, mask, dtype, splits=None, cap=None, past=None):
    """S = past + T keys in use; with `cap`, a past tensor of kind `past` over a cache of cap slots."""
    case = {"B": b, "Hkv": hkv, "group": group, "T": t, "S": s, "D": d, "mask": mask, "dtype": dtype, "splits": splits}
    return case if cap is None else {**case, "cap": cap, "past": past}


F32, BF16 = torch.float32, torch.bfloat16

register(KernelSpec(
    name="attention_split_kv",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(1, 1, 1, 1, 1, 64, "causal", F32),  # one key
        _case(1, 2, 4, 1, 7, 128, "full", BF16),
        _case(1, 2, 4, 3, 7, 64, "causal", BF16, splits=3),  # cached splits 1 and 2 hold no key
        _case(2, 1, 1, 3, 300, 128, "tree", F32),  # the rule: 4 splits
        _case(2, 2, 4, 16, 300, 64, "tree", BF16, splits=5),  # [B, T, T] mask
        _case(1, 1, 1, 16, 16, 64, "causal", F32),  # nothing cached: the new tokens' program alone
        _case(1, 1, 4, 33, 300, 128, "causal", F32, splits=2),  # 132 rows: 3 row blocks
        _case(1, 1, 1, 33, 300, 64, "full", BF16, splits=1),  # one cached split
        _case(1, 2, 2, 70, 100, 64, "tree", BF16),  # two tiles of new tokens, 3 row blocks
        _case(1, 2, 3, 2, 40, 33, "causal", F32),  # odd D: halves of 17 and 16
        _case(1, 1, 4, 33, 33, 64, "tree", BF16),
        _case(2, 2, 4, 1, 300, 128, "causal", BF16),
        _case(1, 1, 4, 64, 301, 64, "causal", BF16, splits=2),
        # past a device tensor, the grid planned for the capacity
        _case(1, 2, 4, 1, 30, 64, "causal", BF16, cap=77, past="scalar"),  # the rule: 2 cached splits, 1 empty
        _case(2, 1, 2, 3, 100, 64, "tree", F32, splits=5, cap=300, past="batch"),  # rows: 100 and 93 keys
        _case(1, 1, 4, 16, 60, 128, "full", BF16, cap=300, past="one"),
        _case(2, 2, 1, 16, 41, 64, "causal", BF16, splits=1, cap=77, past="batch"),
        _case(2, 1, 2, 3, 3, 64, "tree", BF16, splits=3, cap=77, past="scalar"),  # past 0
        # more filled splits than the combine reads at once: 17 of 20 and 17 of 24 (COMBINE_CHUNK 16)
        _case(1, 1, 2, 2, 2100, 64, "causal", F32, splits=20),
        _case(1, 1, 2, 1, 2151, 64, "causal", BF16, splits=24, cap=2200, past="one"),
    ],
    # fp32: summation order and exp2 vs exp (worst 4.2e-7 absolute seen). bf16: the output may land
    # one bf16 step from the reference (2^-7 relative), and p is rounded to bf16 before p·v, which
    # moves an output by up to 2^-9 Σ p|v| (worst 2.6e-3 beyond the rtol over 30 seeds of the small
    # cases under the interpreter, which rounds p as the GPU does).
    tolerance={F32: (1e-5, 1e-5), BF16: (4e-3, 8e-3)},
    corrupt=_plant_wrong_value,
    description="softmax(q kᵀ / √D) v for T ≤ 64 new tokens over a split KV cache (causal, full, tree)",
))


def _make_ragged_inputs(case, device, seed):
    """B requests with new-token counts `counts` and pasts `pasts`, packed in drawn order into a cache
    of `rows` rows of `cap` slots (request b in row slots[b], a permutation); slots from past + T on
    hold NaN (never read). Masks as _make_inputs's (a "tree" per request in its corner)."""
    g = torch.Generator().manual_seed(seed)
    counts, pasts = case["counts"], case["pasts"]
    b, hkv, d, cap = len(counts), case["Hkv"], case["D"], case["cap"]
    h = hkv * case["group"]
    rows = b + case.get("spare", 1)
    slots = torch.randperm(rows, generator=g)[:b]
    q = torch.randn(sum(counts) + case.get("extra_rows", 0), h, d, generator=g).to(case["dtype"])
    k = torch.randn(rows, hkv, cap, d, generator=g).to(case["dtype"])
    v = torch.randn(rows, hkv, cap, d, generator=g).to(case["dtype"])
    for s, p, t in zip(slots.tolist(), pasts, counts):
        k[s, :, p + t:] = v[s, :, p + t:] = float("nan")
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    max_t = case.get("max_t") or max(counts)
    mask = case["mask"]
    if mask == "tree":
        mask = torch.zeros(b, max_t, max_t, dtype=torch.bool)
        for i, t in enumerate(counts):
            mask[i, :t, :t] = torch.eye(t, dtype=torch.bool)
            for u in range(1, t):
                mask[i, u] |= mask[i, int(torch.randint(0, u, (1,), generator=g))]
        mask = mask.to(device)
    return (q.to(device), k.to(device), v.to(device), cu.to(device), slots.to(torch.int32).to(device),
            torch.tensor(pasts, dtype=torch.int32, device=device), max_t, mask, case["splits"])


def _run_ragged(q, k, v, cu, slots, past, max_t, mask, splits):
    out = attention_split_kv_ragged(q, k, v, cu_seqlens=cu, slots=slots, past=past, max_t=max_t, mask=mask,
                                    splits=splits)
    return out[:int(cu[-1])]


def _reference_ragged(q, k, v, cu, slots, past, max_t, mask, splits):
    return attention_split_kv_ragged_reference(q, k, v, cu_seqlens=cu, slots=slots, past=past, max_t=max_t,
                                               mask=mask)[:int(cu[-1])]


def _plant_ragged(inputs):
    """Request 0's values, all of them, one higher: its rows' outputs move by exactly 1."""
    q, k, v, cu, slots, *rest = inputs
    v = v.clone()
    v[int(slots[0])] += 1
    return q, k, v, cu, slots, *rest


def _ragged_case(counts, pasts, hkv, group, d, mask, dtype, cap=None, splits=None, **extra):
    cap = cap or max(p + t for p, t in zip(pasts, counts)) + 5
    return {"counts": counts, "pasts": pasts, "Hkv": hkv, "group": group, "D": d, "mask": mask, "dtype": dtype,
            "cap": cap, "splits": splits, **extra}


register(KernelSpec(
    name="attention_split_kv_ragged",
    run=_run_ragged,
    reference=_reference_ragged,
    make_inputs=_make_ragged_inputs,
    cases=[
        _ragged_case([1], [0], 1, 1, 64, "causal", F32),  # one request, one key
        _ragged_case([3, 1, 5], [7, 0, 40], 2, 4, 64, "causal", BF16),  # a request with nothing cached
        _ragged_case([2, 7], [100, 33], 1, 3, 33, "tree", F32, splits=3),  # odd D and group
        _ragged_case([16, 1, 4, 9], [90, 300, 5, 61], 2, 4, 128, "tree", BF16),
        _ragged_case([5, 5], [20, 21], 2, 2, 64, "full", BF16, max_t=16, extra_rows=3),  # a bucket's padding
        _ragged_case([33, 2], [10, 150], 1, 4, 64, "causal", F32, splits=2),  # 132 rows: 3 row blocks
        _ragged_case([1] * 6, [3, 70, 0, 9, 200, 31], 2, 4, 64, "causal", BF16, splits=20),  # AR rows, many splits
    ],
    tolerance={F32: (1e-5, 1e-5), BF16: (4e-3, 8e-3)},
    corrupt=_plant_ragged,
    description="attention_split_kv over packed rows of many requests (ragged lengths, a cache row each)",
))
