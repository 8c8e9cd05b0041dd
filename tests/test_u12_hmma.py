"""The hmma kernel (kernels/u12_hmma.py): mma.sync fragments, dispatch, configs.

Its results against the reference on odd shapes are the registry's cases (tests/test_kernels.py,
"u12_hmma"); here: the fragment layout the kernel relies on, that those cases really run it, and
the config checks. On the CPU the MMA is the kernel's emulation; on a GPU the PTX instruction.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import triton
import triton.language as tl

from specpilot.kernels import u12_hmma
from specpilot.kernels.u12_linear import U12Config, _case, _make_inputs, u12_linear, u12_linear_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NATIVE = DEVICE == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)


@triton.jit
def _one_mma(a_ptr, b_ptr, c_ptr, d_ptr, ASM: tl.constexpr):
    t = tl.arange(0, 32)
    d0, d1, d2, d3 = u12_hmma._mma(
        tl.load(a_ptr + 4 * t), tl.load(a_ptr + 4 * t + 1), tl.load(a_ptr + 4 * t + 2), tl.load(a_ptr + 4 * t + 3),
        tl.load(b_ptr + 2 * t), tl.load(b_ptr + 2 * t + 1),
        tl.load(c_ptr + 4 * t), tl.load(c_ptr + 4 * t + 1), tl.load(c_ptr + 4 * t + 2), tl.load(c_ptr + 4 * t + 3),
        ASM,
    )
    tl.store(d_ptr + 4 * t, d0)
    tl.store(d_ptr + 4 * t + 1, d1)
    tl.store(d_ptr + 4 * t + 2, d2)
    tl.store(d_ptr + 4 * t + 3, d3)


def _pairs(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """bf16 values (lo in bits 0-15, hi in 16-31) as int32 registers."""
    lo16 = lo.view(torch.int16).to(torch.int32) & 0xFFFF
    hi16 = hi.view(torch.int16).to(torch.int32) & 0xFFFF
    return lo16 | (hi16 << 16)


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_fragments_follow_the_ptx_layout(seed):
    """D = A B + C for A [16, 16], B [16, 8] laid out in the lanes as the PTX ISA's m16n8k16 figures
    say (lane l: g = l // 4, q = l % 4): the layout the kernel builds its fragments in."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    B = torch.randn(16, 8, generator=g).to(torch.bfloat16)
    C = torch.randn(16, 8, generator=g)
    lane = torch.arange(32)
    r, q = lane // 4, lane % 4
    a = torch.stack([
        _pairs(A[r, 2 * q], A[r, 2 * q + 1]), _pairs(A[r + 8, 2 * q], A[r + 8, 2 * q + 1]),
        _pairs(A[r, 2 * q + 8], A[r, 2 * q + 9]), _pairs(A[r + 8, 2 * q + 8], A[r + 8, 2 * q + 9]),
    ], 1)
    b = torch.stack([_pairs(B[2 * q, r], B[2 * q + 1, r]), _pairs(B[2 * q + 8, r], B[2 * q + 9, r])], 1)
    c = torch.stack([C[r, 2 * q], C[r, 2 * q + 1], C[r + 8, 2 * q], C[r + 8, 2 * q + 1]], 1)
    d = torch.empty(32, 4, device=DEVICE)
    _one_mma[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), d, ASM=NATIVE, num_warps=1)
    D = torch.empty(16, 8)
    d = d.cpu()
    D[r, 2 * q], D[r, 2 * q + 1], D[r + 8, 2 * q], D[r + 8, 2 * q + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    torch.testing.assert_close(D, A.float() @ B.float() + C, rtol=1e-5, atol=1e-5)


def test_registry_cases_run_the_hmma_kernel(monkeypatch):
    """The registry's bf16 cases of 5..16 rows launch the hmma kernel (not a fallback)."""
    launched = []
    launch = u12_hmma.launch_hmma
    monkeypatch.setattr(u12_hmma, "launch_hmma", lambda *a, **k: launched.append(a[3]) or launch(*a, **k))
    cfg = U12Config(64, 16, split_k=3, num_warps=2, num_stages=1, kernel="hmma")  # two warps of two m-tiles
    x, t = _make_inputs(_case(11, 40, 160, torch.bfloat16, "few"), DEVICE, 3)  # 40 words: 3 splits, masked tail
    y = u12_linear(x, t, cfg)
    assert launched == [cfg]
    ref = u12_linear_reference(x, t)
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-4)


def test_hmma_applies_to_bf16_x_of_1_to_64_rows_with_word_loads_and_a_scaled_base():
    assert u12_hmma.hmma_applies(torch.zeros(8, 64, dtype=torch.bfloat16), 64, 120)
    assert u12_hmma.hmma_applies(torch.zeros(16, 64, dtype=torch.bfloat16), 64, 1)
    assert u12_hmma.hmma_applies(torch.zeros(3, 64, dtype=torch.bfloat16), 64, 120)
    assert not u12_hmma.hmma_applies(torch.zeros(8, 64, dtype=torch.float32), 64, 120)  # fp32 x
    assert u12_hmma.hmma_applies(torch.zeros(17, 64, dtype=torch.bfloat16), 64, 120)  # 16-row blocks side by side
    assert u12_hmma.hmma_applies(torch.zeros(64, 64, dtype=torch.bfloat16), 64, 120)
    assert not u12_hmma.hmma_applies(torch.zeros(65, 64, dtype=torch.bfloat16), 64, 120)  # past MAX_M
    assert not u12_hmma.hmma_applies(torch.zeros(8, 30, dtype=torch.bfloat16), 30, 120)  # K % 4 != 0
    assert not u12_hmma.hmma_applies(torch.zeros(8, 64, dtype=torch.bfloat16), 64, 241)  # not scaled


@pytest.mark.parametrize("m,narrow,rows", [(1, True, 8), (8, True, 8), (9, True, 16), (3, False, 16), (16, False, 16)])
def test_hmma_rows_a_program(monkeypatch, m, narrow, rows):
    """At most 8 rows of x take one n-tile (8 rows a program) where NARROW, else two (16)."""
    monkeypatch.setattr(u12_hmma, "NARROW", narrow)
    assert u12_hmma.hmma_rows(m) == rows


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("kind", ["few", "special"])
def test_one_n_tile_against_two(monkeypatch, m, kind):
    """1..8 rows of x give the reference's sums through one n-tile (NARROW: 8 rows a program) and
    through two (rows 8..15 re-reading the last row), with escapes (±inf and NaN among them) and
    split-K (3 ways, a masked last chunk)."""
    cfg = U12Config(64, 16, split_k=3, num_warps=2, num_stages=1, kernel="hmma")
    x, t = _make_inputs(_case(m, 40, 160, torch.bfloat16, kind), DEVICE, m)
    ref = u12_linear_reference(x, t).float()
    plan = u12_hmma._split_k_plan
    for narrow, rows in ((True, 8), (False, 16)):
        monkeypatch.setattr(u12_hmma, "NARROW", narrow)
        block_ms = []
        monkeypatch.setattr(u12_hmma, "_split_k_plan", lambda *a, **kw: block_ms.append(a[4]) or plan(*a, **kw))
        y = u12_linear(x, t, cfg).float()
        assert block_ms == [rows]
        torch.testing.assert_close(y, ref, rtol=8e-3, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("kernel", ["hmma", "mma"])
def test_default_tensor_core_config_leaves_fp32_x_at_few_rows_to_gemv2(monkeypatch, kernel):
    """The default's tensor-core configs at 3..4 rows are bf16 x's: fp32 x there runs gemv2, as
    before the tensor-core kernels took those rows; given explicitly, a config runs as asked (the
    mma kernel) or falls back to the tile kernel (hmma, which takes bf16 x only)."""
    from specpilot.kernels import u12_linear as ul

    cfg = U12Config(32 if kernel == "hmma" else 64, 32 if kernel == "hmma" else 16, split_k=2,
                    num_warps=1 if kernel == "hmma" else 4, num_stages=1, kernel=kernel)
    monkeypatch.setattr(ul, "default_config", lambda *a: cfg)
    gemv2 = []
    launch = ul._launch_gemv2
    monkeypatch.setattr(ul, "_launch_gemv2", lambda *a: gemv2.append(a[3]) or launch(*a))
    x, t = _make_inputs(_case(4, 40, 64, torch.float32, "few"), DEVICE, 4)
    ref = u12_linear_reference(x, t)
    torch.testing.assert_close(u12_linear(x, t), ref, rtol=1e-5, atol=1e-5)
    assert [c.kernel for c in gemv2] == ["gemv2"]
    torch.testing.assert_close(u12_linear(x, t, cfg), ref, rtol=1e-5, atol=1e-5)
    assert len(gemv2) == 1
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(u12_linear(xb, t).float(), u12_linear_reference(xb, t).float(),
                               rtol=8e-3, atol=1e-4)
    assert len(gemv2) == 1  # bf16 x: the tensor-core config


_HMMA = dict(num_stages=1, kernel="hmma")


@pytest.mark.parametrize("m,n,k,kind,cfg", [
    (16, 64, 256, "special", U12Config(64, 16, split_k=2, num_warps=2, **_HMMA)),  # one m-tile a warp, 2 splits
    (5, 48, 128, "few", U12Config(32, 32, num_warps=1, **_HMMA)),  # two m-tiles, the last program's second past N
    (9, 48, 384, "special", U12Config(32, 32, split_k=3, num_warps=1, **_HMMA)),  # 3 splits of one whole chunk
    (3, 32, 192, "few", U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)),  # one n-tile (NARROW)
    (12, 48, 320, "special", U12Config(32, 48, num_warps=1, **_HMMA)),  # 80 words: a chunk, then one masked
])
def test_tiled_weights_give_the_row_planes_sums(monkeypatch, m, n, k, kind, cfg):
    """The hmma kernel on a tiled weight (U12Tensor.layout "tiles": each warp's loads contiguous)
    gives the row planes' outputs bit for bit (the same words meet the same x, in the same order),
    escapes and non-finite values included; a wrong order of the tiles must show."""
    x, t = _make_inputs(_case(m, n, k, torch.bfloat16, kind), DEVICE, n)
    tiled = t.with_layout("tiles")
    y = u12_linear(x, t, cfg)
    torch.testing.assert_close(u12_linear(x, tiled, cfg), y, rtol=0, atol=0, equal_nan=True)
    ref = u12_linear_reference(x, t).float()
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-4, equal_nan=True)
    rolled = dataclasses.replace(tiled, sm=tiled.sm.view(-1).roll(16).view(tiled.sm.shape))
    assert not torch.allclose(u12_linear(x, rolled, cfg).float().nan_to_num(), ref.nan_to_num(), rtol=8e-3, atol=1e-4)


@pytest.mark.parametrize("m,gated,residual", [(5, True, False), (16, False, True), (8, True, True)])
def test_tiled_weights_in_the_fused_epilogues(m, gated, residual):
    """u12_fused_linear at 5+ rows on a tiled weight (the hmma kernel; gated, an m-tile's gate rows
    and up rows from two tiles): the row planes' outputs bit for bit."""
    from specpilot.kernels import u12_fused_linear as ufl
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(m)
    n_out, k = 24 if gated else 48, 192  # gated: 2 x 24 rows, the halves' tiles shared
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    ufl.plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(m, n_out, generator=g).to(torch.bfloat16).to(DEVICE) if residual else None
    cfg = U12Config(32, 32, num_warps=1, **_HMMA)
    out = [ufl.u12_fused_linear(x, tt, gated=gated, residual=None if r is None else r.clone(), config=cfg)
           for tt in (t, t.with_layout("tiles"))]
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)


@pytest.mark.parametrize("kw", [dict(block_n=48, block_w=16, num_warps=2), dict(block_n=64, block_w=24, num_warps=2),
                                dict(block_n=128, block_w=16, num_warps=2)])
def test_hmma_config_rejects_tiles_it_cannot_run(kw):
    with pytest.raises(ValueError, match="hmma kernel takes block_n 16 or 32 rows a warp"):
        U12Config(kernel="hmma", num_stages=1, **kw)


def test_bench_sweeps_hmma_configs_for_3_to_64_rows():
    import importlib.util
    from pathlib import Path

    from specpilot.kernels.u12_linear import SPLIT_KS_HMMA, SWEEP_HMMA

    path = Path(__file__).parent.parent / "bench" / "u12_linear.py"
    spec = importlib.util.spec_from_file_location("bench_u12_linear_hmma", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hmma = [cfg for cfg in bench.sweep_configs(16, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
    assert {dataclasses.replace(cfg, split_k=1) for cfg in hmma} == set(SWEEP_HMMA)
    assert {cfg.split_k for cfg in hmma} == set(SPLIT_KS_HMMA)
    assert [cfg for cfg in bench.sweep_configs(3, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
    for m in (2, 65):
        assert not [cfg for cfg in bench.sweep_configs(m, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
    for m in (17, 64):  # past 16 rows: 32-row programs, a warp one m-tile, and the tuned tile at its splits
        wide = [cfg for cfg in bench.sweep_configs(m, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
        assert wide and all(cfg.block_n == 16 * cfg.num_warps for cfg in wide)
        assert {cfg.split_k for cfg in wide if cfg.block_n == 32 and cfg.block_w == 32} == {1, 4, 8, 16}


@pytest.mark.parametrize("unroll", [1, 3])
def test_escape_walk_unrolled_gives_the_same_sums(monkeypatch, unroll):
    """ESC_UNROLL escapes a step of the epilogue's table walk: the same sums bit for bit as the
    default's (each row's escapes in order), with rows of 0 to 7 escapes so the walk's last step is
    partial; against the reference too, and a wrong escape value must show."""
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(unroll)
    w = 0.02 * torch.randn(48, 256, generator=g)
    for r in range(48):  # row r: r % 8 escapes (values below the exponent window)
        w[r, torch.randperm(256, generator=g)[: r % 8]] = 1e-30
    t = pack_u12(w.to(torch.bfloat16), layout="tiles").to(DEVICE)
    assert t.esc_idx.numel() >= sum(r % 8 for r in range(48))  # and the normal draws' few
    x = torch.randn(16, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = U12Config(32, 32, split_k=2, num_warps=1, **_HMMA)
    y = u12_linear(x, t, cfg)
    monkeypatch.setattr(u12_hmma, "ESC_UNROLL", unroll)
    assert torch.equal(u12_linear(x, t, cfg).view(torch.int16), y.view(torch.int16))
    torch.testing.assert_close(y.float(), u12_linear_reference(x, t).float(), rtol=8e-3, atol=1e-4)
    bad = dataclasses.replace(t, esc_val=t.esc_val.clone())
    bad.esc_val[-1] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16)
    assert not torch.equal(u12_linear(x, bad, cfg).view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("m,n,k,kind,cfg", [
    (16, 64, 256, "special", U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)),  # one group a chunk, 2 splits
    (5, 48, 384, "few", U12Config(16, 32, num_warps=1, **_HMMA)),  # two groups a chunk, one n-tile
    (9, 48, 384, "special", U12Config(32, 32, split_k=3, num_warps=2, **_HMMA)),  # 3 splits of one chunk each
    (13, 16, 448, "few", U12Config(16, 32, split_k=2, num_warps=1, **_HMMA)),  # 112 words: 2 splits, a masked tail
])
def test_words_loaded_a_chunk_ahead_give_the_same_sums(monkeypatch, m, n, k, kind, cfg):
    """``AHEAD`` (the next chunk's words loaded while this one decodes and multiplies): the one-stage
    loop's outputs bit for bit on both layouts, split-K and a masked last chunk included; a config it
    does not take (two m-tiles a warp) runs the one-stage loop."""
    x, t = _make_inputs(_case(m, n, k, torch.bfloat16, kind), DEVICE, n)
    launches = []
    kernel = u12_hmma._u12_hmma_kernel
    for layout in ("rows", "tiles"):
        w = t.with_layout(layout)
        monkeypatch.setattr(u12_hmma, "AHEAD", False)
        y = u12_linear(x, w, cfg)
        monkeypatch.setattr(u12_hmma, "AHEAD", True)
        with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, launches)):
            assert torch.equal(u12_linear(x, w, cfg).view(torch.int16), y.view(torch.int16))
    assert launches == [True, True]
    torch.testing.assert_close(y.float(), u12_linear_reference(x, t).float(), rtol=8e-3, atol=1e-4, equal_nan=True)
    two_tiles = dataclasses.replace(cfg, block_n=2 * cfg.block_n)
    with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, launches)):
        u12_linear(x, t, two_tiles)
    assert launches[-1] is False


def test_x_prefetch_goes_with_the_double_buffer(monkeypatch):
    """``AHEAD_X`` reaches the kernel only with AHEAD (a hint: the outputs stay the one-stage loop's
    bit for bit; on the GPU the prefetches run, under the interpreter they are skipped)."""
    x, t = _make_inputs(_case(16, 64, 256, torch.bfloat16, "special"), DEVICE, 64)
    cfg = U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)
    w = t.with_layout("tiles")
    y = u12_linear(x, w, cfg)
    launches = []
    kernel = u12_hmma._u12_hmma_kernel
    monkeypatch.setattr(u12_hmma, "AHEAD_X", True)
    for ahead in (False, True):
        monkeypatch.setattr(u12_hmma, "AHEAD", ahead)
        with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, launches, "AHEAD_X")):
            assert torch.equal(u12_linear(x, w, cfg).view(torch.int16), y.view(torch.int16))
    assert launches == [False, True]


def test_the_knobs_a_config_carries_reach_the_kernel():
    """``U12Config.ahead`` (with ``ahead_x``) and ``esc_split`` turn AHEAD and ESC_SPLIT on for one config (a TUNED_TILES
    entry) with the module's switches off: the same launch settings, the same sums as the switches;
    a config the double buffer does not take, or another kernel's, is refused at construction."""
    x, t = _make_inputs(_case(16, 64, 256, torch.bfloat16, "special"), DEVICE, 64)
    w = t.with_layout("tiles")
    assert not (u12_hmma.AHEAD or u12_hmma.ESC_SPLIT)
    cfg = U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)
    y = u12_linear(x, w, cfg)
    kernel, seen = u12_hmma._u12_hmma_kernel, {"AHEAD": [], "AHEAD_X": [], "ESC_SPLIT": []}
    for knob, knobs in (("AHEAD", dict(ahead=True)), ("AHEAD_X", dict(ahead=True, ahead_x=True)),
                        ("ESC_SPLIT", dict(esc_split=True))):
        with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, seen[knob], knob)):
            yk = u12_linear(x, w, dataclasses.replace(cfg, **knobs))
        if knob != "ESC_SPLIT":  # the double buffer: bit for bit; the shared walk: another rounding order
            assert torch.equal(yk.view(torch.int16), y.view(torch.int16))
        torch.testing.assert_close(yk.float(), y.float(), rtol=8e-3, atol=1e-4, equal_nan=True)
    assert seen == {"AHEAD": [True], "AHEAD_X": [True], "ESC_SPLIT": [True]}
    assert str(dataclasses.replace(cfg, ahead=True, ahead_x=True, esc_split=True)).endswith("-ahead-x-escsplit")
    with pytest.raises(ValueError, match="one m-tile a warp"):
        U12Config(32, 32, num_warps=1, ahead=True, **_HMMA)
    with pytest.raises(ValueError, match="one m-tile a warp"):
        U12Config(16, 64, num_warps=1, ahead=True, **_HMMA)
    with pytest.raises(ValueError, match="hmma kernel's"):
        U12Config(64, 32, split_k=2, kernel="mma", esc_split=True)
    with pytest.raises(ValueError, match="expected ahead=True"):
        U12Config(32, 32, num_warps=2, ahead_x=True, **_HMMA)


_W_CACHE_CASES = [  # (m, n, k, cfg): the interpreter runs the first (its loads take no cache policy); the GPU all
    (16, 32, 128, U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)),  # one m-tile a warp, 2 splits
    (13, 48, 448, U12Config(32, 32, num_warps=1, **_HMMA)),  # two m-tiles a warp, a masked last chunk
    (16, 48, 448, U12Config(32, 32, num_warps=2, ahead=True, **_HMMA)),  # the double buffer's loads
    (27, 48, 448, U12Config(32, 32, num_warps=2, **_HMMA)),  # 32-row programs (WIDE)
]


@pytest.mark.parametrize("m,n,k,cfg", _W_CACHE_CASES if NATIVE else _W_CACHE_CASES[:1])
def test_the_weight_loads_cache_policy_keeps_the_sums(monkeypatch, m, n, k, cfg):
    """``W_CACHE`` (the weight loads' cache modifier or eviction policy; by default L1 evict-first), from
    the module switch or a config's ``w_cache`` (which wins), reaches the kernel as W_POLICY and leaves
    every sum bit for bit; an unknown mode is refused by name."""
    x, t = _make_inputs(_case(m, n, k, torch.bfloat16, "special"), DEVICE, n)
    w = t.with_layout("tiles")
    y = u12_linear(x, w, cfg)
    assert u12_hmma.W_CACHE == "ef"
    kernel, seen = u12_hmma._u12_hmma_kernel, []
    for mode, policy in u12_hmma.W_CACHE_MODES.items():
        other = "cg" if mode != "cg" else "ca"  # a module switch the config's mode overrides
        for switch, field in ((mode, ""), (other, mode)):
            monkeypatch.setattr(u12_hmma, "W_CACHE", switch)
            with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, seen, "W_POLICY")), \
                    mock.patch.object(u12_hmma, "_w_cache", wraps=u12_hmma._w_cache) as chooser:
                assert torch.equal(u12_linear(x, w, dataclasses.replace(cfg, w_cache=field)).view(torch.int16),
                                   y.view(torch.int16)), (switch, field)
            assert chooser.call_args.args == (mode,) and seen[-1] == policy, (switch, field)
    if NATIVE:  # the compiled PTX: the weight loads carry the modifier, x's and the partials' keep theirs
        ptx = {}
        for mode in u12_hmma.W_CACHE_MODES:
            compiled = []
            with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Keep(kernel, compiled)):
                u12_linear(x, w, dataclasses.replace(cfg, w_cache=mode))
            ptx[mode] = compiled[-1].asm["ptx"]
        assert ptx["cg"].count("ld.global.cg") > ptx["ca"].count("ld.global.cg")
        assert ptx["ef"].count("evict_first") > ptx["ca"].count("evict_first") == 0
    assert str(dataclasses.replace(cfg, w_cache="cg")).endswith("-wcg")
    monkeypatch.setattr(u12_hmma, "W_CACHE", "cs")
    with pytest.raises(ValueError, match="u12_hmma.W_CACHE: expected one of"):
        u12_linear(x, w, cfg)
    with pytest.raises(ValueError, match="w_cache: expected"):
        U12Config(32, 32, num_warps=2, w_cache="cs", **_HMMA)
    with pytest.raises(ValueError, match="hmma kernel's"):
        U12Config(64, 32, kernel="mma", w_cache="cg")


class _Keep:
    """A launcher's stand-in that keeps each launch's compiled kernel (its ``asm``)."""

    def __init__(self, kernel, kept: list) -> None:
        self.kernel, self.kept = kernel, kept

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kept.append(self.kernel[grid](*args, **kwargs))
            return self.kept[-1]
        return launch


class _Spy:
    """A launcher's stand-in that records each launch's `key` setting and launches the kernel."""

    def __init__(self, kernel, seen: list, key: str = "AHEAD") -> None:
        self.kernel, self.seen, self.key = kernel, seen, key

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs.get(self.key))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("m,n,k,layout,cfg", [
    (16, 64, 256, "rows", U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)),  # 2 splits of one chunk
    (9, 48, 192, "tiles", U12Config(32, 16, split_k=3, num_warps=2, **_HMMA)),  # 3 splits, 9 rows: two n-tiles
    (13, 32, 320, "tiles", U12Config(32, 32, split_k=2, num_warps=1, **_HMMA)),  # two m-tiles a warp, a masked last split
])
def test_escapes_walked_by_the_splits(monkeypatch, m, n, k, layout, cfg):
    """``ESC_SPLIT`` (each split of a split-K launch walks escapes s, s + SPLIT_K, ... of its rows):
    the reference's outputs within the kernel's tolerance on either layout, non-finite weights
    included; a wrong escape value shows; without a split (nothing to share) the one walk, bit for
    bit."""
    x, t = _make_inputs(_case(m, n, k, torch.bfloat16, "special"), DEVICE, n)
    assert t.esc_row_ptr.diff().max() > cfg.split_k * u12_hmma.ESC_UNROLL  # some split walks more than a step
    ref = u12_linear_reference(x, t).float()
    launches = []
    kernel = u12_hmma._u12_hmma_kernel
    w = t.with_layout(layout)
    monkeypatch.setattr(u12_hmma, "ESC_SPLIT", True)
    with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, launches, "ESC_SPLIT")):
        y = u12_linear(x, w, cfg)
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-4, equal_nan=True)
    bad = dataclasses.replace(w, esc_val=w.esc_val.clone())
    lo, hi = int(w.esc_row_ptr[n // 2]), int(w.esc_row_ptr[n // 2 + 1])  # a middle row's escapes
    assert hi > lo
    bad.esc_val[lo:hi] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16)
    assert not torch.equal(u12_linear(x, bad, cfg).view(torch.int16), y.view(torch.int16))
    one = dataclasses.replace(cfg, split_k=1)
    with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(kernel, launches, "ESC_SPLIT")):
        y1 = u12_linear(x, w, one)
    monkeypatch.setattr(u12_hmma, "ESC_SPLIT", False)
    assert torch.equal(y1.view(torch.int16), u12_linear(x, w, one).view(torch.int16))
    assert launches == [True, False]


@pytest.mark.parametrize("mode", ["residual", "hand_out", "hand_in", "gated"])
def test_escapes_walked_by_the_splits_in_the_fused_epilogue(monkeypatch, mode):
    """``ESC_SPLIT`` under u12_fused_linear's residual epilogue (o and down at 5+ rows), a norm handed
    on (its parts) or handed in (its inv times the sums), and gated (an element's gate and up rows
    each walked by the splits): the one walk's outputs to its rounding, the reference's within the
    kernel's tolerance."""
    from specpilot.kernels import u12_fused_linear as ufl
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(7)
    n, k, m = 48, 384, 16
    gated = mode == "gated"
    w = 0.02 * torch.randn(2 * n if gated else n, k, generator=g)  # gated: [gate; up], n outputs
    ufl.plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).with_layout("tiles").to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)
    parts = (0.5 + torch.rand(3, m, generator=g)).to(DEVICE) * k

    def handoffs():
        h_out = ufl.NormHandoff((1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1))).to(
            torch.bfloat16).to(DEVICE)) if mode == "hand_out" else None
        h_in = ufl.NormHandoff(torch.ones(k, dtype=torch.bfloat16, device=DEVICE), 1e-6, xg=x,
                               parts=parts.clone()) if mode == "hand_in" else None
        return h_out, h_in

    cfg = U12Config(32, 32, split_k=3, num_warps=1, **_HMMA)
    outs = []
    for esc_split in (False, True):
        monkeypatch.setattr(u12_hmma, "ESC_SPLIT", esc_split)
        h_out, h_in = handoffs()
        outs.append((ufl.u12_fused_linear(x, t, gated=gated, residual=None if gated else r.clone(), config=cfg,
                                          hand_out=h_out, hand_in=h_in), h_out))
    (y0, h0), (y1, h1) = outs
    torch.testing.assert_close(y1.float(), y0.float(), rtol=8e-3, atol=1e-3)
    h_out, h_in = handoffs()
    ref = ufl.u12_fused_linear_reference(x, t, gated=gated, residual=None if gated else r.clone(), hand_out=h_out,
                                         hand_in=h_in)
    torch.testing.assert_close(y1.float(), ref.float(), rtol=8e-3, atol=1e-3)
    if mode == "hand_out":
        torch.testing.assert_close(h1.parts.sum(0), h0.parts.sum(0), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(h1.xg.float(), h0.xg.float(), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("m,n,k,layout,cfg", [
    (16, 48, 512, "rows", U12Config(16, 16, num_warps=4, warp_k=True, **_HMMA)),  # 4 warps of 32 words a row each
    (9, 32, 512, "tiles", U12Config(32, 16, split_k=2, num_warps=2, warp_k=True, **_HMMA)),  # 2 m-tiles a warp, 2 splits
    (16, 64, 512, "tiles", U12Config(16, 32, num_warps=2, warp_k=True, ahead=True, **_HMMA)),  # the double buffer
    (5, 16, 512, "tiles", U12Config(16, 16, num_warps=8, warp_k=True, **_HMMA)),  # 8 warps of one chunk each
])
def test_warps_splitting_the_words(m, n, k, layout, cfg):
    """``WARP_K`` (the warps share the program's rows; each multiplies its share of the words and
    walks its share of the escapes, summed across the warps after the loop): the reference's outputs
    within the kernel's tolerance and the warps-on-rows config's to its rounding (each layout in
    some case), non-finite weights included; a wrong escape shows."""
    x, t = _make_inputs(_case(m, n, k, torch.bfloat16, "special"), DEVICE, n)
    ref = u12_linear_reference(x, t).float()
    rows = dataclasses.replace(cfg, warp_k=False, block_n=cfg.block_n * cfg.num_warps)
    launches, walks = [], []  # WARP_K, and the warps walking the escapes in shares (ESC_SPLIT's walk)
    w = t.with_layout(layout)
    with mock.patch.object(u12_hmma, "_u12_hmma_kernel",
                           _Spy(_Spy(u12_hmma._u12_hmma_kernel, walks, "ESC_SPLIT"), launches, "WARP_K")):
        y = u12_linear(x, w, cfg)
    assert launches == [True] and walks == [True]
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(y.float(), u12_linear(x, w, rows).float(), rtol=8e-3, atol=1e-4, equal_nan=True)
    bad = dataclasses.replace(w, esc_val=w.esc_val.clone())
    lo, hi = int(w.esc_row_ptr[n // 2]), int(w.esc_row_ptr[n // 2 + 1])
    assert hi > lo
    bad.esc_val[lo:hi] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16)
    assert not torch.equal(u12_linear(x, bad, cfg).view(torch.int16), y.view(torch.int16))


def test_warps_on_rows_where_the_words_do_not_share_out():
    """A ``WARP_K`` config on a shape whose words do not split into whole chunks a warp (160 words,
    4 warps of 16) runs the warps on rows (block_n times the warps): the same sums bit for bit."""
    x, t = _make_inputs(_case(5, 48, 640, torch.bfloat16, "few"), DEVICE, 48)
    cfg = U12Config(16, 16, num_warps=4, warp_k=True, **_HMMA)
    launches = []
    with mock.patch.object(u12_hmma, "_u12_hmma_kernel", _Spy(u12_hmma._u12_hmma_kernel, launches, "WARP_K")):
        y = u12_linear(x, t, cfg)
    assert launches == [False]
    rows = U12Config(64, 16, num_warps=4, **_HMMA)
    assert torch.equal(y.view(torch.int16), u12_linear(x, t, rows).view(torch.int16))


@pytest.mark.parametrize("mode", ["residual", "hand_out", "gated"])
def test_warps_splitting_the_words_in_the_fused_epilogue(mode):
    """``WARP_K`` under u12_fused_linear's epilogues (warp 0 stores; a norm handed on gets the other
    warps' zero parts): the warps-on-rows outputs to their rounding, the reference's within the
    kernel's tolerance."""
    from specpilot.kernels import u12_fused_linear as ufl
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(11)
    n, k, m = 48, 512, 16
    gated = mode == "gated"
    w = 0.02 * torch.randn(2 * n if gated else n, k, generator=g)
    ufl.plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).with_layout("tiles").to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for cfg in (U12Config(16, 16, split_k=2, num_warps=2, warp_k=True, **_HMMA),
                U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)):
        h_out = ufl.NormHandoff(norm_w) if mode == "hand_out" else None
        outs.append((ufl.u12_fused_linear(x, t, gated=gated, residual=None if gated else r.clone(), config=cfg,
                                          hand_out=h_out), h_out))
    (y1, h1), (y0, h0) = outs
    torch.testing.assert_close(y1.float(), y0.float(), rtol=8e-3, atol=1e-3)
    h_out = ufl.NormHandoff(norm_w) if mode == "hand_out" else None
    ref = ufl.u12_fused_linear_reference(x, t, gated=gated, residual=None if gated else r.clone(), hand_out=h_out)
    torch.testing.assert_close(y1.float(), ref.float(), rtol=8e-3, atol=1e-3)
    if mode == "hand_out":
        torch.testing.assert_close(h1.parts.sum(0), h0.parts.sum(0), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(h1.xg.float(), h0.xg.float(), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("split_k,residual", [(1, False), (3, True)])
def test_phase_stamps_change_no_value_and_run_in_order(split_k, residual):
    """``TRACE_SLOTS`` (bench/hmma_trace.py): a launch with a stamp buffer gives the same y bit for bit
    as one without; every program stamps its entry and loop end in order, the programs that sum
    (one a row block) the semaphore, sum and epilogue after them, the others no more. Without a GPU
    the buffer is refused by name (the interpreter has no %globaltimer). Slot 5: each program's SM."""
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(split_k)
    w = (0.02 * torch.randn(96, 384, generator=g)).to(torch.bfloat16)
    t = pack_u12(w, layout="tiles").to(DEVICE)
    x = torch.randn(16, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = U12Config(32, 32, split_k=split_k, num_warps=2, **_HMMA)
    base = torch.randn(16, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    programs = (96 // 32) * split_k
    trace = torch.zeros(programs, u12_hmma.TRACE_SLOTS, dtype=torch.int64, device=DEVICE)
    if not NATIVE:
        with pytest.raises(ValueError, match="launch_hmma: trace: expected a CUDA int64 buffer"):
            u12_hmma.launch_hmma(x, t, base.clone(), cfg, residual=residual, trace=trace)
        return
    y0, y1 = base.clone(), base.clone()
    u12_hmma.launch_hmma(x, t, y0, cfg, residual=residual)
    u12_hmma.launch_hmma(x, t, y1, cfg, residual=residual, trace=trace)
    assert torch.equal(y0.view(torch.int16), y1.view(torch.int16))
    s = trace.cpu()
    assert (s[:, 0] > 0).all() and (s[:, 1] >= s[:, 0]).all()
    summing = s[:, 4] > 0
    assert int(summing.sum()) == 96 // 32  # one a row block
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert ((s[:, 5] >= 0) & (s[:, 5] < sms)).all()  # each program's SM
    if split_k > 1:
        assert (s[:, 2] >= s[:, 1]).all()
        assert (s[summing, 3] >= s[summing, 2]).all() and (s[summing, 4] >= s[summing, 3]).all()
        assert (s[~summing, 3] == 0).all()
    else:
        assert (s[:, 4] >= s[:, 1]).all() and (s[:, 2] == 0).all()


@pytest.mark.parametrize("m,n,k,split_k,residual", [
    (16, 48, 256, 2, False),  # rows of 0 to 10 escapes: past the 4 taken early, the walk goes on
    (9, 64, 384, 1, True),  # no split: the summing program is every program; a residual epilogue
    (16, 32, 448, 3, False),  # 112 words in 3 splits: a masked last chunk
])
def test_escapes_taken_early_give_the_same_sums(monkeypatch, m, n, k, split_k, residual):
    """``ESC_EARLY`` (escape pointers before the loop, each row's first 4 escapes after it): y bit
    for bit the default walk's, with rows of 0 to 10 escapes; against the reference; a wrong escape
    value among the first 4 of a row, and past them, must show."""
    from specpilot.formats.u12 import pack_u12

    g = torch.Generator().manual_seed(k + split_k)
    w = 0.02 * torch.randn(n, k, generator=g)
    for r in range(n):  # row r: r % 11 escapes (values below the exponent window)
        w[r, torch.randperm(k, generator=g)[: r % 11]] = 1e-30
    t = pack_u12(w.to(torch.bfloat16), layout="tiles").to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = U12Config(32, 32, split_k=split_k, num_warps=2, **_HMMA)
    base = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)

    def run(tt):
        y = base.clone()
        u12_hmma.launch_hmma(x, tt, y, cfg, residual=residual)
        return y

    monkeypatch.setattr(u12_hmma, "ESC_EARLY", "off")  # the walk all after the loop
    want = run(t)
    monkeypatch.setattr(u12_hmma, "ESC_EARLY", "split-k" if split_k > 1 else "all")
    kernel, taken = u12_hmma._u12_hmma_kernel, []

    class Spy:  # the launch's EARLY flag, then the kernel itself
        def __getitem__(self, grid):
            return lambda *a, **kw: (taken.append(kw["EARLY"]), kernel[grid](*a, **kw))

    monkeypatch.setattr(u12_hmma, "_u12_hmma_kernel", Spy())
    got = run(t)
    assert taken == [True]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = u12_linear_reference(x, t).float() + (base.float() if residual else 0)
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-2 if residual else 1e-4)
    if split_k == 1:  # "split-k" leaves a one-split launch as it was
        monkeypatch.setattr(u12_hmma, "ESC_EARLY", "split-k")
        taken.clear()
        assert torch.equal(run(t).view(torch.int16), want.view(torch.int16)) and taken == [False]
        monkeypatch.setattr(u12_hmma, "ESC_EARLY", "all")
    monkeypatch.setattr(u12_hmma, "ESC_EARLY", "early")
    with pytest.raises(ValueError, match="u12_hmma.ESC_EARLY: expected one of off, split-k, all, got 'early'"):
        run(t)
    monkeypatch.setattr(u12_hmma, "ESC_EARLY", "all")
    row10 = int(t.esc_row_ptr[10])  # row 10: 10 escapes (and maybe a normal draw's): the 2nd, 6th and 10th
    for j in (1, 5, 9):
        bad = dataclasses.replace(t, esc_val=t.esc_val.clone())
        bad.esc_val[row10 + j] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16)
        assert not torch.equal(run(bad).view(torch.int16), want.view(torch.int16)), j
