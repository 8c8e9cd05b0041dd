"""u12_fused_linear (kernels/u12/fused.py) against its reference: random shapes and options,
escapes under the norm prologue and in both halves of a gated weight, the in-place residual, the
mma kernel's epilogue at 5 rows and more, the unfused fallback, the norm handoff, and input errors
(tests/test_kernels.py runs the registry's cases).

On a machine without CUDA the kernel runs in Triton's interpreter (conftest.py), on small shapes.
"""

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from specpilot.formats.u12 import pack_u12, unpack_u12
from specpilot.kernels.registry import KERNELS
from specpilot.kernels.rmsnorm import rmsnorm_reference
from specpilot.kernels.u12 import TUNED, U12Config
from specpilot.kernels.u12 import fused as ufl
from specpilot.kernels.u12.cases import plant_escapes, plant_wrong_fused_weight
from specpilot.kernels.u12.escapes import lanes_args
from specpilot.kernels.u12.gemv2 import gemv2_acc_registers, gemv2_applies

TOLERANCE = KERNELS["u12_fused_linear"].tolerance
# inf weights are planted on purpose, and exp(-g) overflows for very negative g (silu is then -0):
# the interpreter's numpy warns about both.
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    atol, rtol = TOLERANCE[ref.dtype]
    return out.dtype == ref.dtype and out.shape == ref.shape and torch.allclose(
        out.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True)


def _both(x, t, **kwargs):
    """(kernel, reference), each on its own copy of the residual."""
    r = kwargs.pop("residual", None)
    out = ufl.u12_fused_linear(x, t, residual=None if r is None else r.clone(), **kwargs)
    kwargs.pop("config", None)
    return out, ufl.u12_fused_linear_reference(x, t, residual=None if r is None else r.clone(), **kwargs)


@contextlib.contextmanager
def counting_mma_launches():
    """(config, epilogue keywords) of each launch of the mma kernel inside."""
    calls = []
    launch = ufl.launch_mma

    def counted(x, t, y, cfg, **kwargs):
        calls.append((cfg, kwargs))
        return launch(x, t, y, cfg, **kwargs)

    with mock.patch.object(ufl, "launch_mma", counted):
        yield calls


@pytest.fixture
def mma_launches():
    with counting_mma_launches() as calls:
        yield calls


@pytest.fixture
def fused_launches(monkeypatch):
    """Counts launches of the fused GEMV kernel."""
    calls = []
    launch = ufl.launch_fused_gemv

    def counted(*args, **kwargs):
        calls.append(args)
        return launch(*args, **kwargs)

    monkeypatch.setattr(ufl, "launch_fused_gemv", counted)
    return calls


_CONFIGS = [None, U12Config(8, 4, num_warps=1, kernel="gemv2"), U12Config(2, 16, num_warps=2, kernel="gemv2")]


@settings(max_examples=10, deadline=None)
@given(
    m=st.integers(1, 4), n_out=st.integers(1, 12), words=st.integers(1, 24),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    norm=st.booleans(), gated=st.booleans(), residual=st.booleans(),
    config=st.sampled_from(_CONFIGS), seed=st.integers(0, 2**16),
)
def test_random_shapes_and_options_match_reference(m, n_out, words, dtype, norm, gated, residual, config, seed):
    g = torch.Generator().manual_seed(seed)
    k, n = 4 * words, (2 if gated else 1) * n_out
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    w = 0.02 * torch.randn(n, k, generator=g)
    plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    assert gemv2_applies(m, k, t.base), "the fused kernel must run, not the fallback"
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE) if norm else None
    r = torch.randn(m, n_out, generator=g).to(dtype).to(DEVICE) if residual else None
    out, ref = _both(x, t, norm_weight=nw, gated=gated, residual=r, config=config)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)


def _base(w: torch.Tensor) -> int:
    """The base that packing w chooses: kept when weights outside its window are planted, so they escape."""
    return pack_u12(w.to(torch.bfloat16)).base


def _escape_part(t) -> torch.Tensor:
    """The escaped weights of t, dense fp32 (0 elsewhere)."""
    w = unpack_u12(t).float()
    esc = torch.zeros_like(w)
    idx = t.esc_idx.long()
    esc.view(-1)[idx] = w.view(-1)[idx]
    return esc


def _past_the_lanes(w: torch.Tensor, row: int) -> None:
    """17 escapes of about 0 in `row` of w (in place): more than the lanes take, so the GEMVs walk
    the table for the whole weight."""
    w[row, :17] = 1e-30


@pytest.mark.parametrize("way", ["lanes", "table"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "inf-in-block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_escapes_use_the_normalised_x(dtype, nonfinite, way):
    """Escapes in every row at the columns where x' = rmsnorm(x) is largest: the result matches the
    reference, and would not with x in place of x' there. With an inf weight in the first N block:
    in the table, that block's escapes go one at a time (the non-finite path), normalised as well;
    in the lanes, the inf contribution stays in its row."""
    g = torch.Generator().manual_seed(11)
    m, n, k = 3, 9, 64
    x = (30 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    h = rmsnorm_reference(x, nw, 1e-6)
    cols = h.float().abs().argmax(1).unique().cpu()
    w = 0.02 * torch.randn(n, k, generator=g)
    base = _base(w)
    w[:, cols] = 0.5 * torch.randn(n, len(cols), generator=g).sign()  # outside the window: escapes
    inf_col = next(c for c in range(k) if c not in cols)
    if nonfinite:
        w[0, inf_col] = float("inf")
    if way == "table":
        _past_the_lanes(w, n - 1)
    t = pack_u12(w.to(torch.bfloat16), base=base).to(DEVICE)
    assert t.esc_idx.numel() >= n * len(cols) and (lanes_args(t)[1] > 0) == (way == "lanes")
    out, ref = _both(x, t, norm_weight=nw)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    esc = _escape_part(t).to(DEVICE)
    esc[0, inf_col] = 0.0
    wrong = (h.float() @ (unpack_u12(t).float() - esc).T + x.float() @ esc.T).to(dtype)
    assert not _close(wrong[:, 1:], ref[:, 1:]), "the test cannot tell x from x' at the escapes"


@pytest.mark.parametrize("way", ["lanes", "table"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_escapes_in_both_halves(dtype, way):
    """Escapes in gate and up rows (more than ESC_BLOCK in one 4-row up block): each half's go to
    its own sums; dropping either half's changes the reference, so both are checked. Found in the
    rows' lanes, or in the table where a row holds more than the lanes take."""
    g = torch.Generator().manual_seed(12)
    m, i, k = 2, 6, 48
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w = 0.02 * torch.randn(2 * i, k, generator=g)
    base = _base(w)
    w[1, 5], w[3, 17], w[5, 40] = 0.75, -1.5, 0.25  # gate rows
    for row in range(i, i + 4):  # up rows of the first block: 20 escapes
        w[row, torch.randperm(k, generator=g)[:5]] = 0.25 * torch.randn(5, generator=g).sign()
    w[2 * i - 1, 7] = -0.5  # the up row of the last, partial block
    if way == "table":
        _past_the_lanes(w, i - 1)
    t = pack_u12(w.to(torch.bfloat16), base=base).to(DEVICE)
    assert (lanes_args(t)[1] > 0) == (way == "lanes"), "the way the test means to walk"
    out, ref = _both(x, t, norm_weight=nw, gated=True)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    esc = _escape_part(t)
    for rows in (slice(0, i), slice(i, 2 * i)):
        w_dropped = unpack_u12(t).float()
        w_dropped[rows] -= esc[rows]
        dropped = ufl.u12_fused_linear_reference(x, pack_u12(w_dropped.to(torch.bfloat16)), norm_weight=nw, gated=True)
        assert not _close(dropped, ref)


def test_residual_is_updated_in_place_and_returned(fused_launches):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    w = 0.05 * torch.randn(2 * 12, 40, generator=g)
    plant_escapes(w, g, gated=True)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    r = torch.randn(2, 12, generator=g).to(torch.bfloat16).to(DEVICE)
    before = r.clone()
    out = ufl.u12_fused_linear(x, t, gated=True, residual=r)
    assert out is r and len(fused_launches) == 1
    want = ufl.u12_fused_linear_reference(x, t, gated=True, residual=before.clone())
    torch.testing.assert_close(r, want, atol=1e-4, rtol=8e-3)
    assert torch.equal(want, before + ufl.u12_fused_linear_reference(x, t, gated=True))  # the reference's torch add


@pytest.mark.parametrize("m,k,base,dtype,gated", [
    (2, 66, None, torch.float32, True),  # K % 4 != 0
    (6, 66, None, torch.float32, False),
    (3, 64, 241, torch.float32, True),  # a base outside the scaled range: every weight escapes
    (7, 64, 241, torch.float32, False),
])
def test_fallback_matches_reference(fused_launches, mma_launches, m, k, base, dtype, gated):
    """Where no fused kernel applies: rmsnorm, u12_linear, silu_mul and the torch add (bf16 only
    ungated: under the interpreter u12_linear truncates its bf16 output, the module docstring says)."""
    g = torch.Generator().manual_seed(m + k)
    n_out = 7
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    t = pack_u12(w.to(torch.bfloat16), base=base).to(DEVICE)
    assert not gemv2_applies(m, k, t.base)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    r = torch.randn(m, n_out, generator=g).to(dtype).to(DEVICE)
    out, ref = _both(x, t, norm_weight=nw, gated=gated, residual=r)
    assert not fused_launches and not mma_launches
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@settings(max_examples=8, deadline=None)
@given(
    m=st.integers(5, 20), n_out=st.integers(1, 40), words=st.integers(1, 24),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    norm=st.booleans(), gated=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**16),
)
def test_many_rows_run_the_mma_kernel_with_the_epilogue(m, n_out, words, dtype, norm, gated, residual, seed):
    """At 5 rows and more the epilogue (SiLU·mul of the gate and up halves, each with its own
    escapes; the residual add) runs in the mma kernel's launch after its split-K sum, the norm
    as an rmsnorm kernel before it: against the reference at odd shapes (partial blocks of rows
    and columns, masked chunks)."""
    g = torch.Generator().manual_seed(seed)
    k = 4 * words
    x = torch.randn(m, k, generator=g)
    x[::3] *= 30
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE) if norm else None
    r = torch.randn(m, n_out, generator=g).to(dtype).to(DEVICE) if residual else None
    with counting_mma_launches() as launches:
        out, ref = _both(x.to(dtype).to(DEVICE), t, norm_weight=nw, gated=gated, residual=r)
    assert [(c.kernel, kw["gated"], kw["residual"]) for c, kw in launches] == [("mma", gated, residual)]
    assert _close(out, ref)


def test_empty_inputs():
    t = pack_u12(torch.zeros(6, 8, dtype=torch.bfloat16))
    assert ufl.u12_fused_linear(torch.zeros(0, 8), t, gated=True).shape == (0, 3)
    r = torch.zeros(2, 0)
    assert ufl.u12_fused_linear(torch.ones(2, 8), pack_u12(torch.zeros(0, 8, dtype=torch.bfloat16)), residual=r) is r


def _bad_inputs():
    bf = torch.bfloat16
    x, t = torch.zeros(2, 8, dtype=bf), pack_u12(torch.zeros(6, 8, dtype=bf))
    return [
        (dict(x=x, t=pack_u12(torch.zeros(6, 12, dtype=bf))), "weight must be \\[N, 8\\]"),
        (dict(x=x.to(torch.float16), t=t), "bfloat16 or float32"),
        (dict(x=x, t=t, norm_weight=torch.ones(7, dtype=bf)), "norm_weight must be \\[8\\]"),
        (dict(x=x, t=pack_u12(torch.zeros(5, 8, dtype=bf)), gated=True), "even count"),
        (dict(x=x, t=t, gated=True, residual=torch.zeros(2, 6, dtype=bf)), "residual must be \\[2, 3\\]"),
        (dict(x=x, t=t, residual=torch.zeros(2, 6)), "residual must be \\[2, 6\\] torch.bfloat16"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_inputs(), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("fn", [ufl.u12_fused_linear, ufl.u12_fused_linear_reference], ids=["kernel", "reference"])
def test_bad_inputs_raise_value_errors(fn, kwargs, match):
    kwargs = dict(kwargs)
    x, t = kwargs.pop("x"), kwargs.pop("t")
    with pytest.raises(ValueError, match=f"^u12_fused_linear: .*{match}"):
        fn(x, t, **kwargs)


def test_config_must_fit_the_rows():
    """gemv2's fused kernel takes M <= 4 rows, the mma and hmma kernels' epilogues M >= 5."""
    t = pack_u12(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="config must be a gemv2 U12Config at 1 rows, got kernel 'tile'"):
        ufl.u12_fused_linear(torch.zeros(1, 8), t, config=U12Config(8, 64))
    with pytest.raises(ValueError, match="config must be a mma or hmma U12Config at 5 rows, got kernel 'gemv2'"):
        ufl.u12_fused_linear(torch.zeros(5, 8), t, config=U12Config(8, 64, kernel="gemv2"))


def test_gated_mma_tile_halves_are_whole_dot_tiles():
    """A gated mma launch takes block_n / 2 gate and up rows, each a multiple of 16 (tl.dot's tile)."""
    w = 0.02 * torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    x, t = torch.zeros(5, 8), pack_u12(w.to(torch.bfloat16))
    assert ufl.fused_applies(5, 8, t.base)
    with pytest.raises(ValueError, match="a multiple of 16 each; got block_n 16"):
        ufl.u12_fused_linear(x, t, gated=True, config=U12Config(16, 16, kernel="mma"))


def test_tensor_core_config_takes_tuned_tensor_core_tiles():
    """At M >= 5 the epilogue runs in TUNED's tensor-core kernel for the rows (mma for qkv and
    gate_up at 16, hmma for o and down), else the mma default."""
    assert ufl.tensor_core_config(16, 6144, 4096) == TUNED[(16, 6144, 4096)]
    assert ufl.tensor_core_config(16, 28672, 4096) == TUNED[(16, 28672, 4096)]
    assert TUNED[(16, 4096, 4096)].kernel == "hmma" and ufl.tensor_core_config(16, 4096, 4096) == TUNED[(16, 4096, 4096)]
    assert ufl.tensor_core_config(16, 4096, 4096, on_gpu=False) == ufl.MMA_INTERPRETER_CONFIG


def test_default_config_halves_the_tile_when_gated(monkeypatch):
    """Where this kernel's TUNED has no entry, a gated weight takes u12_linear's tile halved."""
    monkeypatch.setattr(ufl, "TUNED_FUSED", {})
    assert ufl.fused_config(1, 6144, 4096, False, on_gpu=False) == ufl.INTERPRETER_CONFIG
    for m in (1, 2, 4):
        plain = ufl.fused_config(m, 28672, 4096, False)
        gated = ufl.fused_config(m, 28672, 4096, True)
        assert plain.kernel == gated.kernel == "gemv2" and gated.block_n >= 4
        assert 2 * gemv2_acc_registers(gated, m) == gemv2_acc_registers(plain, m)  # two accumulators, same registers
    assert ufl.fused_config(1, 28672, 4096, False) == TUNED[(1, 28672, 4096)]
    assert ufl.fused_config(1, 28672, 4096, True).block_n == TUNED[(1, 28672, 4096)].block_n // 2
    assert ufl.fused_config(4, 28672, 4096, True).block_w == TUNED[(4, 28672, 4096)].block_w // 2  # block_n is 4
    for m in (3, 4):  # u12_linear takes the tensor-core configs there, this kernel gemv2's
        assert ufl.fused_config(m, 4096, 4096, False) == TUNED[(4, 4096, 4096)]


def test_default_config_takes_its_own_tuned_entries_first(monkeypatch):
    """This kernel's TUNED (its own sweep, keyed by gated) before the tiles derived from u12_linear's,
    at the measured shape and at one near it (Qwen3-8B's gate_up), for that gated flag only."""
    cfg = U12Config(8, 128, num_warps=4, num_stages=1, kernel="gemv2")
    monkeypatch.setitem(ufl.TUNED_FUSED, (1, 28672, 4096, True), cfg)
    assert ufl.fused_config(1, 28672, 4096, True) is cfg
    assert ufl.fused_config(1, 24576, 4096, True) is cfg
    assert ufl.fused_config(1, 28672, 4096, False) == TUNED[(1, 28672, 4096)]
    assert ufl.fused_config(4, 28672, 4096, True) != cfg  # another rows bucket


# --- NormHandoff: a residual GEMV hands the stream's norm to the next GEMV ---------------------

def _handoff_pair(m, k, n, i, dtype, seed, gated=True):
    """A producer (x [m, k] · W [n, k] into the stream [m, n]) and a consumer weight ([2 i or i, n]),
    escapes planted in both, and the norm's weight."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    w = 0.02 * torch.randn(n, k, generator=g)
    plant_escapes(w, g, False)
    w2 = 0.02 * torch.randn((2 if gated else 1) * i, n, generator=g)
    plant_escapes(w2, g, gated)
    stream = (4 * torch.randn(m, n, generator=g)).to(dtype).to(DEVICE)
    gamma = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    return x, pack_u12(w.to(torch.bfloat16)).to(DEVICE), pack_u12(w2.to(torch.bfloat16)).to(DEVICE), stream, gamma


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 4), words=st.integers(1, 20), n_words=st.integers(1, 12), i=st.integers(1, 9),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), gated=st.booleans(),
       config=st.sampled_from(_CONFIGS), seed=st.integers(0, 2**16))
def test_norm_handoff_matches_reference(m, words, n_words, i, dtype, gated, config, seed):
    """The producer's stream, xg and Σ parts, then the consumer on them, against the reference's
    math (NormHandoff), at odd shapes."""
    _check_handoff_pair(m, words, n_words, i, dtype, gated, config, seed)


def _check_handoff_pair(m, words, n_words, i, dtype, gated, config, seed):
    k, n = 4 * words, 4 * n_words
    x, t, t2, stream, gamma = _handoff_pair(m, k, n, i, dtype, seed, gated)
    s_out, s_ref = stream.clone(), stream.clone()
    h_out, h_ref = ufl.NormHandoff(gamma, 1e-5), ufl.NormHandoff(gamma, 1e-5)
    assert ufl.u12_fused_linear(x, t, residual=s_out, hand_out=h_out, config=config) is s_out
    ufl.u12_fused_linear_reference(x, t, residual=s_ref, hand_out=h_ref)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(s_out, s_ref, atol=atol, rtol=rtol)
    # xg from the kernel's own stream: exactly dtype(stream · weight)
    torch.testing.assert_close(h_out.xg, (s_out.float() * gamma.float()).to(dtype), atol=0, rtol=0)
    assert h_out.parts.shape[1] == m and h_out.parts.shape[0] >= 1
    torch.testing.assert_close(h_out.parts.sum(0), (s_out.float() ** 2).sum(1), atol=1e-4, rtol=1e-5)
    y = ufl.u12_fused_linear(h_out.xg, t2, gated=gated, hand_in=h_out, config=config)
    y_ref = ufl.u12_fused_linear_reference(h_out.xg, t2, gated=gated, hand_in=h_out)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)


@pytest.fixture(scope="module")
def handed_over() -> tuple[ufl.NormHandoff, dict]:
    """A producer's handoff of 64 parts (its 64 programs of 4 rows: m 2, k 48, n 256) and consumer
    weights of 5 rows, gated ([2·5, 256]) and not. The producer's launch is most of a consumer case's
    interpreter time and the same in each, so it runs once; each case takes its own copy of the parts."""
    m, k, n, i = 2, 48, 256, 5
    x, t, gated_weight, stream, gamma = _handoff_pair(m, k, n, i, torch.float32, 7, gated=True)
    plain_weight = _handoff_pair(m, k, n, i, torch.float32, 8, gated=False)[2]
    h = ufl.NormHandoff(gamma, 1e-5)
    ufl.u12_fused_linear(x, t, residual=stream, hand_out=h)
    assert h.parts.shape == (64, m)  # the producer's 64 programs of 4 rows
    return h, {True: gated_weight, False: plain_weight}


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("warps", [1, 4], ids=["sum-before", "sum-after"])
def test_handed_in_parts_summed_around_the_loop(gated, warps, handed_over):
    """A consumer GEMV sums the producer's parts (64 here) before its loop with one warp, and loads
    them before it and sums them after it with four (``parts_after``), over 8 chunks of 8 words: the
    output is the reference's either way, and the parts' sum moves it: halving one part is caught."""
    produced, weights = handed_over
    h, t2, m = dataclasses.replace(produced, parts=produced.parts.clone()), weights[gated], produced.parts.shape[1]
    assert ufl.parts_after(64, m, warps) == (warps == 4)
    consumer = U12Config(4, 8, num_warps=warps, num_stages=1, kernel="gemv2")
    y = ufl.u12_fused_linear(h.xg, t2, gated=gated, hand_in=h, config=consumer)
    ref = ufl.u12_fused_linear_reference(h.xg, t2, gated=gated, hand_in=h)
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)
    h.parts[40] *= 0.5
    with pytest.raises(AssertionError):
        torch.testing.assert_close(ufl.u12_fused_linear(h.xg, t2, gated=gated, hand_in=h, config=consumer), ref,
                                   atol=atol, rtol=rtol)


def test_parts_after_bounds():
    """The handed-in parts wait for the loop's end only where one load takes them all (1024 at
    most), at most 8 a thread, with 4 warps or more, and never with none."""
    assert ufl.parts_after(1024, 1, 4) and ufl.parts_after(512, 2, 4) and ufl.parts_after(2048 // 2, 2, 8)
    assert not ufl.parts_after(1025, 1, 8)  # past one load
    assert not ufl.parts_after(1024, 2, 4)  # 16 a thread
    assert not ufl.parts_after(64, 1, 2)  # 2 warps (gate|up's)
    assert not ufl.parts_after(0, 1, 4)


def test_tuned_pins_qkv_apart_from_o():
    """TUNED's o entry (4-row blocks) does not reach qkv through the nearest-shape lookup, and
    gate|up's tile takes its parts after the loop."""
    assert ufl.fused_config(1, 4096, 4096, False).block_n == 4
    assert ufl.fused_config(1, 6144, 4096, False) == ufl.TUNED_FUSED[(1, 6144, 4096, False)]
    assert ufl.fused_config(1, 6144, 4096, False).block_w == 128
    # gate|up's 4 warps let its 1024 handed-in parts (o's programs) wait for the loop's end
    assert ufl.parts_after(4096 // ufl.fused_config(1, 4096, 4096, False).block_n, 1,
                           ufl.fused_config(1, 28672, 4096, True).num_warps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mma_epilogue_adds_the_escapes(mma_launches, dtype):
    """The mma epilogue's escapes from the table, in both halves of a gated weight (rows taken half
    gate, half up; one up row of 20 escapes) and in a plain residual one; a wrong weight shows."""
    g = torch.Generator().manual_seed(11)
    m, n_out, k = 7, 37, 96
    x = (3 * torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    for gated, crowded in ((True, True), (False, False)):
        w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
        plant_escapes(w, g, gated)
        if crowded:
            w[n_out + 3, torch.randperm(k, generator=g)[:20]] = 3.0  # an up row of 20 escapes
        t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
        r = None if gated else torch.randn(m, n_out, generator=g).to(dtype).to(DEVICE)
        out, ref = _both(x, t, gated=gated, residual=r)
        assert _close(out, ref), (gated, crowded)
        bad = ufl.u12_fused_linear(*plant_wrong_fused_weight((x, t, None, gated, r, "default"))[:2], gated=gated,
                                   residual=None if r is None else r.clone())
        assert not _close(bad, ref)
    assert [kw["gated"] for _, kw in mma_launches] == [True, True, False, False]


def test_mma_epilogue_sums_many_parts_in_chunks(mma_launches):
    """A handed-in norm from 300 parts (more than a chunk of 256): the mma epilogue's inv sums them
    all, chunk by chunk, as the reference sums them."""
    g = torch.Generator().manual_seed(12)
    m, k, i = 6, 64, 20
    parts = torch.rand(300, m, generator=g) * 50
    xg = (2 * torch.randn(m, k, generator=g)).to(torch.bfloat16)
    w = 0.02 * torch.randn(2 * i, k, generator=g)
    plant_escapes(w, g, True)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    hand = ufl.NormHandoff(torch.ones(k, dtype=torch.bfloat16, device=DEVICE), 1e-5, xg.to(DEVICE), parts.to(DEVICE))
    y = ufl.u12_fused_linear(hand.xg, t, gated=True, hand_in=hand)
    assert _close(y, ufl.u12_fused_linear_reference(hand.xg, t, gated=True, hand_in=hand))
    hand.parts = hand.parts[:256].clone()  # a sum short of the last 44 parts is another scale
    assert not _close(y, ufl.u12_fused_linear_reference(hand.xg, t, gated=True, hand_in=hand))
    assert len(mma_launches) == 1


_HMMA_T2 = U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")  # two m-tiles a warp, split-K
_HMMA_T1 = U12Config(32, 16, num_warps=2, num_stages=1, kernel="hmma")  # one m-tile a warp, two warps


@pytest.mark.parametrize("m,dtype,gated,producer,consumer", [
    (5, torch.float32, True, None, None), (16, torch.bfloat16, True, None, None),
    (9, torch.bfloat16, False, None, None), (16, torch.bfloat16, True, _HMMA_T2, None),
    (7, torch.bfloat16, False, _HMMA_T1, None), (13, torch.bfloat16, True, _HMMA_T1, _HMMA_T2),
    (6, torch.bfloat16, False, None, _HMMA_T1),
], ids=["mma-5", "mma-16", "mma-9-plain", "hmma-tiles2", "hmma-warps2", "hmma-both", "hmma-in-plain"])
def test_norm_handoff_at_many_rows(mma_launches, m, dtype, gated, producer, consumer):
    """At 5 rows and more the mma kernel's epilogue (its parts one a program of output columns) or
    the hmma kernel's (one a warp) hands the norm on, and either takes it in (the hmma kernel
    gated too: an m-tile's rows g gate rows, g + 8 their up rows), as the reference's math says."""
    x, t, t2, stream, gamma = _handoff_pair(m, 40, 68, 9, dtype, m, gated)
    s_out, s_ref = stream.clone(), stream.clone()
    h_out, h_ref = ufl.NormHandoff(gamma, 1e-5), ufl.NormHandoff(gamma, 1e-5)
    ufl.u12_fused_linear(x, t, residual=s_out, hand_out=h_out, config=producer)
    ufl.u12_fused_linear_reference(x, t, residual=s_ref, hand_out=h_ref)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(s_out, s_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(h_out.xg, (s_out.float() * gamma.float()).to(dtype), atol=0, rtol=0)
    programs = 2 if producer is None else (68 + producer.block_n - 1) // producer.block_n * producer.num_warps
    assert h_out.parts.shape == (programs, m)  # mma: 68 columns in blocks of 64; hmma: a part a warp
    torch.testing.assert_close(h_out.parts.sum(0), (s_out.float() ** 2).sum(1), atol=1e-4, rtol=1e-5)
    y = ufl.u12_fused_linear(h_out.xg, t2, gated=gated, hand_in=h_out, config=consumer)
    torch.testing.assert_close(y, ufl.u12_fused_linear_reference(h_out.xg, t2, gated=gated, hand_in=h_out),
                               atol=atol, rtol=rtol)
    expected = [(True, False)] * (producer is None) + [(False, True)] * (consumer is None)  # the mma launches
    assert [(kw["hand_out"] is h_out, kw["hand_in"] is h_out) for _, kw in mma_launches] == expected


@pytest.mark.parametrize("m,n_out,k,config,gated,residual", [
    (5, 33, 64, _HMMA_T2, False, True), (16, 70, 136, _HMMA_T1, False, True),
    (7, 21, 64, _HMMA_T2, True, False), (16, 40, 136, _HMMA_T1, True, True), (9, 5, 96, _HMMA_T1, True, False),
])
def test_hmma_epilogue(m, n_out, k, config, gated, residual):
    """The hmma kernel's SiLU·mul (an m-tile's rows g gate rows, g + 8 their up rows, each with its
    own escapes) and residual add at odd shapes (partial row blocks and chunks, split-K), as the
    reference computes them."""
    g = torch.Generator().manual_seed(m * n_out)
    x = (3 * torch.randn(m, k, generator=g)).to(torch.bfloat16).to(DEVICE)
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    r = torch.randn(m, n_out, generator=g).to(torch.bfloat16).to(DEVICE) if residual else None
    with mock.patch.object(ufl, "launch_hmma", wraps=ufl.launch_hmma) as launches:
        out, ref = _both(x, t, gated=gated, residual=r, config=config)
    assert launches.call_count == 1
    assert (launches.call_args.kwargs["gated"], launches.call_args.kwargs["residual"]) == (gated, residual)
    assert _close(out, ref)
    bad = ufl.u12_fused_linear(*plant_wrong_fused_weight((x, t, None, gated, r, "default"))[:2], gated=gated,
                               residual=None if r is None else r.clone(), config=config)
    assert not _close(bad, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_handoff_is_rmsnorm_up_to_rounding(dtype):
    """Producer then consumer equal the rmsnorm path (the stream normalised, then the GEMV) up to
    where each rounds: within one bf16 step of the result in bf16, to fp32 order in fp32; a lost
    or wrong scale (inv of the wrong row, no eps) is far outside that."""
    x, t, t2, stream, gamma = _handoff_pair(3, 40, 36, 7, dtype, 5)
    hand = ufl.NormHandoff(gamma, 1e-5)
    ufl.u12_fused_linear(x, t, residual=stream, hand_out=hand)
    y = ufl.u12_fused_linear(hand.xg, t2, gated=True, hand_in=hand)
    want = ufl.u12_fused_linear_reference(stream, t2, gated=True, norm_weight=gamma, eps=1e-5)
    tol = dict(atol=2e-3, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y, want, **tol)


def _bad_handoffs():
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    x, t = torch.zeros(2, 8, dtype=bf), pack_u12((0.02 * torch.randn(6, 8, generator=g)).to(bf))
    stream = torch.zeros(2, 6, dtype=bf)
    hand = ufl.NormHandoff(torch.ones(6, dtype=bf))
    return [
        (dict(x=x, t=t, hand_out=hand), "hand_out needs residual"),
        (dict(x=x, t=pack_u12((0.02 * torch.randn(12, 8, generator=g)).to(bf)), gated=True, residual=stream,
              hand_out=hand),
         "hand_out needs residual= \\(the stream\\) and gated=False"),
        (dict(x=x, t=t, residual=stream, hand_out=ufl.NormHandoff(torch.ones(5, dtype=bf))),
         "hand_out.weight must have shape \\(6,\\)"),
        (dict(x=x, t=t, residual=stream, hand_out=hand, norm_weight=torch.ones(8, dtype=bf)), "norm_weight must be None"),
        (dict(x=x, t=t, hand_in=hand), "x must be hand_in.xg"),
        (dict(x=x, t=t, residual=stream, hand_out=hand, hand_in=hand), "cannot both be given"),
        (dict(x=torch.zeros(2, 6, dtype=bf), t=pack_u12(torch.zeros(6, 6, dtype=bf)), residual=stream,
              hand_out=hand),
         "needs a fused kernel \\(K % 4 == 0 and a scaled base\\), got K = 6"),
    ]


@pytest.mark.parametrize("kwargs,match", _bad_handoffs(), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_handoffs_raise_value_errors(kwargs, match):
    kwargs = dict(kwargs)
    x, t = kwargs.pop("x"), kwargs.pop("t")
    with pytest.raises(ValueError, match=f"^u12_fused_linear: .*{match}"):
        ufl.u12_fused_linear(x, t, **kwargs)
