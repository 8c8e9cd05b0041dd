"""y = x · Wᵀ with W in the u12 format, decoded in registers.

Each program owns a block of BLOCK_N output features and all M (≤ 64 per program) rows of x:
it walks K once, decodes each weight once from the two planes and uses it for every row, and
accumulates in fp32. Small M (≤ 4) multiplies on the CUDA cores into a [BM, BN, BK] accumulator
reduced once after the loop; larger M computes yᵀ = W·xᵀ with ``tl.dot``, the decoded tile as the
wide (BLOCK_N) side, bf16 operands on the GPU (the decoded weights are exact bf16).

Columns are decoded as (even, odd) pairs: one code byte holds both codes, and the sign/mantissa
plane is read as little-endian int16 pairs when K is even, so both planes load contiguously; the
two halves are interleaved back (join + reshape) to meet a contiguous tile of x.

Escapes: the planes hold code 0 at escaped positions, which decodes to 0.0. After the K loop the
program adds the exact contributions ``x[:, k] * w[n, k]`` of its rows' escapes to the fp32
accumulator, in chunks gathered from the CSR row pointers (``U12Tensor.esc_row_ptr``) and
scattered by a one-hot product. Doing it in the same program costs no extra launch and no fp32
output round trip; escapes are rare (about 0.015% of N(0, 0.02) weights, bench/results/u12_stats.json).
A chunk whose contributions are not all finite (inf/NaN weights) takes a one-escape-at-a-time
path, since a one-hot product would spread inf·0 = NaN across the block.

Activations are assumed finite: an inf in x meets escaped weights as 0 in the main loop.

Speed (H200, triton 3.6, bench/results/u12_linear_nvidia_h200.json): 0.47-0.55x cuBLAS at M = 1,
0.13-0.35x at M = 16..64, so not yet worth using for speed. Measured along the way: making W the
dot's wide side and reading x contiguously took M = 64 from 0.06-0.10x to 0.13-0.29x; halving
the integer work per weight (two weights per 32-bit word) left M = 1 unchanged, so this kernel is
not bound by decode arithmetic. Untried: split-K (the naive kernel of GPU-FACTS.md had it and
reached 0.9x at M = 1), more bytes in flight per program, a layout that avoids the join.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.runtime.u12 import U12Tensor, pack_u12, unpack_u12

from .registry import KernelSpec, register


@triton.jit
def _decode_pairs(pair, code_byte, base, TO_BF16: tl.constexpr):
    """Two weights per 32-bit word, from ``pair = sm_even | sm_odd << 8`` and ``code_byte``.

    Both bf16 patterns are assembled in one int32 (even in the low half), so the integer work is
    shared; the naive one-weight-per-int32 decode was bound by integer work (GPU-FACTS.md).
    Code 0 gets exponent field 0 instead of base - 1 (the multiply by min(c, 1)), and pack_u12
    stores sign/mantissa 0 at escapes, so an escape decodes to +0.0 without a select.
    """
    p = pair.to(tl.int32) & 0xFFFF
    c = code_byte.to(tl.int32)
    c_even = c & 0xF
    c_odd = c >> 4
    exponents = ((c_even + (base - 1) * tl.minimum(c_even, 1)) << 7) | ((c_odd + (base - 1) * tl.minimum(c_odd, 1)) << 23)
    bits = (p & 0x7F) | ((p & 0x7F80) << 8) | ((p & 0x8000) << 16) | exponents
    if TO_BF16:
        w_even = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w_odd = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w_even = (bits << 16).to(tl.float32, bitcast=True)
        w_odd = (bits & -0x10000).to(tl.float32, bitcast=True)
    return w_even, w_odd


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
def _apply_escapes(
    acc, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
    stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
):
    """Add the exact contributions of the escaped weights in rows [n0, n0 + BLOCK_N)."""
    start = tl.load(esc_row_ptr + n0)
    end = tl.load(esc_row_ptr + tl.minimum(n0 + BLOCK_N, N))
    for e0 in range(start, end, ESC_BLOCK):
        offs_e = e0 + tl.arange(0, ESC_BLOCK)
        mask_e = offs_e < end
        idx = tl.load(esc_idx_ptr + offs_e, mask=mask_e, other=0)
        val = (tl.load(esc_val_ptr + offs_e, mask=mask_e, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        rows = tl.where(mask_e, idx // K, -1)
        cols = idx % K
        xg = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_e[None, :], other=0.0,
        ).to(tl.float32)
        contrib = xg * val[None, :]
        n_nonfinite = tl.sum(tl.sum((contrib - contrib != 0).to(tl.int32), axis=1), axis=0)
        if n_nonfinite == 0:
            acc = _scatter_escapes(acc, contrib, rows, offs_n, USE_DOT)
        else:
            for e in range(e0, tl.minimum(e0 + ESC_BLOCK, end)):
                i = tl.load(esc_idx_ptr + e)
                v = (tl.load(esc_val_ptr + e).to(tl.int32) << 16).to(tl.float32, bitcast=True)
                xcol = tl.load(x_ptr + offs_m * stride_xm + (i % K) * stride_xk, mask=mask_m, other=0.0)
                acc += tl.where(offs_n[None, :] == i // K, (xcol.to(tl.float32) * v)[:, None], 0.0)
    return acc


@triton.jit
def _u12_linear_kernel(
    x_ptr, sm_ptr, codes_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, y_ptr,
    M, N, K, base,
    stride_xm, stride_xk, stride_sm, stride_codes, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, ESC_BLOCK: tl.constexpr,
    SM_PAIRS: tl.constexpr,  # sm_ptr is the sign/mantissa plane viewed as int16 pairs (K even)
    USE_DOT: tl.constexpr,  # tl.dot on decoded tiles (BLOCK_M >= 16), else multiply-and-sum
    DOT_BF16: tl.constexpr,  # decode to bf16 for a bf16 dot (GPU, bf16 x); else fp32 tiles
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm

    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ: W is the dot's wide side
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, 2 * BLOCK_P), dtype=tl.float32)  # reduced once, after the loop
    for p0 in range(0, tl.cdiv(K, 2), BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)  # column pairs (2p, 2p + 1)
        w_mask = mask_n[:, None] & (2 * offs_p < K)[None, :]
        code_byte = tl.load(codes_ptr + offs_n[:, None] * stride_codes + offs_p[None, :], mask=w_mask, other=0)
        if SM_PAIRS:
            pair = tl.load(sm_ptr + offs_n[:, None] * stride_sm + offs_p[None, :], mask=w_mask, other=0)
        else:
            sm_row = sm_ptr + offs_n[:, None] * stride_sm + 2 * offs_p[None, :]
            sm_even = tl.load(sm_row, mask=w_mask, other=0).to(tl.int32)
            sm_odd = tl.load(sm_row + 1, mask=mask_n[:, None] & (2 * offs_p + 1 < K)[None, :], other=0).to(tl.int32)
            pair = sm_even | (sm_odd << 8)
        w_even, w_odd = _decode_pairs(pair, code_byte, base, DOT_BF16)  # [BN, BP] each
        w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, 2 * BLOCK_P))  # columns 2p, 2p + 1 interleaved
        offs_k = 2 * p0 + tl.arange(0, 2 * BLOCK_P)
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        if USE_DOT:
            if DOT_BF16:
                acc = tl.dot(w, tl.trans(x.to(tl.bfloat16)), acc)
            else:
                acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    if USE_DOT:
        acc = tl.trans(acc)
    else:
        acc = tl.sum(acc, axis=2)

    acc = _apply_escapes(
        acc, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
        stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, USE_DOT,
    )
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(block_n: int, block_p: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_P": block_p}, num_warps=warps, num_stages=stages)


# A small space for the H200 (BLOCK_P counts column pairs, so a tile spans 2·BLOCK_P columns); the
# autotuner picks per (BLOCK_M, N, K). Its picks are recorded in the benchmark's result file.
_CONFIGS_SUM = [
    _config(16, 32, 4, 3), _config(16, 64, 4, 3), _config(16, 128, 4, 3), _config(32, 64, 4, 3),
    _config(64, 32, 4, 3), _config(16, 256, 8, 3), _config(32, 128, 8, 3), _config(64, 64, 8, 3),
]
_CONFIGS_DOT = [
    _config(64, 32, 4, 4), _config(64, 64, 4, 3), _config(128, 32, 4, 3),
    _config(128, 32, 8, 3), _config(128, 64, 8, 3), _config(64, 64, 8, 4),
]


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs of the kernel's path; the sum path's [BM, BN, 2 BP] fp32 accumulator stays
    within 64 registers a thread."""
    if kwargs["USE_DOT"]:
        return [c for c in configs if c in _CONFIGS_DOT]
    size = lambda c: kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * 2 * c.kwargs["BLOCK_P"]
    kept = [c for c in configs if c in _CONFIGS_SUM and size(c) <= 64 * 32 * c.num_warps]
    return kept or [min(_CONFIGS_SUM, key=size)]


_u12_linear_tuned = triton.autotune(
    configs=_CONFIGS_SUM + _CONFIGS_DOT,
    key=["BLOCK_M", "N", "K"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_u12_linear_kernel)

# The interpreter (CPU) runs one small fixed config.
_INTERPRETER_CONFIG = {"BLOCK_N": 16, "BLOCK_P": 16}
_ESC_BLOCK = 16


def _block_m(m: int) -> int:
    """Rows of x per program: up to 4 on the multiply-and-sum path, else 16..64 for tl.dot."""
    if m <= 4:
        return triton.next_power_of_2(m)
    return min(64, max(16, triton.next_power_of_2(m)))


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """Kernels take a pointer even when the escape table is empty."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def u12_linear(x: torch.Tensor, t: U12Tensor) -> torch.Tensor:
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

    block_m = _block_m(m)
    sm_pairs = k % 2 == 0 and k > 0
    sm = t.sm.contiguous()
    args = (
        x, sm.view(torch.int16) if sm_pairs else sm, t.codes.contiguous(),
        _nonempty(t.esc_idx), _nonempty(t.esc_val), t.esc_row_ptr, y,
        m, n, k, t.base,
        x.stride(0), x.stride(1), (k // 2) if sm_pairs else k, t.codes.shape[1], y.stride(0),
    )
    meta = dict(
        BLOCK_M=block_m, ESC_BLOCK=_ESC_BLOCK, SM_PAIRS=sm_pairs,
        USE_DOT=block_m >= 16, DOT_BF16=block_m >= 16 and x.is_cuda and x.dtype == torch.bfloat16,
    )
    m_blocks = triton.cdiv(m, block_m)
    if x.is_cuda:
        _u12_linear_tuned[lambda c: (triton.cdiv(n, c["BLOCK_N"]), m_blocks)](*args, **meta)
    else:
        grid = (triton.cdiv(n, _INTERPRETER_CONFIG["BLOCK_N"]), m_blocks)
        _u12_linear_kernel[grid](*args, **meta, **_INTERPRETER_CONFIG)
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
