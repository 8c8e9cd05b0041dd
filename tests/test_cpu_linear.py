"""runtime/cpu_linear.py: oneDNN's packed fp32 linear against nn.Linear, and what build_engine packs on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specpilot.backends.torch_backend import build_engine
from specpilot.hf.checkpoint import read_config
from specpilot.ir import lower
from specpilot.passes import run_passes
from specpilot.passes.draft_vocab import DraftVocab
from specpilot.runtime.cpu_linear import PackedLinear, pack_linears, packed_linear_available
from specpilot.runtime.draft_vocab import SubsetHead
from specpilot.runtime.load import load_target

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(0,), (1,), (1, 1), (1, 4), (3, 5), (2, 17)])
def test_packed_linear_equals_nn_linear(shape, bias):
    g = torch.Generator().manual_seed(sum(shape) + bias)
    linear = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(*shape, 96, generator=g)
    packed = PackedLinear.of(linear)
    out = packed(x)
    assert out.shape == (*shape, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-4)
    assert packed.weight is linear.weight and packed.bias is linear.bias


def test_packed_linear_refuses_other_dtypes():
    with pytest.raises(ValueError, match="fp32 CPU"):
        PackedLinear.of(nn.Linear(4, 4, dtype=torch.bfloat16))


def test_pack_linears_keeps_the_model_its_state_and_its_weights(tiny_model_dirs):
    model, cfg = load_target(tiny_model_dirs["qwen3"]["target"], dtype=torch.float32, device="cpu")
    assert cfg.tie_word_embeddings
    model.eval()
    keys = list(model.state_dict())
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        before = model(ids, model.new_cache(1, 8)).logits
    linears = sum(type(m) is nn.Linear for m in model.modules())
    head = model.lm_head.weight
    assert pack_linears(model) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is head and list(model.state_dict()) == keys  # the same Parameter: still tied
    with torch.inference_mode():
        torch.testing.assert_close(model(ids, model.new_cache(1, 8)).logits, before, rtol=1e-5, atol=1e-4)
    assert pack_linears(model) == 0  # packed once


def test_cpu_engines_pack_the_target_the_drafter_and_its_subset_head(tiny_model_dirs, tmp_path):
    dirs = tiny_model_dirs["qwen3"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    program = lower(read_config(dirs["target"])[0], read_config(dirs["dflash"])[0], dtype="float32")
    program = run_passes(program, [DraftVocab(size=40, corpus=str(corpus))])[0]
    engine = build_engine(program, dirs["target"], dirs["dflash"], torch.device("cpu"))
    assert isinstance(engine.target.lm_head, PackedLinear)
    assert isinstance(engine.target.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(engine.drafter.encoder.fc, PackedLinear)
    head = engine.drafter._shared[1]
    assert isinstance(head, SubsetHead) and isinstance(head.rows, PackedLinear)
    prompt = [5, 6, 7, 8, 9, 10]
    assert engine.generate(prompt, 12).tokens == engine.generate_ar(prompt, 12).tokens
