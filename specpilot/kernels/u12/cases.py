"""The u12 kernels' test fixtures: inputs with planted escapes, planted errors, and their registry entries.

tests/test_kernels.py walks the registry: each kernel (u12_linear at its default configs, gemv2,
mma and hmma at small check configs, u12_fused_linear) against its reference on odd shapes, and a
planted wrong weight that the tolerance must catch.
"""

from __future__ import annotations

import functools

import torch

from specpilot.formats.u12 import pack_u12, unpack_u12

from ..fused_linear import plant_wrong_weight as plant_wrong_dense_weight
from ..registry import KernelSpec, register
from .config import U12Config
from .dispatch import u12_linear, u12_linear_reference
from .fused import u12_fused_linear, u12_fused_linear_reference

SPECIALS = torch.tensor(
    [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0x3F80, 0xBFC0, 0x2F00],  # ±0, subnormals, ±inf, NaN, 1, -1.5, 2^-33
    dtype=torch.int32,
)


def make_inputs(case, device, seed):
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
        bits = SPECIALS[torch.arange(planted.numel()) % len(SPECIALS)]
        w.view(torch.int16).view(-1)[planted] = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    if case["escapes"] == "all":
        base = 241
    return x.to(device), pack_u12(w, base=base).to(device)


def plant_wrong_weight(inputs):
    """Flip the sign of the weight that moves the output most (finite rows only)."""
    x, t = inputs
    w = unpack_u12(t).cpu()
    score = w.to(torch.float32).abs() * x.to(torch.float32).abs().amax(0).cpu()[None, :]
    score[~torch.isfinite(w).all(1)] = -1
    bits = w.view(torch.int16).clone()
    bits.view(-1)[int(score.argmax())] ^= -0x8000
    # Same base, so that the flipped weight stays where it was (in the planes or in the table).
    return x, pack_u12(bits.view(torch.bfloat16), base=t.base).to(t.device)


def u12_case(m, n, k, dtype, escapes):
    return {"M": m, "N": n, "K": k, "dtype": dtype, "escapes": escapes}


register(KernelSpec(
    name="u12_linear",
    run=u12_linear,
    reference=u12_linear_reference,
    make_inputs=make_inputs,
    cases=[
        u12_case(1, 1, 1, torch.bfloat16, "none"),
        u12_case(1, 7, 33, torch.bfloat16, "few"),
        u12_case(2, 33, 64, torch.float32, "special"),
        u12_case(3, 33, 257, torch.float32, "few"),
        u12_case(4, 67, 300, torch.bfloat16, "special"),
        u12_case(5, 17, 64, torch.bfloat16, "all"),
        u12_case(16, 64, 128, torch.float32, "few"),
        u12_case(17, 33, 257, torch.bfloat16, "few"),
        u12_case(33, 40, 96, torch.float32, "all"),
        u12_case(64, 65, 300, torch.bfloat16, "special"),
    ],
    # fp32: summation order only. bf16: the fp32 sums differ in order, so the final rounding may land
    # one bf16 step apart: up to 2^-7 relative (worst case measured on these cases under the
    # interpreter: 0.97 of 8e-3); atol covers the fp32 order error near zero at K <= 300.
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},
    corrupt=plant_wrong_weight,
    description="y = x @ W.T, W in u12 planes decoded in registers, escapes added exactly",
))


_GEMV2_CHECK_CONFIG = U12Config(8, 16, num_warps=2, num_stages=1, kernel="gemv2")  # partial N blocks and K chunks below

register(KernelSpec(
    name="u12_gemv2",
    run=functools.partial(u12_linear, config=_GEMV2_CHECK_CONFIG),
    reference=u12_linear_reference,
    make_inputs=make_inputs,
    cases=[
        u12_case(1, 7, 36, torch.bfloat16, "none"),  # 9 words: a masked last chunk; N < BLOCK_N
        u12_case(1, 16, 128, torch.bfloat16, "few"),  # no masked chunk, N a multiple of BLOCK_N
        u12_case(2, 33, 64, torch.float32, "special"),
        u12_case(3, 33, 300, torch.float32, "few"),  # BLOCK_M 4: one re-read row of x
        u12_case(4, 67, 300, torch.bfloat16, "special"),
        u12_case(4, 24, 256, torch.bfloat16, "few"),
        u12_case(2, 9, 33, torch.bfloat16, "few"),  # K % 4 != 0: the tile kernel
        u12_case(4, 17, 64, torch.bfloat16, "all"),  # base 241, not scaled: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=plant_wrong_weight,
    description="u12_linear with a gemv2 config: M <= 4 rows against the planes, escapes added exactly",
))


# One warp of two m-tiles: the cases cover partial N blocks, split-K and masked last chunks.
_HMMA_CHECK_CONFIG = U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")

register(KernelSpec(
    name="u12_hmma",
    run=functools.partial(u12_linear, config=_HMMA_CHECK_CONFIG),
    reference=u12_linear_reference,
    make_inputs=make_inputs,
    cases=[
        u12_case(5, 17, 64, torch.bfloat16, "few"),  # 16 words: one masked chunk (BLOCK_W 32); one n-tile, 3 re-read x rows
        u12_case(3, 40, 96, torch.bfloat16, "special"),  # 3 rows (TENSOR_CORE_ROWS): one n-tile; 24 words, 2 splits
        u12_case(16, 64, 128, torch.bfloat16, "special"),  # 32 words: one full chunk a split, 2 N blocks
        u12_case(13, 17, 136, torch.bfloat16, "few"),  # 34 words: the second split a masked chunk of 2 words
        u12_case(9, 40, 96, torch.bfloat16, "special"),  # 24 words: a full chunk, then a split of one masked group
        u12_case(16, 17, 64, torch.float32, "few"),  # fp32 x: the tile kernel
        u12_case(17, 9, 32, torch.bfloat16, "few"),  # M past 16: two 16-row blocks side by side (MAX_M)
        u12_case(8, 17, 64, torch.bfloat16, "all"),  # base 241, not biased: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=plant_wrong_weight,
    description="u12_linear with an hmma config: 1..64 rows by mma.sync on fragments decoded in registers, "
                "escapes exact",
))


# Small tiles so the cases below cover partial N and M blocks, split-K and masked last chunks.
_MMA_CHECK_CONFIG = U12Config(64, 16, split_k=2, num_warps=4, num_stages=2, kernel="mma")

register(KernelSpec(
    name="u12_mma",
    run=functools.partial(u12_linear, config=_MMA_CHECK_CONFIG),
    reference=u12_linear_reference,
    make_inputs=make_inputs,
    cases=[
        u12_case(5, 17, 64, torch.bfloat16, "few"),  # 16 words: one chunk, no split; BLOCK_M 16, 11 re-read rows
        u12_case(3, 40, 96, torch.bfloat16, "special"),  # 3 rows (TENSOR_CORE_ROWS): 13 re-read rows, 2 splits
        u12_case(16, 64, 128, torch.float32, "special"),  # every block full, 2 splits
        u12_case(17, 33, 300, torch.bfloat16, "few"),  # 75 words: the second split ends in a masked chunk
        u12_case(33, 40, 96, torch.float32, "few"),  # 24 words: a full chunk, then a split of one masked chunk
        u12_case(64, 65, 300, torch.bfloat16, "special"),  # two N blocks, the second of one row
        u12_case(65, 31, 256, torch.float32, "few"),  # two M blocks, the second of one row
        u12_case(16, 17, 64, torch.bfloat16, "all"),  # base 241, not scaled: the tile kernel
        u12_case(5, 9, 30, torch.float32, "few"),  # K % 4 != 0: the tile kernel
    ],
    tolerance={torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 8e-3)},  # as u12_linear's
    corrupt=plant_wrong_weight,
    description="u12_linear with an mma config: tensor-core dots on decoded planes, 16 rows a program "
                "at least, escapes exact",
))


# --- u12_fused_linear -------------------------------------------------------------------

FUSED_CHECK_CONFIGS = {"bn16-bw4": U12Config(16, 4, num_warps=2, num_stages=1, kernel="gemv2")}  # N < BN, many chunks
_LARGE_ESCAPES = (3e4, -1.5, 1e-30, -0.75, -3e4, 0.5)  # outside N(0, 0.02)'s window, 2^-18..2^-4
_GATED_ESCAPES = (-1.5, 1e-30, -0.75, 0.5)  # y = silu(g) · u: a huge g would scale u's fp32 order error past atol


def plant_escapes(w: torch.Tensor, g: torch.Generator, gated: bool, nonfinite: bool = False) -> None:
    """Plant escapes in the fp32 weight w [N, K] (~N(0, 0.02)), in place: one of ``_LARGE_ESCAPES``
    (gated: ``_GATED_ESCAPES``) in every third row from row 1 (one a row, so no two large terms
    cancel; row 0 is where the registry's planted error must show), and in the first four rows of
    each half (gated: gate and up) five tiny ones (w · 2^-40) each, more than escapes.py's ESC_BLOCK
    in a 4-row block (K >= 5); nonfinite: inf, -inf and NaN in rows 1, 2 and N - 1."""
    n, k = w.shape
    values = _GATED_ESCAPES if gated else _LARGE_ESCAPES
    for i, row in enumerate(range(1, n, 3)):
        w[row, int(torch.randint(k, (1,), generator=g))] = values[i % len(values)]
    for first in (0, n // 2) if gated else (0,):
        for row in range(first, min(first + 4, n)):
            cols = torch.randperm(k, generator=g)[:5]
            w[row, cols] *= 2.0**-40
    if nonfinite:
        for row, v in zip((1, 2, n - 1), (float("inf"), float("-inf"), float("nan"))):
            w[min(row, n - 1), int(torch.randint(k, (1,), generator=g))] = v


def make_fused_inputs(case, device, seed):
    """x ~ N(0, 1) (every third row × 30, as hidden states are), W ~ N(0, 0.02) in bf16 with
    escapes planted (``plant_escapes``) and packed, norm weight ~ 1 + N(0, 0.1), residual ~
    N(0, 1); positional (x, t, norm weight or None, gated, residual or None, config name)."""
    g = torch.Generator().manual_seed(seed)
    m, n, k, dtype = case["M"], case["N"], case["K"], case["dtype"]
    x = torch.randn(m, k, generator=g)
    x[::3] *= 30
    w = 0.02 * torch.randn(n, k, generator=g)
    plant_escapes(w, g, bool(case["gated"]), nonfinite=case["escapes"] == "nonfinite")
    t = pack_u12(w.to(torch.bfloat16)).to(device)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device) if case["norm"] else None
    n_out = n // 2 if case["gated"] else n
    r = torch.randn(m, n_out, generator=g).to(dtype).to(device) if case["residual"] else None
    return x.to(dtype).to(device), t, nw, case["gated"], r, case["config"]


def _run_fused(x, t, nw, gated, r, config):
    """u12_fused_linear on a copy of the residual (the reference gets its own copy)."""
    return u12_fused_linear(x, t, norm_weight=nw, gated=bool(gated), residual=None if r is None else r.clone(),
                            config=FUSED_CHECK_CONFIGS.get(config))


def _fused_reference(x, t, nw, gated, r, config):
    return u12_fused_linear_reference(x, t, norm_weight=nw, gated=bool(gated),
                                      residual=None if r is None else r.clone())


def plant_wrong_fused_weight(inputs):
    """fused_linear's planted error (one weight moved by 4 where x' is largest) on the unpacked
    weight, packed again with t's base (the moved weight, about ±4, is then an escape)."""
    x, t, nw, gated, r, config = inputs
    x, w, nw, gated, r, config = plant_wrong_dense_weight((x, unpack_u12(t).to(x.dtype), nw, gated, r, config))
    return x, pack_u12(w.to(torch.bfloat16), base=t.base).to(t.device), nw, gated, r, config


def fused_case(m, n, k, dtype, norm=0, gated=0, residual=0, escapes="few", config="default"):
    return {"M": m, "N": n, "K": k, "dtype": dtype, "norm": norm, "gated": gated, "residual": residual,
            "escapes": escapes, "config": config}


BF16, F32 = torch.bfloat16, torch.float32

register(KernelSpec(
    name="u12_fused_linear",
    run=_run_fused,
    reference=_fused_reference,
    make_inputs=make_fused_inputs,
    cases=[
        # the fused kernel (M <= 4, K % 4 == 0); N: t's rows (gated: 2I); interpreter chunks of 32
        fused_case(1, 7, 36, BF16),
        fused_case(1, 34, 68, BF16, norm=1, gated=1),
        fused_case(2, 33, 132, F32, norm=1),
        fused_case(2, 17, 260, BF16, residual=1),
        fused_case(3, 38, 100, BF16, gated=1, residual=1),
        fused_case(3, 30, 68, F32, gated=1),
        fused_case(4, 67, 132, BF16, norm=1, residual=1),
        fused_case(4, 42, 128, F32, norm=1, gated=1, residual=1),  # K % 32 == 0: no masked chunk
        fused_case(1, 16, 128, BF16, norm=1, gated=1, residual=1),
        fused_case(3, 9, 36, BF16, norm=1, escapes="nonfinite", config="bn16-bw4"),
        fused_case(2, 13, 52, F32, residual=1, escapes="nonfinite"),
        fused_case(4, 10, 1100, BF16, norm=1, gated=1),  # the norm's words in 3 chunks, the last masked
        # the mma kernel's epilogue: M > 4 (interpreter tiles of 64 rows, 16 words, split-K 2)
        fused_case(5, 42, 64, F32, norm=1, gated=1, residual=1),
        fused_case(7, 140, 136, BF16, gated=1, residual=1),  # 70 output columns: a partial second block
        fused_case(16, 67, 100, BF16, norm=1, residual=1),
        fused_case(17, 30, 68, F32, residual=1, escapes="nonfinite"),
        # the unfused fallback: K % 4 != 0
        fused_case(2, 17, 66, BF16, norm=1),  # bf16 ungated, no residual: u12_linear truncates under the interpreter
        fused_case(6, 34, 66, F32, norm=1, gated=1, residual=1),
    ],
    # As fused_linear's: fp32 summation order only; bf16 one rounding step where an fp32 sum (or a
    # normalised x element) sits near a rounding boundary; atol for the fp32 order error near zero.
    tolerance={F32: (1e-5, 1e-5), BF16: (1e-4, 8e-3)},
    corrupt=plant_wrong_fused_weight,
    description="x @ W.T, W in u12, with an RMSNorm prologue and SiLU·mul / residual-add epilogues",
))
