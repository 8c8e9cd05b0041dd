"""The mma kernel (kernels/u12/mma.py): that the registry's "u12_mma" cases run it (their numbers are
tests/test_kernels.py's), the K order its two dot operands share, its bf16 planes' bits on every
pattern, an exact decode through the whole kernel (split-K, masked chunk), and the escapes of the
block kernels (tile, mma, hmma) from the table.

Without a GPU the kernel runs in Triton's interpreter: fp32 planes and dots, the PTX emulated; the
bf16 planes the GPU feeds to wgmma are checked bit for bit here, since the interpreter's bf16 dot
cannot be. With a GPU the native path runs too.
"""

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from specpilot.formats.u12 import pack_u12, unpack_u12
from specpilot.kernels import KERNELS
from specpilot.kernels.u12 import U12Config, dispatch, u12_linear, u12_linear_reference
from specpilot.kernels.u12.cases import make_inputs, plant_wrong_weight
from specpilot.kernels.u12.mma import mma_applies, mma_planes, w_in_dot_order, x_in_dot_order

# inf/NaN weights are planted on purpose; the interpreter's numpy warns about them.
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


@pytest.fixture
def mma_launches(monkeypatch):
    """Counts launches of the mma kernel (the dispatcher looks the launcher up on each call)."""
    calls = []
    launch = dispatch.launch_mma
    monkeypatch.setattr(dispatch, "launch_mma", lambda *a, **k: (calls.append(a[3]), launch(*a, **k))[1])
    return calls


def test_registry_cases_run_the_mma_kernel(monkeypatch):
    """The registry's "u12_mma" cases launch the mma kernel wherever it applies (K % 4 == 0, a scaled
    base), the tile kernel elsewhere."""
    launched = []
    monkeypatch.setattr(dispatch, "launch_mma", lambda x, t, y, cfg, **kw: launched.append(x.shape[0]))
    spec = KERNELS["u12_mma"]
    for i, case in enumerate(spec.cases):
        x, t = spec.make_inputs(case, DEVICE, i)
        if mma_applies(case["M"], case["K"], t.base):
            before = len(launched)
            spec.run(x, t)
            assert launched[before:] == [case["M"]], case
    assert len(launched) == 7  # all but the unscaled base and K % 4 != 0


def test_mma_applies_only_to_the_scaled_word_path():
    assert mma_applies(5, 64, 120) and mma_applies(64, 4096, 1) and mma_applies(300, 4, 240)
    assert mma_applies(1, 64, 120) and mma_applies(4, 64, 120)  # a 16-row program, the rest re-read
    assert not mma_applies(16, 30, 120) and not mma_applies(16, 0, 120)  # byte loads
    assert not mma_applies(16, 64, 0) and not mma_applies(16, 64, 241)  # unscaled windows


@pytest.mark.parametrize("m", [1, 4])
def test_mma_config_runs_few_rows_in_a_16_row_program(mma_launches, m):
    """Below 16 rows (TENSOR_CORE_ROWS's 3 and 4 among them) one program of 16 rows, those past M
    re-reading the last: the reference's sums, and only M rows written."""
    x, t = make_inputs({"M": m, "N": 9, "K": 64, "dtype": torch.float32, "escapes": "few"}, DEVICE, seed=3)
    y = u12_linear(x, t, U12Config(64, 16, kernel="mma"))
    assert len(mma_launches) == 1 and y.shape == (m, 9)
    torch.testing.assert_close(y, x @ unpack_u12(t).float().T, atol=1e-5, rtol=1e-5)


def test_mma_reads_strided_x(mma_launches):
    """A transposed view is copied to contiguous rows first (word and element loads assume them)."""
    x, t = make_inputs({"M": 6, "N": 9, "K": 40, "dtype": torch.bfloat16, "escapes": "few"}, DEVICE, seed=5)
    x_t = x.T.contiguous().T
    assert x_t.stride(1) != 1
    y = u12_linear(x_t, t, U12Config(64, 16, kernel="mma"))
    assert len(mma_launches) == 1
    torch.testing.assert_close(y, u12_linear(x, t, U12Config(64, 16, kernel="mma")), atol=0, rtol=0)


@pytest.mark.parametrize("k,split_k", [(64, 1), (72, 2)])
def test_mma_decodes_bit_exactly(k, split_k, mma_launches):
    """x = I (fp32): each output is one weight times 1 plus zeros, through the planes' K order, the
    scales, split-K (72: a full chunk, then a split of one masked chunk) and the escapes."""
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(70, k, generator=g) * 0.02).to(torch.bfloat16)
    flat = w.view(torch.int16).view(-1)
    flat[::7] = torch.randint(-0x8000, 0x8000, (len(flat[::7]),), generator=g, dtype=torch.int16)  # any pattern
    t = pack_u12(w).to(DEVICE)
    x = torch.eye(k, device=DEVICE)
    y = u12_linear(x, t, U12Config(64, 16, split_k=split_k, kernel="mma"))
    assert len(mma_launches) == 1
    ref = x @ unpack_u12(t).float().T  # same 0·inf = NaN as the kernel where a weight is inf or NaN
    finite = torch.isfinite(ref)
    assert torch.equal(y[finite].view(torch.int32), ref[finite].view(torch.int32))
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[ref.isinf()], ref[ref.isinf()])


@triton.jit
def _dot_order_kernel(out_w_ptr, out_x_ptr, BW: tl.constexpr):
    """Weight indices 4 w + j through both operands' K order: W's row 0 and x's column 0."""
    w_row = tl.arange(0, BW)[None, :] + tl.zeros((2, BW), tl.int32)  # [BN = 2, BW] word indices
    w = w_in_dot_order(4 * w_row, 4 * w_row + 1, 4 * w_row + 2, 4 * w_row + 3)
    tl.store(out_w_ptr + tl.arange(0, 2)[:, None] * 4 * BW + tl.arange(0, 4 * BW)[None, :], w)
    x_col = tl.arange(0, BW)[:, None] + tl.zeros((BW, 2), tl.int32)  # [BW, BM = 2]
    x = x_in_dot_order(4 * x_col, 4 * x_col + 1, 4 * x_col + 2, 4 * x_col + 3)
    tl.store(out_x_ptr + tl.arange(0, 4 * BW)[:, None] * 2 + tl.arange(0, 2)[None, :], x)


def test_both_operands_share_the_k_order():
    bw = 16
    out_w = torch.empty(2, 4 * bw, dtype=torch.int32, device=DEVICE)
    out_x = torch.empty(4 * bw, 2, dtype=torch.int32, device=DEVICE)
    _dot_order_kernel[(1,)](out_w, out_x, BW=bw)
    assert torch.equal(out_w[0], out_x[:, 0])
    assert torch.equal(out_w[1], out_w[0]) and torch.equal(out_x[:, 1], out_x[:, 0])
    assert sorted(out_w[0].tolist()) == list(range(4 * bw)), "a permutation of the chunk's weights"
    # k = 2 BW q + 2 w + h holds plane 2 h + q: each pair register (planes 0 and 2, 1 and 3) stays whole
    expected = [4 * w + 2 * h + q for q in range(2) for w in range(bw) for h in range(2)]
    assert out_w[0].tolist() == expected


@triton.jit
def _bf16_planes_kernel(sm_ptr, codes_ptr, out_ptr, BN: tl.constexpr, BW: tl.constexpr):
    """The bf16 planes the GPU feeds to wgmma (PTX emulated), stored as bits in k order."""
    rows, cols = tl.arange(0, BN)[:, None], tl.arange(0, BW)[None, :]
    s = tl.load(sm_ptr + rows * BW + cols)
    c = tl.load(codes_ptr + rows * BW + cols).to(tl.int32)
    w0, w1, w2, w3 = mma_planes(s, c, True, False)
    out = out_ptr + rows * 4 * BW + 4 * cols
    tl.store(out, w0.to(tl.int16, bitcast=True))
    tl.store(out + 1, w1.to(tl.int16, bitcast=True))
    tl.store(out + 2, w2.to(tl.int16, bitcast=True))
    tl.store(out + 3, w3.to(tl.int16, bitcast=True))


def test_bf16_planes_bit_exact():
    """Every bf16 pattern, packed with base 1: an in-window weight decodes to its bits times
    2^-(base-1) = 1 (the exponent field is the code), an escape to +0."""
    n, k = 64, 1024
    w = torch.arange(n * k, dtype=torch.int32)
    w = torch.where(w >= 0x8000, w - 0x10000, w).to(torch.int16).view(torch.bfloat16).reshape(n, k)
    t = pack_u12(w, base=1)
    out = torch.empty(n, k, dtype=torch.int16, device=DEVICE)
    sm, codes = t.sm.view(torch.int32).to(DEVICE), t.codes.view(torch.int16).to(DEVICE)
    _bf16_planes_kernel[(1,)](sm, codes, out, BN=n, BW=k // 4)
    out = out.cpu()
    escaped = torch.zeros(n * k, dtype=torch.bool)
    escaped[t.esc_idx.long()] = True
    escaped = escaped.view(n, k)
    assert not out[escaped].any(), "escapes decode to +0.0"
    assert torch.equal(out[~escaped], w.view(torch.int16)[~escaped])


def test_config_names():
    assert str(U12Config(128, 32, split_k=2, num_warps=4, num_stages=3, kernel="mma")) == "mma-bn128-bw32-sk2-w4-s3"
    with pytest.raises(ValueError, match="'mma'"):
        U12Config(64, 16, kernel="wgmma")


# --- the escapes of the kernels for M >= 5 ----------------------------------------------------

_DOT_CONFIGS = {  # split-K 2: the last program of a block adds the escapes
    "tile": U12Config(16, 8, split_k=2, num_warps=4),  # 7 rows: BLOCK_M 16, tl.dot
    "mma": U12Config(64, 16, split_k=2, num_warps=4, kernel="mma"),
    "hmma": U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma"),
}


@pytest.mark.parametrize("kernel", list(_DOT_CONFIGS))
@pytest.mark.parametrize("most", [3, 17], ids=["one-block", "two-blocks"])
def test_block_kernels_add_the_tables_escapes(monkeypatch, kernel, most):
    """The tile (tl.dot), mma and hmma kernels add a row's escapes from the table after the loop:
    rows of 0..most escapes (17: a program's block holds more than ESC_BLOCK, walked in two), one
    row's holding inf (it stays in that row). Each run asserts the kernel it took."""
    from specpilot.kernels.u12 import dispatch

    launched = []
    for name in ("launch_mma", "launch_hmma"):
        launch = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _l=launch, _n=name, **k: (launched.append(_n), _l(*a, **k))[1])
    g = torch.Generator().manual_seed(most)
    m, n, k = 7, 20, 96
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = 0.02 * torch.randn(n, k, generator=g)
    base = pack_u12(w.to(torch.bfloat16)).base
    for row in range(n):
        cols = torch.randperm(k, generator=g)[: (most, 0, 1, 2)[row % 4]]
        w[row, cols] = 0.5 * torch.randn(len(cols), generator=g).sign()  # outside the window: escapes
    w[5, 7] = float("inf")
    t = pack_u12(w.to(torch.bfloat16), base=base).to(DEVICE)
    x = x.to(DEVICE)
    cfg = _DOT_CONFIGS[kernel]
    y = u12_linear(x, t, cfg)
    assert launched == ([] if kernel == "tile" else [f"launch_{kernel}"])
    ref = u12_linear_reference(x, t)
    atol, rtol = KERNELS["u12_linear"].tolerance[torch.bfloat16]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol, equal_nan=True)
    assert y[:, 5].isinf().all() and torch.isfinite(y[:, [r for r in range(n) if r != 5]]).all()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(u12_linear(*plant_wrong_weight((x, t)), cfg), ref, atol=atol, rtol=rtol,
                                   equal_nan=True)
