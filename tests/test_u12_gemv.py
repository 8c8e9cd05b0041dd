"""The gemv2 kernel (kernels/u12/gemv2.py): its byte-permute and bit-select helpers against the PTX
semantics, the kernel at other tiles than the registry's "u12_gemv2" cases, its escapes from the
lanes and from the table, and its configs (tests/test_u12_format.py checks the decode's bits on
every pattern). Without a GPU only the shift-and-mask emulation runs; with one, the inline PTX too.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE, ON_GPU
from specpilot.formats.u12 import pack_u12
from specpilot.kernels import KERNELS
from specpilot.kernels.u12 import U12Config, u12_linear, u12_linear_reference
from specpilot.kernels.u12.cases import make_inputs, plant_wrong_weight
from specpilot.kernels.u12.decode import prmt, select_bits
from specpilot.kernels.u12.escapes import lanes_args
from specpilot.kernels.u12.gemv2 import gemv2_applies

ASM_MODES = [False, True] if ON_GPU else [False]
# inf/NaN weights are planted on purpose; the interpreter's numpy warns about them.
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


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
    tl.store(out_ptr + offs, prmt(tl.load(a_ptr + offs), tl.load(b_ptr + offs), SELECTOR, ASM))


@triton.jit
def _select_kernel(a_ptr, b_ptr, out_ptr, MASK: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, select_bits(tl.load(a_ptr + offs), tl.load(b_ptr + offs), MASK, ASM))


@pytest.mark.parametrize("asm", ASM_MODES)
@pytest.mark.parametrize("selector", [0x2200, 0x3311, 0x5410, 0x7632, 0x6240])  # the kernels' and others
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

_CASES = [  # (M, N, K, dtype, escapes, block_n, block_w): tiles other than the registry's
    (1, 7, 36, torch.bfloat16, "none", 4, 4),  # N % block_n != 0, 9 words: a masked last chunk
    (2, 33, 300, torch.float32, "special", 8, 16),  # 75 words: 4 chunks and a masked one
    (4, 32, 256, torch.bfloat16, "few", 16, 16),  # blocks full
]


def _assert_matches(y: torch.Tensor, x: torch.Tensor, t) -> None:
    ref = u12_linear_reference(x, t)
    atol, rtol = KERNELS["u12_linear"].tolerance[ref.dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("m,n,k,dtype,escapes,block_n,block_w", _CASES)
def test_gemv2_matches_reference(m, n, k, dtype, escapes, block_n, block_w):
    x, t = make_inputs({"M": m, "N": n, "K": k, "dtype": dtype, "escapes": escapes}, DEVICE, seed=m * 100 + k)
    cfg = U12Config(block_n, block_w, num_warps=1, kernel="gemv2")
    assert gemv2_applies(m, k, t.base), "the case must run the gemv2 kernel, not the tile kernel"
    y = u12_linear(x, t, cfg)
    _assert_matches(y, x, t)
    y_bad = u12_linear(*plant_wrong_weight((x, t)), cfg)
    with pytest.raises(AssertionError):
        _assert_matches(y_bad, x, t)


@pytest.mark.parametrize("per_row,lanes", [((0, 1, 3, 2), 4), ((9, 0, 1, 8), 16), ((17, 0, 1, 2), 0)],
                         ids=["lanes-one-block", "lanes-16", "table-past-lanes"])
def test_gemv2_escapes_from_the_lanes_or_the_table(per_row, lanes):
    """Programs of 4 rows with up to 16 escapes and with more, found in the rows' lanes (4 or 16 a
    row), or, where a row holds 17 (past the lanes), in the table: its first block of 16 from the
    row pointers loaded before the loop, a second block after it. A wrong weight must show."""
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
    assert lanes_args(t)[1] == lanes, "the way the test means to walk"
    cfg = U12Config(4, 8, num_warps=1, kernel="gemv2")
    _assert_matches(u12_linear(x, t, cfg), x, t)
    with pytest.raises(AssertionError):
        _assert_matches(u12_linear(*plant_wrong_weight((x, t)), cfg), x, t)


def test_gemv2_reads_strided_bf16_x():
    """bf16 x is read as int64 words; a transposed view is copied to contiguous rows first."""
    x, t = make_inputs({"M": 3, "N": 9, "K": 40, "dtype": torch.bfloat16, "escapes": "few"}, DEVICE, seed=5)
    x_t = x.T.contiguous().T  # same values, strides (1, 3)
    assert x_t.stride(1) != 1
    y = u12_linear(x_t, t, U12Config(4, 4, num_warps=1, kernel="gemv2"))
    _assert_matches(y, x, t)


@pytest.mark.parametrize("m,k,escapes", [(5, 64, "few"), (2, 30, "few"), (2, 64, "all")])
def test_gemv2_config_falls_back_to_the_tile_kernel(m, k, escapes):
    """M > 4, K % 4 != 0 and an unscaled base (241: every weight escapes) are the tile kernel's."""
    x, t = make_inputs({"M": m, "N": 11, "K": k, "dtype": torch.float32, "escapes": escapes}, DEVICE, seed=k)
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
    x, t = make_inputs({"M": 2, "N": 33, "K": 300, "dtype": torch.bfloat16, "escapes": "special"}, DEVICE, seed=11)
    cfg = U12Config(8, 16, num_warps=1, num_stages=1, kernel="gemv2")
    y = u12_linear(x, t, cfg)
    y_budget = u12_linear(x, t, dataclasses.replace(cfg, maxnreg=96))
    assert torch.equal(y.view(torch.int16), y_budget.view(torch.int16))
    _assert_matches(y, x, t)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_launch_captured_before_any_eager_one_walks_the_table(m):
    """Lanes take a host sync to derive, which a CUDA graph capture does not allow: a weight whose
    first launch is captured runs the table in that graph (exact all the same), and a later eager
    launch derives the lanes."""
    x, t = make_inputs({"M": m, "N": 40, "K": 256, "dtype": torch.bfloat16, "escapes": "few"}, DEVICE, seed=8)
    assert "esc_lanes" not in t.__dict__
    cfg = U12Config(8, 16, num_warps=1, kernel="gemv2") if m == 1 else \
        U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")
    no_lanes = dataclasses.replace(t)  # the same planes with no lanes: compiles the table's kernel first
    no_lanes.__dict__["esc_lanes"] = None
    _assert_matches(u12_linear(x, no_lanes, cfg), x, t)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = u12_linear(x, t, cfg)
    assert "esc_lanes" not in t.__dict__, "the capture must not have derived the lanes"
    g.replay()
    torch.cuda.synchronize()
    _assert_matches(y, x, t)
    _assert_matches(u12_linear(x, t, cfg), x, t)
    assert t.esc_lanes is not None and lanes_args(t)[1] > 0


def test_lanes_args_give_the_lanes_where_the_weight_has_them():
    """A GEMV reads a weight's lanes (one int32 a lane, 4 here) where it has them, and the table
    (LANES 0) where a row holds more escapes than the lanes take (17)."""
    w = 0.02 * torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    w[2, :3] = 1e-30
    t = pack_u12(w.to(torch.bfloat16))
    lanes, n = lanes_args(t)
    assert n == 4 and lanes.data_ptr() == t.esc_lanes.data_ptr()
    w[5, :17] = 1e-30
    t = pack_u12(w.to(torch.bfloat16))
    assert lanes_args(t) == (t.esc_row_ptr, 0)
