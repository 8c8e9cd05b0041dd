"""The shapes the benchmarks run: released models' configs (specpilot.hf.known) and the linears of
their decoder layers, so that no script types Llama-3.1-8B's numbers again; and one tiny config for
the scripts' CPU smoke runs."""

from __future__ import annotations

from typing import Any

from specpilot.hf.known import TEST_MODELS, dflash_config, model_config, pard_config

LLAMA_8B = "llama-3.1-8b"
QWEN3_8B = "qwen3-8b"
TINY = "tiny"  # a two-layer qwen3 for --smoke runs on the CPU: no released model's, measures nothing

_TINY = {k: v for k, v in TEST_MODELS["tiny"].items() if not k.endswith("_token_id")}


def config(name: str) -> dict[str, Any]:
    """A config.json dict by name: a released model's (`model_config`), or TINY."""
    return dict(_TINY) if name == TINY else model_config(name)


def layer_linears(name: str = LLAMA_8B) -> dict[str, tuple[int, int]]:
    """The weight shapes [N, K] (y = x · Wᵀ) a decoder layer and the head run, by name: q|k|v and
    gate|up concatenated as the fused stacks run them."""
    c = config(name)
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * c["intermediate_size"], h),
            "down": (h, c["intermediate_size"]), "lm_head": (c["vocab_size"], h)}


__all__ = ["LLAMA_8B", "QWEN3_8B", "TINY", "config", "dflash_config", "layer_linears", "model_config", "pard_config"]
