"""The hmma kernel (kernels/u12/hmma.py): mma.sync fragments, dispatch, rows a program, tiled weights,
the escapes walked early or after the loop, the fused epilogues, the phase stamps.

Its results against the reference on odd shapes are the registry's cases (tests/test_kernels.py,
"u12_hmma"). On the CPU the MMA is the kernel's emulation; on a GPU the PTX instruction.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, ON_GPU
from specpilot.formats.u12 import pack_u12
from specpilot.kernels.u12 import U12Config, dispatch, hmma, u12_linear, u12_linear_reference
from specpilot.kernels.u12 import fused as ufl
from specpilot.kernels.u12.cases import make_inputs, plant_escapes, u12_case

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]
_HMMA = dict(num_stages=1, kernel="hmma")


@triton.jit
def _one_mma(a_ptr, b_ptr, c_ptr, d_ptr, ASM: tl.constexpr):
    t = tl.arange(0, 32)
    d0, d1, d2, d3 = hmma.mma_sync(
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


def test_mma_fragments_follow_the_ptx_layout():
    """D = A B + C for A [16, 16], B [16, 8] laid out in the lanes as the PTX ISA's m16n8k16 figures
    say (lane l: g = l // 4, q = l % 4): the layout the kernel builds its fragments in."""
    g = torch.Generator().manual_seed(0)
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
    _one_mma[(1,)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), d, ASM=ON_GPU, num_warps=1)
    D = torch.empty(16, 8)
    d = d.cpu()
    D[r, 2 * q], D[r, 2 * q + 1], D[r + 8, 2 * q], D[r + 8, 2 * q + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    torch.testing.assert_close(D, A.float() @ B.float() + C, rtol=1e-5, atol=1e-5)


def test_registry_cases_run_the_hmma_kernel(monkeypatch):
    """An hmma config runs the hmma kernel (not a fallback) where it applies: bf16 x of 1..64 rows,
    K % 4 == 0, a scaled base; the registry's other cases fall back to the tile kernel."""
    from specpilot.kernels import KERNELS

    launched = []
    monkeypatch.setattr(dispatch, "launch_hmma", lambda x, t, y, cfg, **kw: launched.append(x.shape[0]))
    spec = KERNELS["u12_hmma"]
    for i, case in enumerate(spec.cases):
        x, t = spec.make_inputs(case, DEVICE, i)
        before = len(launched)
        if hmma.hmma_applies(x, case["K"], t.base):
            spec.run(x, t)
            assert launched[before:] == [case["M"]], case
    assert len(launched) == 6  # the cases meant for it
    assert hmma.hmma_applies(torch.zeros(3, 64, dtype=torch.bfloat16), 64, 120)
    assert hmma.hmma_applies(torch.zeros(64, 64, dtype=torch.bfloat16), 64, 1)
    assert not hmma.hmma_applies(torch.zeros(8, 64, dtype=torch.float32), 64, 120)  # fp32 x
    assert not hmma.hmma_applies(torch.zeros(65, 64, dtype=torch.bfloat16), 64, 120)  # past MAX_M
    assert not hmma.hmma_applies(torch.zeros(8, 30, dtype=torch.bfloat16), 30, 120)  # K % 4 != 0
    assert not hmma.hmma_applies(torch.zeros(8, 64, dtype=torch.bfloat16), 64, 241)  # not scaled


@pytest.mark.parametrize("m,tiles,rows", [(1, 1, 8), (8, 2, 8), (9, 1, 16), (16, 2, 16), (17, 1, 32), (17, 2, 16),
                                          (64, 1, 32)])
def test_rows_a_program(m, tiles, rows):
    """At most 8 rows of x one n-tile (8 rows a program); past 16, 32-row programs where each warp
    holds one m-tile, else 16."""
    assert hmma.hmma_rows(m, tiles) == rows


def test_default_tensor_core_config_leaves_fp32_x_at_few_rows_to_gemv2(monkeypatch):
    """The default's tensor-core configs at 3..4 rows are bf16 x's: fp32 x there runs gemv2; given
    explicitly, an hmma config falls back to the tile kernel (hmma takes bf16 x only)."""
    cfg = U12Config(32, 32, split_k=2, num_warps=1, **_HMMA)
    monkeypatch.setattr(dispatch, "default_config", lambda *a: cfg)
    gemv2 = []
    launch = dispatch.launch_gemv2
    monkeypatch.setattr(dispatch, "launch_gemv2", lambda *a: gemv2.append(a[3]) or launch(*a))
    x, t = make_inputs(u12_case(4, 40, 64, torch.float32, "few"), DEVICE, 4)
    ref = u12_linear_reference(x, t)
    torch.testing.assert_close(u12_linear(x, t), ref, rtol=1e-5, atol=1e-5)
    assert [c.kernel for c in gemv2] == ["gemv2"]
    torch.testing.assert_close(u12_linear(x, t, cfg), ref, rtol=1e-5, atol=1e-5)
    assert len(gemv2) == 1


@pytest.mark.parametrize("m,n,k,kind,cfg", [
    (16, 64, 128, "special", U12Config(64, 16, split_k=2, num_warps=2, **_HMMA)),  # one m-tile a warp, 2 splits
    (3, 32, 192, "few", U12Config(32, 16, split_k=2, num_warps=2, **_HMMA)),  # one n-tile
    (12, 32, 192, "few", U12Config(32, 32, num_warps=1, **_HMMA)),  # 48 words: a chunk, then one masked
])
def test_tiled_weights_give_the_row_planes_sums(m, n, k, kind, cfg):
    """The hmma kernel on a tiled weight (U12Tensor.layout "tiles": each warp's loads contiguous)
    gives the row planes' outputs bit for bit (the same words meet the same x, in the same order),
    escapes and non-finite values included; a wrong order of the tiles must show."""
    x, t = make_inputs(u12_case(m, n, k, torch.bfloat16, kind), DEVICE, n)
    tiled = t.with_layout("tiles")
    y = u12_linear(x, t, cfg)
    torch.testing.assert_close(u12_linear(x, tiled, cfg), y, rtol=0, atol=0, equal_nan=True)
    ref = u12_linear_reference(x, t).float()
    torch.testing.assert_close(y.float(), ref, rtol=8e-3, atol=1e-4, equal_nan=True)
    rolled = dataclasses.replace(tiled, sm=tiled.sm.view(-1).roll(16).view(tiled.sm.shape))
    assert not torch.allclose(u12_linear(x, rolled, cfg).float().nan_to_num(), ref.nan_to_num(), rtol=8e-3, atol=1e-4)


@pytest.mark.parametrize("m,gated,residual", [(5, True, False), (16, False, True)])
def test_tiled_weights_in_the_fused_epilogues(m, gated, residual):
    """u12_fused_linear at 5+ rows on a tiled weight (the hmma kernel; gated, an m-tile's gate rows
    and up rows from two tiles): the row planes' outputs bit for bit."""
    g = torch.Generator().manual_seed(m)
    n_out, k = 24 if gated else 48, 128  # gated: 2 x 24 rows, the halves' tiles shared
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    plant_escapes(w, g, gated)
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


def _escaped_rows(n: int, k: int, most: int, seed: int):
    """A tiled weight whose row r holds r % (most + 1) escapes (values below the exponent window)."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(n, k, generator=g)
    for r in range(n):
        w[r, torch.randperm(k, generator=g)[: r % (most + 1)]] = 1e-30
    return pack_u12(w.to(torch.bfloat16), layout="tiles").to(DEVICE), g


@pytest.mark.parametrize("m,n,k,split_k,residual", [
    (16, 32, 256, 2, False),  # rows of 0 to 10 escapes: past the 4 taken early, the walk goes on
    (9, 32, 192, 1, True),  # no split: the summing program is every program; a residual epilogue
])
def test_escapes_taken_early_give_the_walk_after_the_loop(monkeypatch, m, n, k, split_k, residual):
    """One m-tile a warp takes its rows' escape pointers before the loop and their first 4 escapes
    after it (EARLY); two m-tiles a warp walk them all after the loop: the same y bit for bit (the
    same sums in the same order, each row's escapes in order, the walk 2 escapes a step so its last
    step is partial), the reference's within tolerance; a wrong escape value among the first 4 of a
    row, and past them, must show."""
    t, g = _escaped_rows(n, k, 10, k + split_k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    base = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)
    early, after = (U12Config(32, 32, split_k=split_k, num_warps=warps, **_HMMA) for warps in (2, 1))
    kernel, taken = hmma._u12_hmma_kernel, []

    class Spy:  # the launch's EARLY flag, then the kernel itself
        def __getitem__(self, grid):
            return lambda *a, **kw: (taken.append(kw["EARLY"]), kernel[grid](*a, **kw))

    monkeypatch.setattr(hmma, "_u12_hmma_kernel", Spy())

    def run(tt, cfg):
        y = base.clone()
        hmma.launch_hmma(x, tt, y, cfg, residual=residual)
        return y

    want, got = run(t, after), run(t, early)
    assert taken == [False, True]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ref = u12_linear_reference(x, t).float() + (base.float() if residual else 0)
    torch.testing.assert_close(got.float(), ref, rtol=8e-3, atol=1e-2 if residual else 1e-4)
    row10 = int(t.esc_row_ptr[10])  # row 10: 10 escapes (and maybe a normal draw's): the 2nd, 6th and 10th
    for j in (1, 5, 9):
        bad = dataclasses.replace(t, esc_val=t.esc_val.clone())
        bad.esc_val[row10 + j] = torch.tensor(4.0, dtype=torch.bfloat16).view(torch.int16)
        assert not torch.equal(run(bad, early).view(torch.int16), want.view(torch.int16)), j


@pytest.mark.parametrize("mode", ["hand_out", "hand_in"])
def test_fused_epilogues_at_many_rows(mode):
    """u12_fused_linear's norm handoffs in the hmma kernel at 16 rows, split-K 3, on tiles: a norm
    handed on (its xg and parts, with the residual add) or in (its inv times the sums): the
    reference's within the kernel's tolerance. (The residual and gated epilogues alone:
    test_u12_fused_linear.py's test_hmma_epilogue, and here the tiles against the rows.)"""
    g = torch.Generator().manual_seed(7)
    n, k, m = 48, 384, 16
    gated = mode == "gated"
    w = 0.02 * torch.randn(2 * n if gated else n, k, generator=g)  # gated: [gate; up], n outputs
    plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).with_layout("tiles").to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(m, n, generator=g).to(torch.bfloat16).to(DEVICE)
    parts = (0.5 + torch.rand(3, m, generator=g)).to(DEVICE) * k
    norm_w = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)

    def handoffs():
        h_out = ufl.NormHandoff(norm_w) if mode == "hand_out" else None
        h_in = ufl.NormHandoff(torch.ones(k, dtype=torch.bfloat16, device=DEVICE), 1e-6, xg=x,
                               parts=parts.clone()) if mode == "hand_in" else None
        return h_out, h_in

    h_out, h_in = handoffs()
    y = ufl.u12_fused_linear(x, t, gated=gated, residual=None if gated else r.clone(),
                             config=U12Config(32, 32, split_k=3, num_warps=1, **_HMMA), hand_out=h_out, hand_in=h_in)
    ref_out, ref_in = handoffs()
    ref = ufl.u12_fused_linear_reference(x, t, gated=gated, residual=None if gated else r.clone(), hand_out=ref_out,
                                         hand_in=ref_in)
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-3)
    if mode == "hand_out":
        torch.testing.assert_close(h_out.parts.sum(0), ref_out.parts.sum(0), rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(h_out.xg.float(), ref_out.xg.float(), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("split_k,residual", [(1, False), (3, True)])
def test_phase_stamps_change_no_value_and_run_in_order(split_k, residual):
    """``TRACE_SLOTS`` (bench/kernels/hmma_trace.py): a launch with a stamp buffer gives the same y
    bit for bit as one without; every program stamps its entry and loop end in order, the programs
    that sum (one a row block) the semaphore, sum and epilogue after them, the others no more.
    Without a GPU the buffer is refused by name (the interpreter has no %globaltimer). Slot 5: each
    program's SM."""
    g = torch.Generator().manual_seed(split_k)
    w = (0.02 * torch.randn(96, 384, generator=g)).to(torch.bfloat16)
    t = pack_u12(w, layout="tiles").to(DEVICE)
    x = torch.randn(16, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = U12Config(32, 32, split_k=split_k, num_warps=2, **_HMMA)
    base = torch.randn(16, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    programs = (96 // 32) * split_k
    trace = torch.zeros(programs, hmma.TRACE_SLOTS, dtype=torch.int64, device=DEVICE)
    if not ON_GPU:
        with pytest.raises(ValueError, match="launch_hmma: trace: expected a CUDA int64 buffer"):
            hmma.launch_hmma(x, t, base.clone(), cfg, residual=residual, trace=trace)
        return
    y0, y1 = base.clone(), base.clone()
    hmma.launch_hmma(x, t, y0, cfg, residual=residual)
    hmma.launch_hmma(x, t, y1, cfg, residual=residual, trace=trace)
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


@pytest.mark.gpu
def test_weight_loads_are_evict_first_and_x_loads_plain():
    """The hmma kernel's weight loads carry L1 evict-first (each weight byte is read once; x's words,
    which every warp reads again, keep L1), x's and the partials' loads do not (the PTX)."""
    x, t = make_inputs(u12_case(16, 32, 128, torch.bfloat16, "special"), DEVICE, 32)
    kept = []
    kernel = hmma._u12_hmma_kernel

    class Keep:
        def __getitem__(self, grid):
            return lambda *a, **kw: kept.append(kernel[grid](*a, **kw))

    hmma._u12_hmma_kernel = Keep()
    try:
        u12_linear(x, t.with_layout("tiles"), U12Config(32, 16, split_k=2, num_warps=2, **_HMMA))
    finally:
        hmma._u12_hmma_kernel = kernel
    ptx = kept[-1].asm["ptx"]
    loads = [line for line in ptx.splitlines() if "ld.global" in line]
    assert any("evict_first" in line for line in loads) and any("evict_first" not in line for line in loads)
