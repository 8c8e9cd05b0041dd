"""The gemv2 kernel of kernels/u12_linear.py: its byte-permute and bit-select helpers against the
PTX semantics, and the kernel against the reference on odd shapes (tests/test_kernels.py runs the
"u12_gemv2" registry cases; tests/test_u12_format.py checks its decode's bits on every pattern).

Without a GPU only the shift-and-mask emulation runs; with one, the inline PTX is checked too.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from specpilot.kernels import KERNELS
from specpilot.kernels import u12_linear as u12_linear_module
from specpilot.kernels.u12_linear import (
    SWEEP_GEMV2,
    U12Config,
    _make_inputs,
    _plant_wrong_weight,
    _prmt,
    _select_bits,
    gemv2_acc_registers,
    gemv2_applies,
    u12_linear,
    u12_linear_reference,
)
from specpilot.formats.u12 import pack_u12, unpack_u12

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ASM_MODES = [False, True] if torch.cuda.is_available() else [False]
# inf/NaN weights are planted on purpose; the interpreter's numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def prmt_reference(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32, default mode, selectors without the sign bit: byte i <- byte sel_i of {b, a}."""
    pair = (b & 0xFFFFFFFF) << 32 | (a & 0xFFFFFFFF)
    return sum(((pair >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def random_words(n: int, seed: int) -> torch.Tensor:
    """int32 words with every byte value likely, sign bits included."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)


def as_unsigned(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.tolist()]


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, out_ptr, SELECTOR: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _prmt(tl.load(a_ptr + offs), tl.load(b_ptr + offs), SELECTOR, ASM))


@triton.jit
def _select_kernel(a_ptr, b_ptr, out_ptr, MASK: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _select_bits(tl.load(a_ptr + offs), tl.load(b_ptr + offs), MASK, ASM))


@pytest.mark.parametrize("asm", ASM_MODES)
@pytest.mark.parametrize("selector", [0x2200, 0x3311, 0x4140, 0x6240, 0x7351, 0x0123, 0x7654])
def test_prmt_matches_ptx(selector, asm):
    a, b = random_words(256, 1), random_words(256, 2)
    out = torch.empty_like(a).to(DEVICE)
    _prmt_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, SELECTOR=selector, ASM=asm, BLOCK=256)
    expected = [prmt_reference(x, y, selector) for x, y in zip(as_unsigned(a), as_unsigned(b))]
    assert as_unsigned(out.cpu()) == expected


@pytest.mark.parametrize("asm", ASM_MODES)
def test_select_bits_takes_masked_bits_from_the_first(asm):
    a, b = random_words(256, 3), random_words(256, 4)
    mask = 0x7F807F80
    out = torch.empty_like(a).to(DEVICE)
    _select_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, MASK=mask, ASM=asm, BLOCK=256)
    expected = [(x & mask) | (y & ~mask & 0xFFFFFFFF) for x, y in zip(as_unsigned(a), as_unsigned(b))]
    assert as_unsigned(out.cpu()) == expected


# --- the kernel against the reference ---------------------------------------------------------

_CASES = [  # (M, N, K, dtype, escapes, block_n, block_w)
    (1, 7, 36, torch.bfloat16, "none", 4, 4),  # N % block_n != 0, 9 words: a masked last chunk
    (1, 8, 64, torch.bfloat16, "few", 4, 4),  # every block full: no masks at all
    (2, 33, 300, torch.float32, "special", 8, 16),  # 75 words: 4 chunks and a masked one
    (3, 16, 128, torch.float32, "few", 8, 8),  # BLOCK_M 4: one re-read row of x; blocks full
    (4, 67, 300, torch.bfloat16, "special", 16, 8),
    (4, 32, 256, torch.bfloat16, "few", 16, 16),  # blocks full
]


def _assert_matches(y: torch.Tensor, x: torch.Tensor, t) -> None:
    ref = u12_linear_reference(x, t)
    atol, rtol = KERNELS["u12_linear"].tolerance[ref.dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("m,n,k,dtype,escapes,block_n,block_w", _CASES)
def test_gemv2_matches_reference(m, n, k, dtype, escapes, block_n, block_w):
    x, t = _make_inputs({"M": m, "N": n, "K": k, "dtype": dtype, "escapes": escapes}, DEVICE, seed=m * 100 + k)
    cfg = U12Config(block_n, block_w, num_warps=1, kernel="gemv2")
    assert gemv2_applies(m, k, t.base), "the case must run the gemv2 kernel, not the tile kernel"
    y = u12_linear(x, t, cfg)
    _assert_matches(y, x, t)
    y_bad = u12_linear(*_plant_wrong_weight((x, t)), cfg)
    with pytest.raises(AssertionError):
        _assert_matches(y_bad, x, t)


ESCAPE_WAYS = {"lanes": ("lanes", True), "table-ahead": ("table", True), "table-after": ("table", False)}


@pytest.mark.parametrize("way", list(ESCAPE_WAYS))
@pytest.mark.parametrize("per_row", [(0, 1, 3, 2), (9, 0, 1, 8), (17, 0, 1, 2)],
                         ids=["one-block", "two-blocks", "past-lanes"])
def test_gemv2_escapes_every_way(monkeypatch, way, per_row):
    """Programs of 4 rows with up to ESC_BLOCK (16) escapes, and with more (a second block, loaded
    after the first), found in the rows' lanes (``ESC_LANES``) or in the table with its row pointers
    loaded ahead of the loop (``ESC_AHEAD``) or after it; a row of 17 escapes has no lanes, so
    there the kernel walks the table whatever ESC_LANES says."""
    lanes_mode, ahead = ESCAPE_WAYS[way]
    monkeypatch.setattr(u12_linear_module, "ESC_LANES", lanes_mode)
    monkeypatch.setattr(u12_linear_module, "ESC_AHEAD", ahead)
    g = torch.Generator().manual_seed(21)
    m, n, k = 2, 10, 96  # the last program holds 2 rows
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = 0.02 * torch.randn(n, k, generator=g)
    base = pack_u12(w.to(torch.bfloat16)).base
    for row in range(n):
        cols = torch.randperm(k, generator=g)[: per_row[row % 4]]
        w[row, cols] = 0.5 * torch.randn(len(cols), generator=g).sign()  # outside the window: escapes
    t = pack_u12(w.to(torch.bfloat16), base=base)
    per_program = [int(t.esc_row_ptr[min(p + 4, n)] - t.esc_row_ptr[p]) for p in range(0, n, 4)]
    assert (max(per_program) > 16) == (sum(per_row) > 16)
    x, t = x.to(DEVICE), t.to(DEVICE)
    lanes = u12_linear_module.lanes_args(t)[1]
    expected = {(0, 1, 3, 2): 4, (9, 0, 1, 8): 16}.get(per_row, 0) if lanes_mode == "lanes" else 0
    assert lanes == expected, "the way the test means to walk"
    cfg = U12Config(4, 8, num_warps=1, kernel="gemv2")
    _assert_matches(u12_linear(x, t, cfg), x, t)
    with pytest.raises(AssertionError):
        _assert_matches(u12_linear(*_plant_wrong_weight((x, t)), cfg), x, t)


def test_escape_lanes_setting_is_checked(monkeypatch):
    """ESC_LANES names where the GEMVs find their escapes; anything else is refused by name."""
    t = pack_u12((0.02 * torch.randn(8, 64, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16))
    monkeypatch.setattr(u12_linear_module, "ESC_LANES", "table")
    assert u12_linear_module.lanes_args(t) == (t.esc_row_ptr, 0)
    monkeypatch.setattr(u12_linear_module, "ESC_LANES", "lane")
    with pytest.raises(ValueError, match=r"ESC_LANES: expected one of \('gemv', 'lanes', 'table'\), got 'lane'"):
        u12_linear_module.lanes_args(t)


def test_gemv2_reads_strided_bf16_x():
    """bf16 x is read as int64 words; a transposed view is copied to contiguous rows first."""
    x, t = _make_inputs({"M": 3, "N": 9, "K": 40, "dtype": torch.bfloat16, "escapes": "few"}, DEVICE, seed=5)
    x_t = x.T.contiguous().T  # same values, strides (1, 3)
    assert x_t.stride(1) != 1
    y = u12_linear(x_t, t, U12Config(4, 4, num_warps=1, kernel="gemv2"))
    _assert_matches(y, x, t)


@pytest.mark.parametrize("m,k,escapes", [(5, 64, "few"), (2, 30, "few"), (2, 64, "all")])
def test_gemv2_config_falls_back_to_the_tile_kernel(m, k, escapes):
    """M > 4, K % 4 != 0 and an unscaled base (241: every weight escapes) are the tile kernel's."""
    x, t = _make_inputs({"M": m, "N": 11, "K": k, "dtype": torch.float32, "escapes": escapes}, DEVICE, seed=k)
    assert not gemv2_applies(m, k, t.base)
    _assert_matches(u12_linear(x, t, U12Config(8, 256, num_warps=4, kernel="gemv2")), x, t)


def test_config_names_and_checks():
    assert str(U12Config(16, 256, num_warps=4, num_stages=1, kernel="gemv2")) == "gemv2-bn16-bw256-w4-s1"
    assert str(U12Config(8, 64)) == "bn8-bw64-sk1-w4-s2-pairs"  # tile names as before: old result files still match
    with pytest.raises(ValueError, match="U12Config.kernel"):
        U12Config(8, 64, kernel="gemv3")
    with pytest.raises(ValueError, match="U12Config.split_k"):
        U12Config(8, 64, split_k=2, kernel="gemv2")
    with pytest.raises(ValueError, match="U12Config.maxnreg"):
        U12Config(8, 64, kernel="gemv2", maxnreg=8)
    assert str(U12Config(4, 128, num_warps=2, num_stages=1, kernel="gemv2", maxnreg=80)) == "gemv2-bn4-bw128-w2-s1-r80"
    assert U12Config(4, 128, maxnreg=80).launch_options(native=False) == dict(num_warps=4, num_stages=2)
    assert U12Config(4, 128, maxnreg=80).launch_options(native=True)["maxnreg"] == 80


def test_register_budget_keeps_the_bits():
    """ptxas's register budget changes the schedule, not the arithmetic: the same y, bit for bit."""
    x, t = _make_inputs({"M": 2, "N": 33, "K": 300, "dtype": torch.bfloat16, "escapes": "special"}, DEVICE, seed=11)
    cfg = U12Config(8, 16, num_warps=1, num_stages=1, kernel="gemv2")
    y = u12_linear(x, t, cfg)
    y_budget = u12_linear(x, t, dataclasses.replace(cfg, maxnreg=96))
    assert torch.equal(y.view(torch.int16), y_budget.view(torch.int16))
    _assert_matches(y, x, t)


def test_sweep_fits_the_register_budget_at_m1():
    assert all(cfg.kernel == "gemv2" for cfg in SWEEP_GEMV2)
    assert len(set(SWEEP_GEMV2)) == len(SWEEP_GEMV2)
    assert all(gemv2_acc_registers(cfg, 1) <= 64 for cfg in SWEEP_GEMV2)
    assert sum(gemv2_acc_registers(cfg, 4) <= 64 for cfg in SWEEP_GEMV2) >= 12  # enough left for M = 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("m", [1, 16])
def test_launch_captured_before_any_eager_one_walks_the_table(monkeypatch, m):
    """Lanes take a host sync to derive, which a CUDA graph capture does not allow: a weight whose
    first launch is captured runs the table in that graph (exact all the same), and a later eager
    launch derives the lanes."""
    x, t = _make_inputs({"M": m, "N": 40, "K": 256, "dtype": torch.bfloat16, "escapes": "few"}, DEVICE, seed=8)
    assert "esc_lanes" not in t.__dict__
    cfg = U12Config(8, 16, num_warps=1, kernel="gemv2") if m == 1 else \
        U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")
    with monkeypatch.context() as patch:  # compiles the table's kernel and derives the row pointers, not the lanes
        patch.setattr(u12_linear_module, "ESC_LANES", "table")
        _assert_matches(u12_linear(x, t, cfg), x, t)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = u12_linear(x, t, cfg)
    assert "esc_lanes" not in t.__dict__, "the capture must not have derived the lanes"
    g.replay()
    torch.cuda.synchronize()
    _assert_matches(y, x, t)
    _assert_matches(u12_linear(x, t, cfg), x, t)
    assert t.esc_lanes is not None and u12_linear_module.lanes_args(t)[1] > 0


def test_default_escapes_lanes_in_the_gemvs_table_in_the_block_kernels(monkeypatch):
    """ESC_LANES "gemv" (the default): a GEMV launch gets the rows' lanes, a block kernel (tile,
    mma, hmma) the table; "lanes" and "table" give every kernel the same."""
    t = pack_u12((0.02 * torch.randn(8, 64, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16))
    w = unpack_u12(t)
    w[2, 5] = float("inf")
    t = pack_u12(w)
    assert u12_linear_module.ESC_LANES == "gemv"
    lanes, n = u12_linear_module.lanes_args(t)
    assert n > 0 and lanes.data_ptr() == t.esc_lanes.data_ptr()
    assert u12_linear_module.lanes_args(t, block=True) == (t.esc_row_ptr, 0)
    monkeypatch.setattr(u12_linear_module, "ESC_LANES", "lanes")
    assert u12_linear_module.lanes_args(t, block=True)[1] == n
    monkeypatch.setattr(u12_linear_module, "ESC_LANES", "table")
    assert u12_linear_module.lanes_args(t) == (t.esc_row_ptr, 0)
