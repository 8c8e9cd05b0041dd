"""fused_linear (kernels/fused_linear.py) against its reference: random shapes and options, the
in-place residual, split-K's counters, and input errors. The registry's cases and planted errors
run in tests/test_kernels.py, with every kernel's.

On a machine without CUDA the kernels run in Triton's interpreter (conftest.py), on small shapes.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specpilot.kernels.fused_linear as fl
from conftest import DEVICE
from specpilot.kernels.registry import KERNELS
from specpilot.kernels.split_k import counters_of

SPEC = KERNELS["fused_linear"]
# exp(-g) overflows to inf for very negative g in the interpreter's numpy (silu is then -0, as on the GPU).
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]


_CONFIGS = [
    None,
    fl.FusedLinearConfig("gemv", 4, 16, num_warps=1),
    fl.FusedLinearConfig("gemv", 16, 8, num_warps=2),
    fl.FusedLinearConfig("gemv", 8, 16, num_warps=2, maxnreg=128),  # a register budget (on the GPU)
    fl.FusedLinearConfig("dot", 16, 16),
    fl.FusedLinearConfig("dot", 32, 16, block_m=16, split_k=4),
]


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 20), n_out=st.integers(1, 24), k=st.integers(1, 72),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    norm=st.booleans(), gated=st.booleans(), residual=st.booleans(), view=st.integers(0, 3),
    config=st.sampled_from(_CONFIGS), seed=st.integers(0, 2**16),
)
def test_random_shapes_and_options_match_reference(m, n_out, k, dtype, norm, gated, residual, view, config, seed):
    g = torch.Generator().manual_seed(seed)
    n = 2 * n_out if gated else n_out
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    w = (0.05 * torch.randn(view + n, k, generator=g)).to(dtype).to(DEVICE)[view:]
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE) if norm else None
    r = torch.randn(m, n_out, generator=g).to(dtype).to(DEVICE) if residual else None
    out = fl.fused_linear(x, w, norm_weight=nw, gated=gated, residual=None if r is None else r.clone(), config=config)
    ref = fl.fused_linear_reference(x, w, norm_weight=nw, gated=gated, residual=None if r is None else r.clone())
    atol, rtol = SPEC.tolerance[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("m", [2, 9])  # gemv, dot
def test_residual_is_updated_in_place_and_returned(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (0.05 * torch.randn(2 * 12, 40, generator=g)).to(torch.bfloat16).to(DEVICE)
    r = torch.randn(m, 12, generator=g).to(torch.bfloat16).to(DEVICE)
    before = r.clone()
    out = fl.fused_linear(x, w, gated=True, residual=r)
    assert out is r
    want = fl.fused_linear_reference(x, w, gated=True, residual=before.clone())
    torch.testing.assert_close(r, want, atol=1e-4, rtol=8e-3)
    assert torch.equal(want, before + fl.fused_linear_reference(x, w, gated=True))  # the reference's torch add


def test_misaligned_x_and_weight_views():
    """x and W as column-offset views (rows not 8-byte aligned): W read by elements, x as it is."""
    g = torch.Generator().manual_seed(5)
    xb = torch.randn(3, 65, generator=g).to(torch.bfloat16).to(DEVICE)
    wb = (0.05 * torch.randn(10, 65, generator=g)).to(torch.bfloat16).to(DEVICE)
    x, w = xb[:, 1:], wb[:, 1:]
    assert not fl._words_apply(x, w)
    nw = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    out = fl.fused_linear(x, w, norm_weight=nw)
    torch.testing.assert_close(out, fl.fused_linear_reference(x, w, norm_weight=nw), atol=1e-4, rtol=8e-3)
    # aligned W with a misaligned x: W as words, x copied to aligned rows
    w = wb[:, :64].contiguous()
    assert fl._words_apply(x, w)
    torch.testing.assert_close(fl.fused_linear(x, w), fl.fused_linear_reference(x, w), atol=1e-4, rtol=8e-3)


def test_split_k_leaves_its_counters_zero_and_is_deterministic():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 100, generator=g).to(DEVICE)
    w = (0.05 * torch.randn(2 * 20, 100, generator=g)).to(DEVICE)
    cfg = fl.FusedLinearConfig("dot", 16, 16, split_k=3)
    first = fl.fused_linear(x, w, gated=True, config=cfg)
    second = fl.fused_linear(x, w[: 2 * 20], gated=True, config=cfg)  # a view: the same storage's counters
    assert torch.equal(first, second)
    (counters,) = counters_of(w.untyped_storage())  # kernels/split_k.py's, kept with the weight's storage
    assert counters.numel() >= 2 and not counters.any()


@pytest.mark.parametrize("m,split", [(16, 1), (5, 3)])
def test_row_squares_carry_the_norm_from_a_residual_epilogue_to_the_next_prologue(m, split):
    """o's residual epilogue stores the stream's Σ y² in parts; gate_up's norm reads them: the
    outputs and the stream match the calls without squares and the reference, the parts sum to Σ y²."""
    g = torch.Generator().manual_seed(m)
    bf = torch.bfloat16
    k, hidden, inter = 40, 72, 24
    stream = (3 * torch.randn(m, hidden, generator=g)).to(bf).to(DEVICE)
    a = torch.randn(m, k, generator=g).to(bf).to(DEVICE)
    w_o = (0.05 * torch.randn(hidden, k, generator=g)).to(bf).to(DEVICE)
    w_gu = (0.05 * torch.randn(2 * inter, hidden, generator=g)).to(bf).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf).to(DEVICE)
    cfg = fl.FusedLinearConfig("dot", 16, 16, split_k=split)

    sq = fl.RowSquares()
    s1 = fl.fused_linear(a, w_o, residual=stream.clone(), config=cfg, squares=sq)
    assert sq.parts == hidden // 16 + 1 and sq.readable(s1)
    parts = sq.buf[: sq.parts * m].view(sq.parts, m)
    torch.testing.assert_close(parts.sum(0), s1.float().pow(2).sum(1), rtol=1e-5, atol=1e-4)
    out = fl.fused_linear(s1, w_gu, norm_weight=nw, gated=True, config=cfg, squares=sq)

    s2 = fl.fused_linear(a, w_o, residual=stream.clone(), config=cfg)
    assert torch.equal(s1, s2)  # the squares change nothing the epilogue stores
    plain = fl.fused_linear(s2, w_gu, norm_weight=nw, gated=True, config=cfg)
    torch.testing.assert_close(out, plain, atol=1e-4, rtol=8e-3)  # inv's sum order only
    ref = fl.fused_linear_reference(s2, w_gu, norm_weight=nw, gated=True)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=8e-3)


def test_row_squares_are_read_only_for_their_stream():
    """A reader over other rows, or after a writer that stored none (gemv, the reference), computes
    its norm from x; a call that would both read and write them is refused."""
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    stream = torch.randn(6, 32, generator=g).to(bf).to(DEVICE)
    w = (0.05 * torch.randn(32, 32, generator=g)).to(bf).to(DEVICE)
    nw = torch.ones(32, dtype=bf, device=DEVICE)
    dot = fl.FusedLinearConfig("dot", 16, 16)
    sq = fl.RowSquares()
    fl.fused_linear(stream, w, residual=stream.clone(), config=dot, squares=sq)  # a stream copy: its own source
    assert sq.parts == 2 and not sq.readable(stream)
    sq.buf.fill_(1e6)  # parts read by mistake would scale every row by ~0
    out = fl.fused_linear(stream, w, norm_weight=nw, config=dot, squares=sq)
    torch.testing.assert_close(out, fl.fused_linear_reference(stream, w, norm_weight=nw), atol=1e-4, rtol=8e-3)
    r = stream.clone()
    fl.fused_linear(stream, w, residual=r, config=fl.FusedLinearConfig("gemv", 8, 16), squares=sq)
    assert sq.parts == 0 and not sq.readable(r)
    fl.fused_linear(stream, w, residual=r, config=dot, squares=sq)
    fl.fused_linear_reference(stream, w, residual=r, squares=sq)
    assert sq.parts == 0
    for fn in (fl.fused_linear, fl.fused_linear_reference):
        with pytest.raises(ValueError, match="squares with both"):
            fn(stream, w, norm_weight=nw, residual=r, squares=sq)


def test_default_config_picks_the_kernel_by_rows():
    assert fl.default_config(1, 6144, 4096, False).kernel == "gemv"
    assert fl.default_config(4, 28672, 4096, True).kernel == "gemv"
    cfg = fl.default_config(16, 4096, 14336, False)
    assert cfg.kernel == "dot" and cfg.split_k > 1  # 64 output blocks: split-K fills the GPU
    assert fl.default_config(64, 28672, 4096, True).split_k == 1
    for m in (1, 2, 4):
        for gated in (False, True):
            assert fl.gemv_acc_registers(fl.default_config(m, 28672, 4096, gated), m, gated) <= 64


def test_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="kernel"):
        fl.FusedLinearConfig("tile", 8, 64)
    with pytest.raises(ValueError, match="block_k"):
        fl.FusedLinearConfig("gemv", 8, 6)
    with pytest.raises(ValueError, match="gemv has no split_k"):
        fl.FusedLinearConfig("gemv", 8, 64, split_k=2)
    with pytest.raises(ValueError, match="dot needs"):
        fl.FusedLinearConfig("dot", 8, 64)
    with pytest.raises(ValueError, match="block_m"):
        fl.FusedLinearConfig("dot", 16, 16, block_m=8)
    with pytest.raises(ValueError, match="maxnreg"):
        fl.FusedLinearConfig("gemv", 8, 64, maxnreg=300)
    assert str(fl.FusedLinearConfig("gemv", 4, 1024, num_warps=2, num_stages=3, maxnreg=128)) == "gemv-bn4-bk1024-w2-s3-r128"
    assert str(fl.FusedLinearConfig("gemv", 4, 1024)) == "gemv-bn4-bk1024-w4-s1"  # unchanged without a budget


def _bad_inputs():
    bf, f32 = torch.bfloat16, torch.float32
    x, w = torch.zeros(2, 8, dtype=bf), torch.zeros(6, 8, dtype=bf)
    return [
        (dict(x=torch.zeros(8, dtype=bf), weight=w), "x must be \\[M, K\\]"),
        (dict(x=x.to(torch.float16), weight=w.to(torch.float16)), "bfloat16 or float32"),
        (dict(x=torch.zeros(2, 0, dtype=bf), weight=torch.zeros(6, 0, dtype=bf)), "K must be >= 1"),
        (dict(x=x, weight=torch.zeros(6, 9, dtype=bf)), "weight must be \\[N, 8\\]"),
        (dict(x=x, weight=w.to(f32)), "weight must have x's dtype"),
        (dict(x=x, weight=torch.zeros(8, 6, dtype=bf).T), "stride\\(1\\) == 1"),
        (dict(x=x, weight=w, norm_weight=torch.ones(7, dtype=bf)), "norm_weight must be \\[8\\]"),
        (dict(x=x, weight=w, norm_weight=torch.ones(8, dtype=f32)), "norm_weight must be \\[8\\]"),
        (dict(x=x, weight=torch.zeros(5, 8, dtype=bf), gated=True), "even count"),
        (dict(x=x, weight=w, gated=True, residual=torch.zeros(2, 6, dtype=bf)), "residual must be \\[2, 3\\]"),
        (dict(x=x, weight=w, residual=torch.zeros(2, 6, dtype=f32)), "residual must be \\[2, 6\\]"),
        (dict(x=x, weight=w, residual=torch.zeros(6, 2, dtype=bf).T), "residual rows must be contiguous"),
        (dict(x=x, weight=w, norm_weight=torch.ones(8, dtype=bf, device="meta")), "norm_weight on meta"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_inputs(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("fn", [fl.fused_linear, fl.fused_linear_reference], ids=["kernel", "reference"])
def test_bad_inputs_raise_value_errors(fn, kwargs, match):
    kwargs = dict(kwargs)
    x, w = kwargs.pop("x"), kwargs.pop("weight")
    with pytest.raises(ValueError, match=match):
        fn(x, w, **kwargs)


def test_residual_overlapping_x_is_refused():
    buf = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlaps x"):
        fl.fused_linear(buf, torch.zeros(8, 8, dtype=torch.bfloat16), residual=buf)
