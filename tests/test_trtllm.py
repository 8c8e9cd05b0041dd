"""`backend: trtllm`: TensorRT-LLM checkpoints, read back into our runtime and token-forced.

TensorRT-LLM is not installed: the names and config keys checked here are the ones its converters
write (docs/TRTLLM.md cites the files), and the checkpoints are judged by reading them back.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from conftest import FAMILIES, tiny_spec
from specpilot.backends import trtllm
from specpilot.cli import main
from specpilot.errors import CheckpointError, SpecError
from specpilot.spec import parse_spec

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _expected_names(layers: int, qk_norm: bool) -> set[str]:
    """What llama/convert.py and qwen/convert.py write for an unquantized single-rank model."""
    names = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(layers):
        p = f"transformer.layers.{i}."
        names |= {p + n for n in ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight", "mlp.gate.weight",
                                  "mlp.proj.weight", "input_layernorm.weight", "post_layernorm.weight")}
        if qk_norm:
            names |= {p + "attention.q_layernorm.weight", p + "attention.k_layernorm.weight"}
    return names


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_names_config_and_round_trip(tiny_models, tmp_path, family):
    m = tiny_models[family]
    hf = {}
    for f in m.dirs["target"].glob("*.safetensors"):
        hf.update(load_file(str(f)))
    trtllm.write_checkpoint(tmp_path / "ckpt", m.cfg, hf)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "rank0.safetensors"]
    written = load_file(str(tmp_path / "ckpt" / "rank0.safetensors"))
    assert set(written) == _expected_names(m.cfg.num_layers, m.cfg.qk_norm)
    l0 = "model.layers.0."
    assert torch.equal(written["transformer.layers.0.attention.qkv.weight"],
                       torch.cat([hf[l0 + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(written["transformer.layers.0.mlp.fc.weight"], hf[l0 + "mlp.gate_proj.weight"])
    assert torch.equal(written["transformer.layers.0.mlp.gate.weight"], hf[l0 + "mlp.up_proj.weight"])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architecture"] == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["dtype"] == "float32"
    assert (config["num_key_value_heads"], config["head_size"], config["norm_epsilon"], config["rotary_base"]) == (
        m.cfg.num_kv_heads, m.cfg.head_dim, m.cfg.rms_norm_eps, m.cfg.rope_theta)
    assert config["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    cfg, state = trtllm.read_checkpoint(tmp_path / "ckpt")
    assert cfg == dataclasses.replace(m.cfg, bos_token_id=None, eos_token_id=None)  # the tokenizer's business
    expect = dict(hf)
    expect.setdefault("lm_head.weight", hf["model.embed_tokens.weight"])  # tied models: written out, as TRT-LLM does
    assert set(state) == set(expect) and all(torch.equal(state[k], expect[k]) for k in expect)
    model = trtllm.load_checkpoint_model(tmp_path / "ckpt", dtype=torch.float32, device="cpu")
    ids = torch.tensor([[5, 9, 200, 31, 7]])
    with torch.inference_mode():
        got = model(ids, model.new_cache(1, 8)).logits
        want = m.target(ids, m.target.new_cache(1, 8)).logits
    assert torch.equal(got, want)


def test_read_back_catches_a_wrong_checkpoint(tiny_models, tmp_path):
    """q and k swapped inside qkv (a wrong fusion order) fails the read-back token forcing, and a
    missing tensor is an error naming the file."""
    m = tiny_models["qwen3"]
    dirs = m.dirs
    out = tmp_path / "trtllm"
    info = trtllm.write_artifacts(out, dirs["target"], dirs["pard"], block_size=4)
    prompts = [[72, 101, 108, 108, 111], [100, 101, 102]]
    kw = dict(max_new_tokens=10, eos_token_id=m.cfg.eos_token_id, k=4,
              mask_token_id=info["speculative_config"]["mask_token_id"], dtype="float32")
    assert trtllm.check_checkpoint(out, m.target, prompts, **kw).passed
    path = out / "target" / "rank0.safetensors"
    tensors = load_file(str(path))
    q = m.cfg.num_heads * m.cfg.head_dim
    kv = m.cfg.num_kv_heads * m.cfg.head_dim
    for i in range(m.cfg.num_layers):
        name = f"transformer.layers.{i}.attention.qkv.weight"
        wq, wk, wv = tensors[name].split([q, kv, kv])
        tensors[name] = torch.cat([wq.roll(kv, 0), wk, wv]) if q != kv else torch.cat([wk, wq, wv])
    save_file(tensors, str(path))
    assert not trtllm.check_checkpoint(out, m.target, prompts, **kw).passed
    del tensors["transformer.ln_f.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="rank0.safetensors: tensor 'transformer.ln_f.weight' is missing"):
        trtllm.read_checkpoint(out / "target")


def test_spec_backend_field():
    ok = parse_spec(yaml.safe_load(tiny_spec("pard", extra="backend: trtllm\n")), "p.yaml")
    assert ok.backend == "trtllm" and ok.to_dict()["backend"] == "trtllm"
    assert parse_spec(yaml.safe_load(tiny_spec("pard")), "p.yaml").backend == "torch"
    with pytest.raises(SpecError, match="p.yaml: field 'backend': expected 'torch' for this drafter"):
        parse_spec(yaml.safe_load(tiny_spec("dflash", extra="backend: trtllm\n")), "p.yaml")
    with pytest.raises(SpecError, match="field 'backend': expected one of torch, trtllm"):
        parse_spec(yaml.safe_load(tiny_spec("pard", extra="backend: vllm\n")), "p.yaml")


def test_compile_writes_trtllm_artifacts(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(tiny_spec("pard", extra="backend: trtllm\n"))
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["compile", str(spec), "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    root = out / "trtllm"
    for part in ("target", "drafter"):
        assert (root / part / "config.json").is_file() and (root / part / "rank0.safetensors").is_file()
    options = yaml.safe_load((root / trtllm.OPTIONS).read_text())["speculative_config"]
    assert options == {"decoding_type": "PARD", "max_draft_len": 4, "speculative_model": "../drafter",
                       "mask_token_id": 257}
    assert "trtllm-build --checkpoint_dir target" in (root / "README.md").read_text()
    report = json.loads((out / "report.json").read_text())["trtllm"]
    assert report["read_back_token_forcing"].startswith("token forcing PASS: 48 tokens checked, 0 hard")
    assert json.loads((out / "engine.json").read_text())["files"]["trtllm/target/rank0.safetensors"]
