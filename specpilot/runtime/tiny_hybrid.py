"""A tiny random Qwen3-Next hybrid target with DFlash and PARD drafters, as real HF model directories.

The target is HF transformers' own Qwen3NextForCausalLM (dense MLPs; linear-attention and gated
full-attention layers alternating), saved with save_pretrained; the drafters are tiny.py's (a DFlash
assistant sharing the target's embedding and head, a Qwen3 PARD drafter). Weights are random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specpilot.runtime.tiny import (
    DEFAULTS,
    EOS_TOKEN_ID,
    MASK_TOKEN_ID,
    SPECIAL_TOKENS,
    common_hf_fields,
    quiet_transformers,
    save_causal_lm,
    save_dflash,
)
from specpilot.runtime.tokenizer import build_byte_tokenizer

__all__ = ["HYBRID_DEFAULTS", "EOS_TOKEN_ID", "MASK_TOKEN_ID", "build_tiny_hybrid", "tiny_hybrid_config"]

HYBRID_DEFAULTS: dict[str, Any] = {
    **DEFAULTS,
    "num_layers": 4,
    "full_attention_interval": 2,  # layers 1 and 3 are full attention
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False,
    # Norm weights are zero-centred (y = x̂ · (1 + w)); random ones make a (1 + w) / w mix-up visible.
    "norm_std": 0.2,
    # 0: dense MLPs; > 0: every layer a sparse MoE block (tests of the MoE path)
    "num_experts": 0,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40,
}


def tiny_hybrid_config(vocab: int, **overrides: Any):
    """The HF Qwen3NextConfig of the tiny target (dense unless num_experts > 0)."""
    from transformers import Qwen3NextConfig

    opts = {**HYBRID_DEFAULTS, **overrides}
    return Qwen3NextConfig(
        vocab_size=vocab,
        num_hidden_layers=opts["num_layers"],
        full_attention_interval=opts["full_attention_interval"],
        tie_word_embeddings=opts["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": opts["rope_theta"],
                         "partial_rotary_factor": opts["partial_rotary_factor"]},
        linear_num_key_heads=opts["linear_num_key_heads"],
        linear_num_value_heads=opts["linear_num_value_heads"],
        linear_key_head_dim=opts["linear_key_head_dim"],
        linear_value_head_dim=opts["linear_value_head_dim"],
        linear_conv_kernel_dim=opts["linear_conv_kernel_dim"],
        num_experts=opts["num_experts"],
        num_experts_per_tok=opts["num_experts_per_tok"],
        moe_intermediate_size=opts["moe_intermediate_size"],
        shared_expert_intermediate_size=opts["shared_expert_intermediate_size"],
        decoder_sparse_step=1,
        **common_hf_fields(opts),
    )


def random_hybrid(config, seed: int, norm_std: float):
    """Qwen3NextForCausalLM(config) in float32 with HF's init, plus N(0, norm_std) on every norm weight."""
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * norm_std)
    return model


def build_tiny_hybrid(out_dir: Path, seed: int = 0, **overrides: Any) -> dict[str, Path]:
    """Write out_dir/{target,dflash,pard}/ (config.json, model.safetensors, tokenizer.json)."""
    unknown = sorted(set(overrides) - set(HYBRID_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown tiny-hybrid overrides {unknown}; expected some of {sorted(HYBRID_DEFAULTS)}")
    opts = {**HYBRID_DEFAULTS, **overrides}
    if opts["target_layer_ids"] is None:
        opts["target_layer_ids"] = [0, opts["num_layers"] - 1]
    out_dir = Path(out_dir)
    paths = {name: out_dir / name for name in ("target", "dflash", "pard")}
    tokenizer = build_byte_tokenizer(SPECIAL_TOKENS)
    vocab = tokenizer.get_vocab_size()
    with quiet_transformers():
        config = tiny_hybrid_config(vocab, **{k: v for k, v in opts.items() if k in HYBRID_DEFAULTS})
        random_hybrid(config, seed, opts["norm_std"]).save_pretrained(paths["target"])
        save_causal_lm(
            paths["pard"], "qwen3", seed + 1, vocab, {**opts, "tie_word_embeddings": True},
            num_layers=opts["pard_layers"], extra={"pard_token": MASK_TOKEN_ID, "pard_k": opts["pard_k"]},
        )
        save_dflash(paths["dflash"], seed + 2, opts)
    for p in paths.values():
        tokenizer.save(str(p / "tokenizer.json"))
    return paths
