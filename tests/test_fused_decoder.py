"""The fused decoder stack (runtime/fused.py) against the model's own forward.

With the kernels' torch references, the only numerical change is the concatenated q|k|v and
gate|up GEMMs (a BLAS may block a wider matrix differently: fp32 GEMVs moved by ~1e-6 on CPU).
So: bit-exact with the concatenation undone, close with it, and the same greedy tokens. Under the
Triton interpreter the kernels themselves run inside a graphed decode loop.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.runtime import decode
from specpilot.runtime import graph_decode as gd
from specpilot.runtime.fused import install_fused
from specpilot.runtime.load import load_drafter, load_target

from conftest import FAMILIES

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _pair(dirs, dtype):
    """(reference, model to fuse, config). The reference's projections are re-pointed at
    concatenated weights too (then served unfused): a CPU BLAS can round a GEMV over a slice of
    a larger matrix differently from one over its own copy, which is not what is tested here."""
    ref, cfg = load_target(dirs["target"], dtype=dtype, device="cpu")
    install_fused(ref, "torch")
    ref.fused = None
    fused, _ = load_target(dirs["target"], dtype=dtype, device="cpu")
    return ref, fused, cfg


TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_length", [False, True])
@pytest.mark.parametrize("concat", [False, True])
def test_fused_references_match_the_forward(family, dtype, device_length, concat, tiny_model_dirs):
    ref, fused, cfg = _pair(tiny_model_dirs[family], dtype)
    decoder = install_fused(fused, "torch")
    if not concat:  # project one by one: what is left is the wiring, which must be exact
        for layer in decoder.layers:
            layer.qkv = layer.gate_up = None
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 13), generator=g)
    layers = (0, cfg.num_layers - 1)
    c_ref = ref.new_cache(1, 40, device_length=device_length)
    c_fused = fused.new_cache(1, 40, device_length=device_length)
    for chunk, mask in ((ids, "causal"), (ids[:, :1], "causal"), (ids[:, :5], "full")):
        a = ref(chunk, c_ref, mask=mask, hidden_layers=layers)
        b = fused(chunk, c_fused, mask=mask, hidden_layers=layers)
        check = torch.equal if not concat else lambda x, y: torch.testing.assert_close(x, y, **TOLERANCE[dtype]) is None
        assert check(a.logits, b.logits)
        assert check(a.hidden, b.hidden)
    for i in range(cfg.num_layers):  # the same K/V landed in the same slots
        assert check(c_ref.k[i], c_fused.k[i]) and check(c_ref.v[i], c_fused.v[i])


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_greedy_tokens_equal_ar(family, tiny_model_dirs):
    ref, fused, _ = _pair(tiny_model_dirs[family], torch.float32)
    install_fused(fused, "torch")
    prompt = [7, 3, 9, 1, 4]
    assert (decode.generate_ar(fused, prompt, max_new_tokens=24, eos_token_id=None).tokens
            == decode.generate_ar(ref, prompt, max_new_tokens=24, eos_token_id=None).tokens)


def test_fused_projections_share_storage(tiny_model_dirs):
    _, fused, _ = _pair(tiny_model_dirs["qwen3"], torch.float32)
    decoder = install_fused(fused, "torch")
    layer = decoder.layers[0]
    attn = layer.layer.self_attn
    assert attn.k_proj.weight.data_ptr() == layer.qkv[attn.q_proj.weight.shape[0]:].data_ptr()
    assert layer.gate_up.shape[0] == 2 * layer.layer.mlp.up_proj.weight.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_triton_kernels_in_a_graphed_dflash_loop(family, tiny_model_dirs):
    dirs = tiny_model_dirs[family]
    ref, fused, cfg = _pair(dirs, torch.float32)
    install_fused(fused, "triton")
    drafter = load_drafter(dirs["dflash"], fused, cfg, dtype=torch.float32, device="cpu")
    prompt = [5, 9, 2, 6, 5, 3]
    ar = decode.generate_ar(ref, prompt, max_new_tokens=6, eos_token_id=None)
    out = gd.generate_dflash_graphed(fused, drafter, prompt, block_size=drafter.block_size,
                                     mask_token_id=drafter.mask_token_id, max_new_tokens=6, eos_token_id=None)
    assert out.tokens == ar.tokens
