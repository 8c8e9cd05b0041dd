"""The u12 format: bit-exact round trips on adversarial bf16 tensors, the window choice, files."""

import json
import math
import struct

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE, ON_GPU
from specpilot.kernels.split_k import counters_of
from specpilot.kernels.u12 import U12Config, u12_linear, u12_linear_reference
from specpilot.kernels.u12.decode import decode_planes, decode_words
from specpilot.formats.u12 import (
    MAX_BASE,
    MAX_LANES,
    WINDOW,
    U12Tensor,
    load_u12,
    pack_u12,
    save_u12,
    u12_stats,
    unpack_u12,
)

SPECIAL_BITS = [
    0x0000, 0x8000,  # ±0
    0x0001, 0x007F, 0x8001, 0x807F,  # smallest and largest subnormals, both signs
    0x0080, 0x7F7F, 0xFF7F,  # smallest normal, ±largest finite
    0x7F80, 0xFF80,  # ±inf
    0x7FC0, 0xFFC0, 0x7F81, 0x7FFF, 0xFF81, 0xFFFF,  # quiet and signalling NaNs with payloads
    0x3F80, 0xBF80,  # ±1
]


def as_bf16(bits: list[int], n: int, k: int) -> torch.Tensor:
    """bf16 tensor [n, k] from bit patterns in 0..65535."""
    b = torch.tensor(bits, dtype=torch.int32)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16).reshape(n, k)


def bits_of(w: torch.Tensor) -> torch.Tensor:
    return w.view(torch.int16)


def assert_round_trip(w: torch.Tensor, base: int | None = None) -> U12Tensor:
    t = pack_u12(w, base=base)
    out = unpack_u12(t)
    assert out.dtype == torch.bfloat16 and out.shape == w.shape
    assert torch.equal(bits_of(out), bits_of(w))
    return t


def exponents(w: torch.Tensor) -> torch.Tensor:
    return (bits_of(w).to(torch.int32) >> 7) & 0xFF


shapes = st.tuples(st.integers(1, 9), st.integers(1, 40))
any_bits = st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL_BITS))


@st.composite
def adversarial_tensors(draw):
    """Arbitrary bit patterns, weighted towards the special values."""
    n, k = draw(shapes)
    return as_bf16(draw(st.lists(any_bits, min_size=n * k, max_size=n * k)), n, k)


@st.composite
def weight_like_tensors(draw):
    """Normal weights of some scale, with special values planted at drawn positions."""
    n, k = draw(shapes)
    sigma = draw(st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 1e30]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    w = (torch.randn(n, k, generator=g) * sigma).to(torch.bfloat16)
    plants = draw(st.lists(st.tuples(st.integers(0, n * k - 1), st.sampled_from(SPECIAL_BITS)), max_size=8))
    flat = bits_of(w).view(-1)
    for pos, b in plants:
        flat[pos] = b - 0x10000 if b >= 0x8000 else b
    return w


@st.composite
def spread_exponent_tensors(draw):
    """Exponents 16 apart, so no window holds two of them: most weights must escape."""
    n, k = draw(shapes)
    triples = st.tuples(st.integers(0, 1), st.sampled_from(range(0, 256, 16)), st.integers(0, 127))
    parts = draw(st.lists(triples, min_size=n * k, max_size=n * k))
    return as_bf16([s << 15 | e << 7 | m for s, e, m in parts], n, k)


tensors = st.one_of(adversarial_tensors(), weight_like_tensors(), spread_exponent_tensors())


@settings(max_examples=200, deadline=None)
@given(tensors)
def test_round_trip_is_bit_exact(w):
    assert_round_trip(w)


@settings(max_examples=200, deadline=None)
@given(tensors)
def test_window_covers_the_most_weights(w):
    t = pack_u12(w)
    e = exponents(w)
    best = max(int(((e >= b) & (e < b + WINDOW)).sum()) for b in range(MAX_BASE + 1))
    assert w.numel() - t.esc_idx.numel() == best
    in_window = (e >= t.base) & (e < t.base + WINDOW)
    assert int(in_window.sum()) == best


@settings(max_examples=200, deadline=None)
@given(tensors)
def test_planes_and_escape_table_are_consistent(w):
    t = pack_u12(w)
    n, k = t.shape
    codes = torch.stack((t.codes & 0xF, t.codes >> 4), dim=-1).reshape(n, -1)
    if k % 2:
        assert not codes[:, k:].any(), "padding nibble must be zero"
    escaped = (codes[:, :k] == 0).view(-1)
    idx = t.esc_idx.to(torch.int64)
    assert torch.equal(torch.nonzero(escaped).view(-1), idx), "escapes are exactly the code-0 positions, in order"
    assert torch.equal(t.esc_val, bits_of(w).view(-1)[idx])
    assert not t.sm.view(-1)[idx].any(), "sign/mantissa bytes are 0 at escapes"
    assert t.esc_idx.dtype == torch.int32
    ptr = t.esc_row_ptr
    assert ptr.shape == (n + 1,) and int(ptr[-1]) == idx.numel()
    assert torch.equal(ptr[1:] - ptr[:-1], escaped.view(n, k).sum(1).to(torch.int32))


@settings(max_examples=200, deadline=None)
@given(tensors)
def test_escape_lanes_hold_each_rows_escapes(w):
    """Row r's lanes: its escapes in table order as column | bf16 bits << 16, then 0xFFFF; as many
    lanes as the fullest row needs, rounded up to a power of two; none past MAX_LANES."""
    t = pack_u12(w)
    n, k = t.shape
    ptr, idx, val = t.esc_row_ptr.tolist(), t.esc_idx.tolist(), t.esc_val.tolist()
    counts = [ptr[r + 1] - ptr[r] for r in range(n)]
    most = max(counts)
    if most > MAX_LANES:
        assert t.esc_lanes is None
        return
    lanes = t.esc_lanes
    s = lanes.shape[1]
    assert lanes.dtype == torch.int32 and lanes.shape == (n, s)
    assert s & (s - 1) == 0 and s >= most and (s == 1 or s // 2 < most)
    for r in range(n):
        expected = [idx[e] % k | (val[e] & 0xFFFF) << 16 for e in range(ptr[r], ptr[r + 1])]
        assert [v & 0xFFFFFFFF for v in lanes[r].tolist()] == expected + [0xFFFF] * (s - counts[r])


@pytest.mark.parametrize("n,k,per_row,lanes", [(3, 40, 16, 16), (3, 40, 17, None), (1, 65536, 1, None),
                                              (2, 65535, 1, 1), (4, 8, 0, 1)])
def test_escape_lanes_bounds(n, k, per_row, lanes):
    """16 escapes a row fit the lanes, 17 do not; nor does K past 65535 (a lane's 16-bit column)."""
    w = torch.full((n, k), 0.02)
    w[:, :per_row] = 1e-30  # far below the window of 0.02: escapes
    t = pack_u12(w.to(torch.bfloat16))
    assert t.esc_idx.numel() == n * per_row
    assert (None if t.esc_lanes is None else t.esc_lanes.shape[1]) == lanes


@settings(max_examples=100, deadline=None)
@given(tensors, st.integers(0, MAX_BASE))
def test_any_base_round_trips(w, base):
    t = assert_round_trip(w, base=base)
    e = exponents(w)
    assert t.esc_idx.numel() == int(((e < base) | (e >= base + WINDOW)).sum())


@pytest.mark.parametrize("n,k", [(1, 1), (3, 5), (7, 33), (256, 256), (7, 9363)])
def test_every_bit_pattern_round_trips(n, k):
    patterns = torch.arange(n * k, dtype=torch.int32) % 0x10000  # all 65536 patterns once n·k >= 65536
    assert_round_trip(as_bf16(patterns.tolist(), n, k))


def test_no_escapes():
    w = as_bf16([(0x3F80 + i) ^ (0x8000 * (i % 2)) for i in range(3 * 5)], 3, 5)  # one exponent
    t = assert_round_trip(w)
    assert t.esc_idx.numel() == 0 and t.esc_val.numel() == 0


def test_all_escapes():
    w = (torch.randn(7, 33) * 0.02).to(torch.bfloat16)
    t = assert_round_trip(w, base=MAX_BASE)  # window 241..255: inf/NaN only
    assert t.esc_idx.numel() == w.numel()
    assert not t.codes.any()


def test_pack_rejects_other_inputs():
    with pytest.raises(ValueError, match="2-D bfloat16"):
        pack_u12(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D bfloat16"):
        pack_u12(torch.zeros(4, dtype=torch.bfloat16))


def test_stats_of_normal_weights():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)
    s = u12_stats(w)
    # The window is exponents 109..123, |w| in [2^-18, 2^-3); escapes are almost all |w| < 2^-18:
    # P(|z| < 2^-18 / 0.02) ≈ 1.52e-4, i.e. about 160 of 2^20 weights (seed 0 gives 156; ±4σ below).
    assert s["base"] == 109
    assert 1.0e-4 < s["escape_rate"] < 2.0e-4
    # 12 bits, plus 6 bytes (int32 index, int16 value) per escape.
    assert s["bits_per_weight"] == pytest.approx(12 + 48 * s["escape_rate"])
    # A GEMV reads the planes and each row's lanes: 4 bytes a lane, 2 lanes (at most 2 escapes a row
    # here: 0.15 a row on average).
    assert int(pack_u12(w).esc_row_ptr.diff().max()) == 2
    assert s["lanes"] == 2 and s["read_bits_per_weight"] == pytest.approx(12 + 32 * 2 / 1024)
    # A row of 17 escapes has no lanes: a GEMV reads the table and its int32 row pointers.
    w[0, :17] = 1e-30
    s = u12_stats(w)
    assert s["lanes"] == 0
    assert s["read_bits_per_weight"] == pytest.approx(s["bits_per_weight"] + 32 * 1025 / 1024**2)
    assert 12.0 < s["bits_per_weight"] < 12.01
    assert 20 <= s["distinct_exponents"] <= 30
    assert s["exponent_entropy_bits"] == pytest.approx(2.55, abs=0.02)


# --- files --------------------------------------------------------------------------------

def sample_tensors() -> dict[str, U12Tensor]:
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(7, 33, generator=g) * 0.02).to(torch.bfloat16)
    w.view(torch.int16)[0, :4] = torch.tensor([0x7F80, 0x7FC1, 0x0001, 0x0000], dtype=torch.int32).to(torch.int16)
    return {
        "model.layers.0.mlp.down_proj.weight": pack_u12(w),
        "all_escapes": pack_u12(w, base=MAX_BASE),
        "no_escapes": pack_u12(as_bf16([0x3F80] * 6, 2, 3)),
    }


def test_save_load_round_trip(tmp_path):
    tensors = sample_tensors()
    path = tmp_path / "weights.u12.safetensors"
    save_u12(tensors, path)
    loaded = load_u12(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].shape == t.shape and loaded[name].base == t.base
        assert torch.equal(bits_of(unpack_u12(loaded[name])), bits_of(unpack_u12(t)))


def _plane_range(path, key: str) -> tuple[int, int]:
    """Byte range of one tensor's data in a safetensors file."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8 : 8 + header_len])[key]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


@pytest.mark.parametrize("plane", ["sm", "codes", "esc_idx", "esc_val"])
def test_corrupted_plane_fails_checksum(tmp_path, plane):
    path = tmp_path / "weights.u12.safetensors"
    name = "model.layers.0.mlp.down_proj.weight"
    save_u12(sample_tensors(), path)
    start, end = _plane_range(path, f"{name}.{plane}")
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"{path.name}.*{name}.*checksum mismatch"):
        load_u12(path)


def test_tampered_base_fails_checksum(tmp_path):
    path = tmp_path / "weights.u12.safetensors"
    tensors = sample_tensors()
    # Write the file by hand with a wrong base in the metadata, checksum kept.
    save_u12(tensors, path)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    meta = json.loads(header["__metadata__"]["u12"])
    meta["no_escapes"]["base"] += 1
    header["__metadata__"]["u12"] = json.dumps(meta)
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    path.write_bytes(struct.pack("<Q", len(new_header)) + new_header + raw[8 + header_len :])
    with pytest.raises(ValueError, match="no_escapes.*checksum mismatch"):
        load_u12(path)


def test_load_rejects_other_safetensors(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ValueError, match="not a u12 file"):
        load_u12(path)


def test_bits_per_weight_is_three_quarters_of_bf16():
    w = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    t = pack_u12(w)
    assert math.isclose(t.nbytes / (2 * w.numel()), 0.75, rel_tol=0.01)


# --- the u12_linear kernel's configurations on these planes -----------------------------------
# (tests/test_kernels.py runs the registry cases with the default config; these walk the config
# space: split-K with its fixup, the word and byte loads, the scaled and exact decodes, both paths.)

_KERNEL_CASES = [  # (M, N, K, base, block_n, block_w, split_k, decode)
    (1, 9, 64, None, 4, 4, 3, "pairs"),  # GEMV, words, scaled decode, split-K over 4 word blocks (3 used)
    (1, 9, 64, None, 4, 4, 3, "single"),
    (3, 9, 70, None, 8, 2, 4, "pairs"),  # GEMV, byte loads (K % 4 == 2), split-K
    (2, 5, 61, 0, 4, 4, 2, "pairs"),  # exact decode: base 0 reaches subnormal exponents; K % 4 == 1
    (1, 6, 36, MAX_BASE, 4, 2, 1, "pairs"),  # exact decode: window reaching inf/NaN, most weights escape
    (17, 20, 68, None, 16, 4, 3, "pairs"),  # tl.dot path, split-K, two M blocks... of 16 rows
]


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("m,n,k,base,block_n,block_w,split_k,decode", _KERNEL_CASES)
def test_u12_linear_configs_match_reference(m, n, k, base, block_n, block_w, split_k, decode):
    device = DEVICE
    g = torch.Generator().manual_seed(m * 1000 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    flat = bits_of(w).view(-1)
    specials = [b for b in SPECIAL_BITS if b & 0x7FFF != 0x7F7F]  # not ±max: sums near it overflow in any order
    planted = len(flat[::11])
    flat[::11] = bits_of(as_bf16((specials * planted)[:planted], 1, planted)).view(-1)  # ±0, subnormals, inf, NaN, ±1
    if base == 0:
        flat[1::3] &= 0x807F  # exponent 0: zeros and subnormals, inside base 0's window
    t = pack_u12(w, base=base).to(device)
    x = torch.randn(m, k, generator=g).to(device)
    cfg = U12Config(block_n, block_w, split_k, decode=decode)
    y = u12_linear(x, t, cfg)
    ref = u12_linear_reference(x, t)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(y)) and torch.equal(ref.isnan(), y.isnan())
    assert torch.allclose(y[finite], ref[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(y[ref.isinf()], ref[ref.isinf()])
    y2 = u12_linear(x, t, cfg)
    assert torch.equal(y.view(torch.int32), y2.view(torch.int32)), "split-K sums in a fixed order"
    for buf in counters_of(t):
        assert not buf.any(), "the last program of each block resets its counter"


@triton.jit
def _decode_kernel(sm_ptr, codes_ptr, out_ptr, base, SCALED: tl.constexpr, PAIRS: tl.constexpr,
                   TO_BF16: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    """The kernel's decode alone: int32 sign/mantissa words and int16 code words in, fp32 bits out."""
    rows, cols = tl.arange(0, BN)[:, None], tl.arange(0, BW)[None, :]
    s = tl.load(sm_ptr + rows * BW + cols)
    c = tl.load(codes_ptr + rows * BW + cols).to(tl.int32)
    w = decode_words(s, c, base, SCALED, PAIRS, TO_BF16, BN, BW)
    if TO_BF16:  # bits, not a conversion (the interpreter's bf16 -> fp32 flushes subnormals)
        bits = w.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = w.to(tl.int32, bitcast=True)
    tl.store(out_ptr + rows * 4 * BW + tl.arange(0, 4 * BW)[None, :], bits.to(tl.float32, bitcast=True))


def _all_patterns(base: int) -> tuple[torch.Tensor, U12Tensor]:
    """Every bf16 bit pattern once, [64, 1024], packed with ``base``."""
    n, k = 64, 1024
    w = as_bf16(list(range(n * k)), n, k)
    return w, pack_u12(w, base=base)


def _assert_decoded(out: torch.Tensor, w: torch.Tensor, t: U12Tensor, scaled: bool, biased: bool = False) -> None:
    """out (fp32 bits, k order) is each in-window weight, times 2^-(base-1) when scaled, 2^(113-base)
    when biased; escapes +0.0, or 2^-15 when biased (what the escape pass takes back)."""
    escaped = torch.zeros(w.numel(), dtype=torch.bool)
    escaped[t.esc_idx.long()] = True
    escaped = escaped.view(w.shape)
    esc_bits = 0x38000000 if biased else 0  # 2^-15: exponent field 112, sign and mantissa 0
    assert (out[escaped].view(torch.int32) == esc_bits).all(), "escapes decode to the fixed pattern"
    expected = w.float() * (2.0 ** (113 - t.base) if biased else 2.0 ** -(t.base - 1) if scaled else 1.0)
    kept = ~escaped & ~w.float().isnan()
    assert torch.equal(out[kept].view(torch.int32), expected[kept].view(torch.int32))
    assert out[~escaped & w.float().isnan()].isnan().all()


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("to_bf16", [False, True])
@pytest.mark.parametrize("scaled,pairs", [(False, False), (True, False), (True, True)])
def test_decode_words_bit_exact(scaled, pairs, to_bf16):
    """The kernel's decode of every in-window pattern: the exact bits, or (scaled) the weight times
    2^-(base-1); escapes decode to +0. The bf16 output (the GPU's dot path) is checked here too,
    since the interpreter's bf16 dot cannot be."""
    device = DEVICE
    w, t = _all_patterns(base=1 if scaled else 0)  # base 1: the window's lowest exponent is the lowest normal one
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32, device=device)
    _decode_kernel[(1,)](t.sm.view(torch.int32).to(device), t.codes.view(torch.int16).to(device), out, t.base,
                 SCALED=scaled, PAIRS=pairs, TO_BF16=to_bf16, BN=n, BW=k // 4)
    _assert_decoded(out.cpu(), w, t, scaled)


@triton.jit
def _planes_kernel(sm_ptr, codes_ptr, out_ptr, ASM: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr):
    """The gemv2 decode alone: its four planes stored back in k order (plane j holds weight 4 w + j)."""
    rows, cols = tl.arange(0, BN)[:, None], tl.arange(0, BW)[None, :]
    s = tl.load(sm_ptr + rows * BW + cols)
    c = tl.load(codes_ptr + rows * BW + cols).to(tl.int32)
    w0, w1, w2, w3 = decode_planes(s, c, ASM)
    out = out_ptr + rows * 4 * BW + 4 * cols
    tl.store(out, w0)
    tl.store(out + 1, w1)
    tl.store(out + 2, w2)
    tl.store(out + 3, w3)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("asm", [False, True] if ON_GPU else [False])
def test_decode_planes_bit_exact(asm):
    """The gemv2 decode (biased) of every pattern: PTX prmt/lop3 (GPU) and their shift-and-mask
    emulation must give the same bits, the weight times 2^(113-base), escapes 2^-15; at the lowest
    base (the window's lowest exponent the lowest normal one) and the highest."""
    device = DEVICE
    for base in (1, MAX_BASE - 1):
        w, t = _all_patterns(base=base)
        n, k = w.shape
        out = torch.empty(n, k, dtype=torch.float32, device=device)
        _planes_kernel[(1,)](t.sm.view(torch.int32).to(device), t.codes.view(torch.int16).to(device), out,
                             ASM=asm, BN=n, BW=k // 4)
        _assert_decoded(out.cpu(), w, t, scaled=False, biased=True)


def test_rows_and_concat_are_exact():
    from specpilot.formats.u12 import concat_u12

    g = torch.Generator().manual_seed(3)
    a = (torch.randn(7, 10, generator=g) * 0.02).to(torch.bfloat16)
    a[2, 3], a[6, 9], a[0, 0] = float("inf"), 3.0, 1e-30  # escapes in the first, last and a middle row
    b = (torch.randn(5, 10, generator=g) * 4).to(torch.bfloat16)  # another window: a different base
    ta, tb = pack_u12(a), pack_u12(b)
    whole = concat_u12([ta, tb])
    assert torch.equal(unpack_u12(whole).view(torch.int16), torch.cat([a, b]).view(torch.int16))
    for start, stop in ((0, 7), (7, 12), (2, 3), (6, 6), (0, 12)):
        part = whole.rows(start, stop)
        assert part.sm.untyped_storage().data_ptr() == whole.sm.untyped_storage().data_ptr()
        assert torch.equal(unpack_u12(part).view(torch.int16), torch.cat([a, b])[start:stop].view(torch.int16))
    with pytest.raises(ValueError, match="share K"):
        concat_u12([ta, pack_u12(a[:, :4])])
    with pytest.raises(ValueError, match="start <= stop"):
        whole.rows(5, 13)
