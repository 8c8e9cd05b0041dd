"""Tiny random target + drafters, written as real HF model directories (for tests and demos).

The target and the PARD drafter are built with HF transformers' own LlamaForCausalLM /
Qwen3ForCausalLM, the DFlash drafter with its DFlash assistant model, and all are saved with
save_pretrained, so the loaders are exercised on genuine HF files. Weights are random: the drafters
propose mostly wrong tokens, which the decode-loop tests complement with planted oracle drafters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specpilot.runtime.tokenizer import build_byte_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>"]
EOS_TOKEN_ID = 256
MASK_TOKEN_ID = 257

DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": None,  # None: qwen3 tied (as small Qwen3 checkpoints are), llama untied
    # HF's default init (std 0.02) gives near-flat logits and constant greedy outputs; 0.3 gives
    # logit std ~2.4 and varied greedy continuations (checked in tests/test_runtime_model.py).
    "init_std": 0.3,
    "block_size": 8,  # DFlash block, anchor included
    "target_layer_ids": None,  # None: (0, last layer)
    "dflash_layers": 1,
    "pard_layers": 1,
    "pard_k": 8,
}


def build_tiny_models(out_dir: Path, family: str = "qwen3", seed: int = 0, **overrides: Any) -> dict[str, Path]:
    """Write out_dir/{target,dflash,pard}/ (config.json, model.safetensors, tokenizer.json).

    Deterministic in (family, seed, overrides); a directory already built with the same arguments
    is reused as is. Overrides: any key of DEFAULTS.
    """
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unknown tiny-model overrides {unknown}; expected some of {sorted(DEFAULTS)}")
    if family not in ("llama", "qwen3"):
        raise ValueError(f"family must be 'llama' or 'qwen3', got {family!r}")
    opts = {**DEFAULTS, **overrides}
    if opts["tie_word_embeddings"] is None:
        opts["tie_word_embeddings"] = family == "qwen3"
    if opts["target_layer_ids"] is None:
        opts["target_layer_ids"] = [0, opts["num_layers"] - 1]
    opts["target_layer_ids"] = list(opts["target_layer_ids"])

    out_dir = Path(out_dir)
    paths = {name: out_dir / name for name in ("target", "dflash", "pard")}
    stamp = {"family": family, "seed": seed, **opts}
    stamp_path = out_dir / "tiny.json"
    files = ("config.json", "model.safetensors", "tokenizer.json")
    if (
        stamp_path.is_file()
        and json.loads(stamp_path.read_text()) == stamp
        and all((p / f).is_file() for p in paths.values() for f in files)
    ):
        return paths

    tokenizer = build_byte_tokenizer(SPECIAL_TOKENS)
    vocab = tokenizer.get_vocab_size()
    with quiet_transformers():
        save_causal_lm(paths["target"], family, seed, vocab, opts, num_layers=opts["num_layers"])
        save_causal_lm(
            paths["pard"], family, seed + 1, vocab, opts, num_layers=opts["pard_layers"],
            extra={"pard_token": MASK_TOKEN_ID, "pard_k": opts["pard_k"]},
        )
        save_dflash(paths["dflash"], seed + 2, opts)
    for p in paths.values():
        tokenizer.save(str(p / "tokenizer.json"))
    stamp_path.write_text(json.dumps(stamp, indent=1))
    return paths


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No shard-writing progress bars in test logs; the previous setting is restored."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def common_hf_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields every tiny model shares, from the build options."""
    return dict(
        hidden_size=opts["hidden_size"],
        intermediate_size=opts["intermediate_size"],
        num_attention_heads=opts["num_heads"],
        num_key_value_heads=opts["num_kv_heads"],
        head_dim=opts["head_dim"],
        max_position_embeddings=opts["max_position_embeddings"],
        initializer_range=opts["init_std"],
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    )


def save_causal_lm(
    path: Path, family: str, seed: int, vocab: int, opts: dict[str, Any], *, num_layers: int, extra: dict | None = None
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    config = config_cls(
        vocab_size=vocab,
        num_hidden_layers=num_layers,
        tie_word_embeddings=opts["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": opts["rope_theta"]},
        **common_hf_fields(opts),
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(path)
    if extra:
        _update_config(path, extra)


def save_dflash(path: Path, seed: int, opts: dict[str, Any]) -> None:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(
        num_hidden_layers=opts["dflash_layers"],
        layer_types=["full_attention"] * opts["dflash_layers"],
        rope_parameters={"rope_type": "default", "rope_theta": opts["rope_theta"]},
        block_size=opts["block_size"],
        mask_token_id=MASK_TOKEN_ID,
        target_layer_ids=opts["target_layer_ids"],
        **common_hf_fields(opts),
    )
    torch.manual_seed(seed)
    MuseGlimmerAssistantModel(config).save_pretrained(path)


def _update_config(path: Path, extra: dict[str, Any]) -> None:
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(extra)
    cfg_path.write_text(json.dumps(cfg, indent=2))
