"""Our runtime forward is the same model as HF transformers', and its pieces behave as documented."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from specpilot.errors import CheckpointError
from specpilot.hf.checkpoint import check_layer_count, read_config, read_header
from specpilot.runtime.cache import KVCache
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import RopeTables, Transformer, rope_cos_sin, rope_inv_freq
from specpilot.runtime.tiny import MASK_TOKEN_ID, build_tiny_models
from specpilot.runtime.tokenizer import build_byte_tokenizer, load_tokenizer

ATOL = 1e-4  # fp32 on CPU: ours and HF's differ only by kernel reduction order
pytestmark = pytest.mark.usefixtures("torch_single_thread")

FAMILIES = ("llama", "qwen3")


def _hf_target(path: Path, family: str) -> nn.Module:
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[family]
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- HF parity -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_matches_hf(family, tiny_models):
    m = tiny_models[family]
    hf = _hf_target(m.dirs["target"], family)
    ids = _ids(23, m.cfg.vocab_size)
    with torch.inference_mode():
        ref = hf(ids, output_hidden_states=True)
        out = m.target(ids, m.target.new_cache(1, 32), hidden_layers=(0, 1))
    torch.testing.assert_close(out.logits, ref.logits.float(), atol=ATOL, rtol=0)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (1, 23, m.cfg.vocab_size)
    # hidden_layers (0, 1) = outputs of decoder layers 0 and 1 = HF hidden_states[1] and [2]
    torch.testing.assert_close(out.hidden, torch.cat(ref.hidden_states[1:3], dim=-1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_decoding_matches_hf(family, tiny_models):
    """Prefill, then single tokens, then a multi-token chunk, all through the cache."""
    m = tiny_models[family]
    hf = _hf_target(m.dirs["target"], family)
    ids = _ids(30, m.cfg.vocab_size, seed=1)
    with torch.inference_mode():
        ref = hf(ids).logits.float()
        cache = m.target.new_cache(1, 40)
        parts = [m.target(ids[:, :11], cache).logits]
        for i in range(11, 14):
            parts.append(m.target(ids[:, i : i + 1], cache).logits)
        parts.append(m.target(ids[:, 14:30], cache).logits)
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, atol=ATOL, rtol=0)
    assert cache.length == 30


def test_llama3_rope_scaling_matches_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hc = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, rope_parameters=rope, initializer_range=0.3)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hc).eval()
    cfg = ModelConfig.from_hf(hc.to_dict(), "mem://config.json")
    assert cfg.rope_scaling is not None
    ours = Transformer(cfg)
    ours.load_state_dict(hf.state_dict())
    ids = _ids(100, 100)  # past original_max_position_embeddings
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids, ours.new_cache(1, 100)).logits, hf(ids).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_dflash_drafter_matches_hf(family, tiny_models):
    """Our DFlash drafter on the HF DFlash assistant's weights gives the HF assistant's block logits."""
    from transformers import MuseGlimmerAssistantModel

    m = tiny_models[family]
    hf = MuseGlimmerAssistantModel.from_pretrained(m.dirs["dflash"], dtype=torch.float32).eval()
    n_ctx, block = 13, m.dflash.block_size
    ctx = torch.randn(1, n_ctx, len(m.dflash.target_layer_ids) * m.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    block_ids = torch.tensor([[42] + [MASK_TOKEN_ID] * (block - 1)])
    with torch.inference_mode():
        ref = hf(noise_embeds=m.target.embed(block_ids), context_hidden_states=ctx,
                 position_ids=torch.arange(n_ctx + block)[None]).last_hidden_state
        ref_logits = m.target.head(ref[:, 1:])
        out = m.dflash(block_ids, ctx, m.dflash.new_cache(1, 64))
    assert out.shape == (1, block - 1, m.cfg.vocab_size)
    torch.testing.assert_close(out, ref_logits, atol=ATOL, rtol=0)


# --- masks, cache, linear seam -------------------------------------------------------------------


_LLAMA3_ROPE = ModelConfig.from_hf(
    {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 500000.0,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}}, "mem://config.json")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 400), b=st.integers(1, 3), t=st.integers(1, 17), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rope_table_rows_equal_the_computed_ones(rows, b, t, bf16, seed):
    """A gathered row is rope_cos_sin's value bit for bit (llama3-scaled frequencies, fp32 and
    bf16), in the [B, 1, T, D] views the rope kernels take; positions the table does not cover
    (or not vouched for) are computed."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    inv_freq = rope_inv_freq(_LLAMA3_ROPE, "cpu")
    tables = RopeTables(_LLAMA3_ROPE)
    tables.cover(rows, torch.device("cpu"), dtype)
    positions = torch.randint(0, rows, (b, t), generator=torch.Generator().manual_seed(seed))
    want = rope_cos_sin(inv_freq, positions, dtype)
    got = tables(positions, dtype, below=rows)
    for g, w in zip(got, want):
        assert g.shape == w.shape == (b, 1, t, 16) and g.stride(-1) == 1
        assert torch.equal(g, w)
    assert got[0].stride() == got[1].stride() and _one_buffer(*got)
    built = tables._tables[torch.device("cpu"), dtype].shape[0]
    assert rows <= built < 2 * rows  # the next power of two
    assert not _one_buffer(*tables(positions, dtype, below=built + 1))  # beyond the table: computed
    assert not _one_buffer(*tables(positions, dtype, below=None))  # not vouched for: computed
    assert tables(positions, torch.float16, below=rows)[0].dtype == torch.float16  # no fp16 table: computed


def _one_buffer(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether cos and sin view one gather (else rope_cos_sin made two tensors)."""
    return cos.untyped_storage().data_ptr() == sin.untyped_storage().data_ptr()


def test_forward_gathers_rope_for_its_slots(tiny_models, monkeypatch):
    """A default-position forward over a cache from new_cache reads the table and computes no
    RoPE, as do explicit positions vouched for (positions_in_cache: trees); a cache the model did
    not make, or explicit positions alone, compute it: the logits agree bit for bit."""
    import specpilot.runtime.model as model_module

    m = Transformer(tiny_models["llama"].target.cfg)  # its own tables
    m.load_state_dict(tiny_models["llama"].target.state_dict())
    ids = _ids(7, m.cfg.vocab_size, seed=4)
    computed = []
    monkeypatch.setattr(model_module, "rope_cos_sin",
                        lambda *args: computed.append(args[1].shape) or rope_cos_sin(*args))
    with torch.inference_mode():
        gathered = m(ids, m.new_cache(1, 16)).logits
        assert computed == [(1, 16)]  # new_cache's table, then nothing
        table = m._rope._tables[torch.device("cpu"), m.dtype]
        m.new_cache(1, 17)  # a longer table replaces it; the first stays alive (a graph may read it)
        assert m._rope._tables[torch.device("cpu"), m.dtype].shape[0] == 32 and any(t is table for t in m._rope._kept)
        computed.clear()
        other = m(ids, KVCache.for_model(m.cfg, 1, 64, m.dtype, "cpu")).logits  # beyond the table
        explicit = m(ids, m.new_cache(1, 16), positions=torch.arange(7)[None]).logits
        assert computed == [(1, 7), (1, 7)]
        vouched = m(ids, m.new_cache(1, 16), positions=torch.arange(7)[None], positions_in_cache=True).logits
    assert computed == [(1, 7), (1, 7)]  # a tree's positions, vouched for: gathered
    for logits in (other, explicit, vouched):
        torch.testing.assert_close(gathered, logits, atol=0, rtol=0)
    # tokens past the capacity: RoPE computed (no out-of-range gather), then the cache's own error
    full = m.new_cache(1, 16)
    with torch.inference_mode(), pytest.raises(ValueError, match="overflow|capacity"):
        m(_ids(17, m.cfg.vocab_size), full)


def test_tensor_mask_equals_causal(tiny_models):
    m = tiny_models["qwen3"]
    ids = _ids(9, m.cfg.vocab_size, seed=2)
    with torch.inference_mode():
        cache = m.target.new_cache(1, 32)
        m.target(ids[:, :5], cache)
        causal = m.target(ids[:, 5:], cache).logits
        cache.rollback(5)
        tree = m.target(ids[:, 5:], cache, mask=torch.ones(4, 4, dtype=torch.bool).tril()).logits
    torch.testing.assert_close(tree, causal, atol=0, rtol=0)


def test_kv_cache_rollback_semantics(tiny_models):
    m = tiny_models["llama"]
    cache = KVCache.for_model(m.cfg, batch=1, max_len=16, dtype=torch.float32, device="cpu")
    assert cache.length == 0 and cache.k[0].shape == (1, m.cfg.num_kv_heads, 16, m.cfg.head_dim)
    ids = _ids(12, m.cfg.vocab_size, seed=3)
    with torch.inference_mode():
        m.target(ids[:, :8], cache)
        k_before = cache.k[0][:, :, :5].clone()
        cache.rollback(5)
        assert cache.length == 5
        torch.testing.assert_close(cache.k[0][:, :, :5], k_before, atol=0, rtol=0)  # pointer move, kept slots intact
        with pytest.raises(ValueError):
            cache.rollback(6)
        # after a rollback, continuing with other tokens equals a fresh run over the new sequence
        other = torch.cat([ids[:, :5], ids[:, 8:12]], dim=1)
        resumed = m.target(ids[:, 8:12], cache).logits
        fresh = m.target(other, m.target.new_cache(1, 16)).logits[:, 5:]
        torch.testing.assert_close(resumed, fresh, atol=ATOL, rtol=0)
        with pytest.raises(ValueError):
            m.target(_ids(8, m.cfg.vocab_size), cache)  # 9 + 8 > 16 slots


def test_dflash_context_only_cache(tiny_models):
    d = tiny_models["qwen3"].dflash
    width = len(d.target_layer_ids) * tiny_models["qwen3"].cfg.hidden_size
    ctx = torch.randn(1, 10, width, generator=torch.Generator().manual_seed(1))
    block = torch.tensor([[7] + [MASK_TOKEN_ID] * (d.block_size - 1)])
    with torch.inference_mode():
        cache = d.new_cache(1, 32)
        first = d(block, ctx, cache)
        assert cache.length == 10  # context kept, block K/V not
        again = d(block, ctx[:, :0], cache)  # no new context: the block sees the same context
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        cache.rollback(0)
        torch.testing.assert_close(d(block, ctx, cache), first, atol=0, rtol=0)
        split = d.new_cache(1, 32)
        d.add_context(ctx[:, :4], split)
        torch.testing.assert_close(d(block, ctx[:, 4:], split), first, atol=ATOL, rtol=0)
        assert split.length == 10
    assert not any(n.startswith(("embed", "head", "lm_head")) for n in d.state_dict())


def test_linear_modules_and_set_linear(tiny_models):
    cfg = tiny_models["llama"].cfg
    model = Transformer(cfg)
    model.load_state_dict(tiny_models["llama"].target.state_dict())
    linears = model.linear_modules()
    assert len(linears) == 7 * cfg.num_layers + 1
    state = model.state_dict()
    for name, module in linears.items():
        assert state[name] is module.weight or torch.equal(state[name], module.weight)
    ids = _ids(6, cfg.vocab_size, seed=4)

    class Wrapped(nn.Module):  # any module with forward(x) will do (the 12-bit kernels)
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.inner(x)

    with torch.inference_mode():
        before = model(ids, model.new_cache(1, 8)).logits
        wrapped = Wrapped(linears["model.layers.1.mlp.down_proj.weight"])
        model.set_linear("model.layers.1.mlp.down_proj.weight", wrapped)
        torch.testing.assert_close(model(ids, model.new_cache(1, 8)).logits, before, atol=0, rtol=0)
        assert wrapped.calls == 1 and model.linear_modules()["model.layers.1.mlp.down_proj.weight"] is wrapped
        model.set_linear("lm_head.weight", Wrapped(linears["lm_head.weight"]))
        torch.testing.assert_close(model(ids, model.new_cache(1, 8)).logits, before, atol=0, rtol=0)
    with pytest.raises(KeyError):
        model.set_linear("model.norm.weight", wrapped)


# --- configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family, tiny_model_dirs):
    path = tiny_model_dirs[family]["target"] / "config.json"
    cfg = ModelConfig.from_hf(json.loads(path.read_text()), str(path))
    assert cfg.family == family and cfg.qk_norm == (family == "qwen3")
    assert ModelConfig.from_hf(cfg.to_hf(), "again") == cfg
    for kind in ("dflash", "pard"):
        dpath = tiny_model_dirs[family][kind] / "config.json"
        dcfg = DrafterConfig.from_hf(json.loads(dpath.read_text()), str(dpath))
        assert dcfg.kind == kind and dcfg.mask_token_id == MASK_TOKEN_ID
        assert DrafterConfig.from_hf(dcfg.to_hf(), "again") == dcfg
    assert dcfg.block_size == 8  # pard_k


def test_config_errors_name_file_and_field(tiny_model_dirs):
    path = tiny_model_dirs["llama"]["target"] / "config.json"
    raw = json.loads(path.read_text())
    with pytest.raises(CheckpointError, match=r"where/config\.json.*'num_hidden_layers'"):
        ModelConfig.from_hf({k: v for k, v in raw.items() if k != "num_hidden_layers"}, "where/config.json")
    with pytest.raises(CheckpointError, match=r"where/config\.json.*'model_type'.*'mistral'"):
        ModelConfig.from_hf({**raw, "model_type": "mistral"}, "where/config.json")
    with pytest.raises(CheckpointError, match=r"'hidden_size' is '64'"):
        ModelConfig.from_hf({**raw, "hidden_size": "64"}, "where/config.json")
    with pytest.raises(CheckpointError, match=r"not a drafter config: expected 'target_layer_ids'"):
        DrafterConfig.from_hf(raw, "where/config.json")


# --- loader errors ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_loader_errors(tiny_model_dirs, tiny_models, tmp_path):
    dirs, m = tiny_model_dirs["qwen3"], tiny_models["qwen3"]
    load = dict(dtype=torch.float32, device="cpu")

    missing_dir = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=str(missing_dir)):
        load_target(missing_dir, **load)
    with pytest.raises(CheckpointError, match="only local directories"):
        load_target("Qwen/Qwen3-8B", **load)

    no_config = _copy(dirs["target"], tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match=f"{no_config}/config.json: missing"):
        load_target(no_config, **load)

    no_weights = _copy(dirs["target"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=f"{no_weights}: no weights"):
        load_target(no_weights, **load)

    missing_tensor = _copy(dirs["target"], tmp_path / "missing_tensor")
    tensors = load_file(missing_tensor / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing_tensor / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{missing_tensor}: missing tensors model.layers.1.mlp.up_proj.weight"):
        load_target(missing_tensor, **load)

    extra_tensor = _copy(dirs["target"], tmp_path / "extra_tensor")
    tensors = load_file(extra_tensor / "model.safetensors")
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(tensors, extra_tensor / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensors model.layers.9.mlp.up_proj.weight"):
        load_target(extra_tensor, **load)

    wrong_shape = _copy(dirs["target"], tmp_path / "wrong_shape")
    _edit_config(wrong_shape, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.\d\.mlp\.\w+_proj\.weight' has shape"):
        load_target(wrong_shape, **load)

    pard_vocab = _copy(dirs["pard"], tmp_path / "pard_vocab")
    _edit_config(pard_vocab, vocab_size=300)
    with pytest.raises(CheckpointError, match=f"{pard_vocab}/config.json: field 'vocab_size' is 300"):
        load_drafter(pard_vocab, m.target, m.cfg, **load)

    dflash_vocab = _copy(dirs["dflash"], tmp_path / "dflash_vocab")
    _edit_config(dflash_vocab, vocab_size=300)
    with pytest.raises(CheckpointError, match=f"{dflash_vocab}/config.json: field 'vocab_size' is 300"):
        load_drafter(dflash_vocab, m.target, m.cfg, **load)

    dflash_layers = _copy(dirs["dflash"], tmp_path / "dflash_layers")
    _edit_config(dflash_layers, target_layer_ids=[0, 7])
    with pytest.raises(CheckpointError, match="'target_layer_ids' has \\[7\\]"):
        load_drafter(dflash_layers, m.target, m.cfg, **load)


def _header_file(tmp_path: Path, header: dict, data: bytes, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize("header, data, length, message", [
    ({}, b"", 10**6, "the header claims 1000000 bytes; the file holds 2 after the length"),
    ({}, b"", 2**64 - 1, "the header claims 18446744073709551615 bytes"),
    ([1, 2], b"", None, "the header is a JSON list, expected an object"),
    ({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "dtype 'F99'"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None, "shape [-2]"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, bytes(8), None,
     "data_offsets [0, 16]; expected [begin, end] within the 8 data bytes"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), None,
     "data_offsets [0, 8] hold 8 bytes; shape [3] of F32 needs 12"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
     bytes(8), None, "tensor 'b' starts at data byte 4; the tensors before it end at 8"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8), None,
     "the tensors cover 4 of the 8 data bytes"),
    ({"w": {"dtype": "F32", "shape": [10**12, 10**12], "data_offsets": [0, 8]}}, bytes(8), None, "needs 4000000000000000000000000"),
])
def test_a_safetensors_header_is_checked_against_its_file_before_anything_is_read(tmp_path, header, data, length, message):
    path = _header_file(tmp_path, header, data, length)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: not a valid safetensors file (") + ".*" + re.escape(message)):
        read_header(path)
    ok = _header_file(tmp_path, {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [2],
                                                                         "data_offsets": [0, 8]}}, bytes(8))
    assert read_header(ok)["w"]["shape"] == [2]
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointError, match="2 bytes: shorter than the 8-byte header length"):
        read_header(tmp_path / "short.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes((4).to_bytes(8, "little") + b"\xff{[x")
    with pytest.raises(CheckpointError, match="the header is not JSON text"):
        read_header(tmp_path / "garbage.safetensors")


def test_a_config_that_claims_what_its_weights_lack_fails_before_anything_is_built(tiny_model_dirs, tmp_path):
    dirs = tiny_model_dirs["qwen3"]
    raw, source = read_config(dirs["target"])
    check_layer_count(dirs["target"], raw, source)
    with pytest.raises(CheckpointError, match=r"config.json: field 'num_hidden_layers' is 10000000; the weights in "
                                              r".* hold layers 0\.\.2"):
        check_layer_count(dirs["target"], {**raw, "num_hidden_layers": 10**7}, source)
    for key, value, message in (("num_attention_heads", 0, "'num_attention_heads' is 0; expected an integer >= 1"),
                                ("rms_norm_eps", float("inf"), "'rms_norm_eps' is inf; expected a number > 0"),
                                ("rope_theta", -1.0, "'rope_theta' is -1.0; expected a number > 0"),
                                ("rope_parameters", 7, "a field holds a value of the wrong kind or size"),
                                ("hidden_size", [64], "'hidden_size' is [64]; expected int")):
        with pytest.raises(CheckpointError, match=re.escape(f"{source}: ") + ".*" + re.escape(message)):
            ModelConfig.from_hf({**raw, key: value}, source)


def test_sharded_checkpoint_loads(tiny_model_dirs, tiny_models, tmp_path):
    src = tiny_model_dirs["llama"]["target"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(src / "config.json", sharded / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, sharded / shard)
        weight_map.update({n: shard for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model, _ = load_target(sharded, dtype=torch.float32, device="cpu")
    ids = _ids(5, model.cfg.vocab_size)
    with torch.inference_mode():
        ref = tiny_models["llama"].target(ids, tiny_models["llama"].target.new_cache(1, 5)).logits
        torch.testing.assert_close(model(ids, model.new_cache(1, 5)).logits, ref, atol=0, rtol=0)


def test_load_in_bfloat16(tiny_model_dirs):
    model, _ = load_target(tiny_model_dirs["qwen3"]["target"], dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu"
    with torch.inference_mode():
        out = model(_ids(4, model.cfg.vocab_size), model.new_cache(1, 4), hidden_layers=(1,))
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.bfloat16


# --- tokenizer and tiny models -------------------------------------------------------------------


def test_byte_tokenizer(tiny_model_dirs, tmp_path):
    tok = build_byte_tokenizer(["<|endoftext|>", "<|mask|>"])
    assert tok.get_vocab_size() == 258 and tok.token_to_id("<|mask|>") == MASK_TOKEN_ID
    text = "héllo, wörld <|endoftext|>"
    ids = tok.encode(text).ids
    assert ids[:2] == [ord("h"), 0xC3] and ids[-1] == 256
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.to_str() == build_byte_tokenizer(["<|endoftext|>", "<|mask|>"]).to_str()  # deterministic
    assert load_tokenizer(tiny_model_dirs["llama"]["target"]).to_str() == tok.to_str()
    with pytest.raises(CheckpointError, match=f"{tmp_path}/tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tiny_models_idempotent_and_not_degenerate(tiny_model_dirs, tiny_models, tmp_path):
    dirs = tiny_model_dirs["qwen3"]
    before = {p: p.stat().st_mtime_ns for p in dirs["target"].iterdir()}
    assert build_tiny_models(dirs["target"].parent, family="qwen3") == dirs
    assert {p: p.stat().st_mtime_ns for p in dirs["target"].iterdir()} == before
    other = build_tiny_models(tmp_path / "again", family="qwen3")
    assert load_file(other["target"] / "model.safetensors").keys() == load_file(dirs["target"] / "model.safetensors").keys()
    for name, tensor in load_file(other["dflash"] / "model.safetensors").items():
        torch.testing.assert_close(tensor, load_file(dirs["dflash"] / "model.safetensors")[name], atol=0, rtol=0)
    for family, m in tiny_models.items():
        for prompt in (b"Hello world", b"specpilot"):
            tokens = generate_ar(m.target, list(prompt), max_new_tokens=40, eos_token_id=None).tokens
            assert len(set(tokens)) >= 8, (family, tokens)
