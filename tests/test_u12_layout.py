"""The u12 weight's tiled layout (specpilot/formats/u12.py, U12Tensor.layout "tiles"): the planes'
order both ways, bit-exact for every pattern; views of whole tiles; files; and every u12 kernel on
a tiled weight giving the row planes' outputs bit for bit (the same words meet the same x in the
same order), so one copy of the weight serves them all."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE
from specpilot.kernels.u12 import U12Config, default_config, dispatch, u12_linear, u12_linear_reference
from specpilot.kernels.u12 import fused as ufl
from specpilot.kernels.u12.cases import plant_escapes
from specpilot.formats.u12 import (
    concat_u12,
    load_u12,
    pack_u12,
    save_u12,
    tiled_word_offsets,
    tiles_fit,
    unpack_u12,
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _any_bits(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16 weights of any bit pattern in a third of the places (±0, subnormals, inf, NaN payloads)
    among N(0, 0.02) ones."""
    g = torch.Generator().manual_seed(seed)
    w = (0.02 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
    flat = w.view(torch.int16).view(-1)
    flat[::3] = torch.randint(-0x8000, 0x8000, (len(flat[::3]),), generator=g, dtype=torch.int16)
    return w


@settings(max_examples=20, deadline=None)
@given(tiles=st.integers(1, 4), groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_tiles_round_trip_and_place_every_word(tiles, groups, seed):
    n, k = 16 * tiles, 64 * groups
    w = _any_bits(n, k, seed)
    rows, tiled = pack_u12(w), pack_u12(w, layout="tiles")
    assert tiled.layout == "tiles" and tiled.base == rows.base and tiled.nbytes == rows.nbytes
    assert torch.equal(unpack_u12(tiled).view(torch.int16), w.view(torch.int16))
    assert torch.equal(tiled.esc_idx, rows.esc_idx) and torch.equal(tiled.esc_val, rows.esc_val)
    r = torch.arange(n)[:, None].expand(n, k // 4)
    c = torch.arange(k // 4)[None, :].expand(n, k // 4)
    at = tiled_word_offsets(r, c, k)
    assert torch.equal(at.flatten().sort().values, torch.arange(n * k // 4)), "a permutation of the words"
    assert torch.equal(tiled.sm.view(torch.int32).view(-1)[at], rows.sm.view(torch.int32))
    assert torch.equal(tiled.codes.view(torch.int16).view(-1)[at], rows.codes.view(torch.int16))
    assert tiled.with_layout("rows").sm.equal(rows.sm) and tiled.with_layout("tiles") is tiled


def test_tiles_need_whole_tiles():
    w = _any_bits(40, 128, 0)
    assert not tiles_fit(w.shape) and pack_u12(w, layout="tiles").layout == "rows"  # packs in rows instead
    with pytest.raises(ValueError, match=r"U12Tensor.with_layout: .*N % 16 == 0 and K % 64 == 0.*\[40, 128\]"):
        pack_u12(w).with_layout("tiles")
    with pytest.raises(ValueError, match="U12Tensor.layout"):
        dataclasses.replace(pack_u12(_any_bits(48, 96, 0)), layout="tiles")
    with pytest.raises(ValueError, match="'rows', 'tiles'"):
        pack_u12(_any_bits(48, 128, 0)).with_layout("columns")


def test_rows_of_whole_tiles_are_views_and_others_copies():
    w = _any_bits(64, 128, 1)
    t = pack_u12(w, layout="tiles")
    whole = t.rows(16, 48)
    assert whole.layout == "tiles" and whole.sm.data_ptr() == t.sm[16].data_ptr()
    assert torch.equal(unpack_u12(whole).view(torch.int16), w[16:48].view(torch.int16))
    part = t.rows(5, 40)
    assert part.layout == "rows" and torch.equal(unpack_u12(part).view(torch.int16), w[5:40].view(torch.int16))


def test_files_keep_the_layout_and_check_it(tmp_path):
    w = _any_bits(32, 128, 2)
    path = tmp_path / "w.safetensors"
    save_u12({"a": pack_u12(w, layout="tiles"), "b": pack_u12(w)}, path)
    back = load_u12(path)
    assert back["a"].layout == "tiles" and back["b"].layout == "rows"
    assert torch.equal(unpack_u12(back["a"]).view(torch.int16), w.view(torch.int16))
    # the same planes read as the other layout are another tensor: its checksum must not match
    from safetensors import safe_open
    from safetensors.torch import save_file
    import json

    with safe_open(str(path), framework="pt") as f:
        meta, planes = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}
    entries = json.loads(meta["u12"])
    entries["a"]["layout"] = "rows"
    save_file(planes, str(path), metadata={**meta, "u12": json.dumps(entries)})
    with pytest.raises(ValueError, match="tensor 'a': checksum mismatch"):
        load_u12(path)


def test_concat_keeps_tiles_where_all_are():
    a, b = _any_bits(32, 128, 3), _any_bits(16, 128, 4)
    both = concat_u12([pack_u12(a, layout="tiles"), pack_u12(b, layout="tiles")])
    assert both.layout == "tiles" and torch.equal(unpack_u12(both).view(torch.int16), torch.cat([a, b]).view(torch.int16))
    assert concat_u12([pack_u12(a, layout="tiles"), pack_u12(b)]).layout == "rows"


# --- the kernels -----------------------------------------------------------------------------

_CONFIGS = {
    "tile": U12Config(16, 8, split_k=2),
    "gemv2": U12Config(8, 4, num_warps=1, kernel="gemv2"),
    "gemv2-wide": U12Config(4, 16, num_warps=2, kernel="gemv2"),
    "mma": U12Config(64, 16, split_k=2, num_warps=4, kernel="mma"),
    "hmma": U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma"),
}


@pytest.mark.interpreter
@settings(max_examples=10, deadline=None)
@given(kernel=st.sampled_from(sorted(_CONFIGS)), m=st.integers(1, 20), tiles=st.integers(1, 5),
       groups=st.integers(1, 5), dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**16))
def test_every_kernel_reads_tiles_as_rows(kernel, m, tiles, groups, dtype, seed):
    """Each u12_linear kernel on the tiled twin of a weight: the row planes' outputs bit for bit, at
    odd M, partial blocks of N (16 rows at a time) and masked chunks of K (64 at a time)."""
    cfg = _CONFIGS[kernel]
    if kernel.startswith("gemv2"):
        m = min(m, 4)
    n, k = 16 * tiles, 64 * groups
    w = (0.02 * torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    w.view(-1)[seed % (n * k)] = 9.0  # an escape
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(DEVICE)
    y = u12_linear(x, t, cfg)
    assert torch.equal(u12_linear(x, t.with_layout("tiles"), cfg), y)
    torch.testing.assert_close(y.float(), u12_linear_reference(x, t).float(), rtol=8e-3, atol=1e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,gated,hand", [(1, True, False), (4, True, True), (3, False, True)])
def test_fused_gemv_reads_tiles_as_rows(m, gated, hand):
    """u12_fused_linear's GEMV (the AR step's: gate and up rows two tiles apart, the norm handoff)
    on a tiled weight: the row planes' outputs bit for bit."""
    g = torch.Generator().manual_seed(m)
    n_out, k = 24 if gated else 48, 256  # gated: 2 x 24 rows, each half of a tile in two tiles
    w = 0.02 * torch.randn((2 if gated else 1) * n_out, k, generator=g)
    plant_escapes(w, g, gated)
    t = pack_u12(w.to(torch.bfloat16)).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for tt in (t, t.with_layout("tiles")):
        if hand:
            parts = torch.rand(7, m, generator=g.manual_seed(1)).to(DEVICE)
            h = ufl.NormHandoff(nw, 1e-5, x, parts)
            outs.append(ufl.u12_fused_linear(x, tt, gated=gated, hand_in=h))
        else:
            outs.append(ufl.u12_fused_linear(x, tt, norm_weight=nw, gated=gated))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_tiled_weights_take_their_own_tensor_core_configs(monkeypatch):
    """From TENSOR_CORE_ROWS to TILES_MAX_ROWS (32) rows a tiled weight takes TUNED_TILES' entry (the
    hmma kernel at every Llama-3.1-8B shape; past 16 rows its 32-row programs), a row-planes one
    TUNED's, as tiles do above; one row stays gemv2's either way; a 32-row entry, where the table
    has one, serves 17..32 rows."""
    for (bucket, n, k), cfg in dispatch.TUNED_TILES.items():
        assert bucket == 16 and cfg.kernel == "hmma"
        assert default_config(16, n, k, layout="tiles") is cfg
        assert default_config(3, n, k, layout="tiles") is cfg
        assert default_config(16, n, k) is dispatch.TUNED[(16, n, k)]
        assert default_config(1, n, k, layout="tiles") is default_config(1, n, k)
        assert default_config(32, n, k, layout="tiles") is cfg
        assert default_config(33, n, k, layout="tiles") is default_config(33, n, k)
        assert ufl.tensor_core_config(16, n, k, layout="tiles") is cfg
    n, k = next(iter(dispatch.TUNED_TILES))[1:]
    at16 = dispatch.TUNED_TILES[(16, n, k)]
    at32 = dataclasses.replace(at16, maxnreg=168)
    monkeypatch.setattr(dispatch, "TUNED_TILES", {**dispatch.TUNED_TILES, (32, n, k): at32})
    assert default_config(16, n, k, layout="tiles") is at16
    assert default_config(17, n, k, layout="tiles") is at32 and default_config(32, n, k, layout="tiles") is at32
