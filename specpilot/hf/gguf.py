"""Reading a llama-architecture GGUF file (llama.cpp's format) as an HF model directory.

`gguf_to_hf_dir(gguf_path, out_dir)` writes config.json, model.safetensors (float32: every tensor
dequantized to exactly the values the file encodes, by the gguf package's own dequantizers),
tokenizer.json (the file's embedded BPE vocabulary and merges as a `tokenizers` Tokenizer),
tokenizer_config.json (its chat template and special tokens) and generation_config.json. Everything
else in specpilot then reads that directory like any other (`hf.checkpoint`, `runtime.load`).

llama.cpp's converter stores q_proj and k_proj rows permuted for its RoPE layout (pairs of
adjacent dimensions instead of two halves); `unpermute_qk` undoes it, as transformers' own GGUF
loader does. Every failure (no gguf package, an unreadable file, an architecture or tensor this
reader does not know) is a CheckpointError naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError

GGUF_PIN = "gguf==0.19.0"
# GGUF tensor name -> HF name ({i}: the layer)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF token types (llama.cpp's llama_token_type): CONTROL tokens are the special ones
TOKEN_CONTROL = 3
# llama.cpp's pre-tokenizers this reader reproduces: GPT-2's regex, "smollm" with digits split one by one
PRE_TOKENIZERS = {"smollm": True, "gpt2": False, "default": False}


def _reader(path: Path):
    try:
        import gguf
    except ModuleNotFoundError:
        raise CheckpointError(f"{path}: reading a GGUF file needs the gguf package: pip install {GGUF_PIN}") from None
    try:
        return gguf, gguf.GGUFReader(str(path))
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def _field(reader, path: Path, key: str, default: Any = ...) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise CheckpointError(f"{path}: missing GGUF field '{key}'")
        return default
    return f.contents()


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its converter's `permute`): within each head, rows
    (2j, 2j+1) go back to (j, j + head_dim/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_config(reader, path: Path) -> dict[str, Any]:
    """The HF config.json dict of a llama-architecture GGUF file."""
    arch = _field(reader, path, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF field 'general.architecture' is {arch!r}; expected 'llama'")
    p = "llama."
    hidden = int(_field(reader, path, p + "embedding_length"))
    heads = int(_field(reader, path, p + "attention.head_count"))
    head_dim = int(_field(reader, path, p + "rope.dimension_count", hidden // heads))
    vocab = int(_field(reader, path, p + "vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    tied = "output.weight" not in {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, path, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, path, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, path, p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, path, p + "rope.freq_base", 10000.0))},
        "rms_norm_eps": float(_field(reader, path, p + "attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": tied,
        "max_position_embeddings": int(_field(reader, path, p + "context_length")),
        "bos_token_id": _field(reader, path, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, path, "tokenizer.ggml.eos_token_id", None),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_name(name: str, path: Path) -> str:
    m = LAYER.match(name)
    key = f"blk.{{i}}.{m.group(2)}" if m else name
    if key not in TENSOR_NAMES:
        raise CheckpointError(f"{path}: GGUF tensor {name!r} is not one a llama model has (expected {', '.join(TENSOR_NAMES)})")
    return TENSOR_NAMES[key].format(i=m.group(1) if m else "")


def read_tensors(reader, gguf, path: Path, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """HF name -> float32 tensor, dequantized by the gguf package (the values the file encodes)."""
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name, path)
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{path}: GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                                  f"package cannot dequantize") from None
        w = torch.from_numpy(np.array(values, dtype=np.float32))  # a copy: the reader maps the file read-only
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        out[name] = w.contiguous()
    return out


def build_tokenizer(reader, path: Path):
    """The file's BPE tokenizer (tokenizer.ggml.model 'gpt2': byte-level BPE) as a `tokenizers` Tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, path, "tokenizer.ggml.model")
    pre = _field(reader, path, "tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: GGUF tokenizer {kind!r} with pre-tokenizer {pre!r}; expected 'gpt2' with one "
                              f"of {', '.join(PRE_TOKENIZERS)}")
    tokens = _field(reader, path, "tokenizer.ggml.tokens")
    types = _field(reader, path, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, path, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok, special


def gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF model as an HF model directory at out_dir (atomically: a temporary sibling,
    renamed when complete). Returns out_dir."""
    from safetensors.torch import save_file

    path, out = Path(gguf_path), Path(out_dir)
    gguf, reader = _reader(path)
    cfg = read_config(reader, path)
    tensors = read_tensors(reader, gguf, path, cfg)
    tok, special = build_tokenizer(reader, path)
    tokens = _field(reader, path, "tokenizer.ggml.tokens")

    def token(key: str):
        i = _field(reader, path, key, None)
        return tokens[i] if i is not None else None

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        tok.save(str(tmp / "tokenizer.json"))
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token("tokenizer.ggml.bos_token_id"),
            "eos_token": token("tokenizer.ggml.eos_token_id"),
            "unk_token": token("tokenizer.ggml.unknown_token_id"),
            "pad_token": token("tokenizer.ggml.padding_token_id"),
            "additional_special_tokens": special,
            "add_bos_token": bool(_field(reader, path, "tokenizer.ggml.add_bos_token", False)),
            "chat_template": _field(reader, path, "tokenizer.chat_template", None),
            "model_max_length": cfg["max_position_embeddings"],
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
