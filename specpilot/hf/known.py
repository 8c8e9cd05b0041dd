"""Released models' configs, as HF config.json dicts: the shapes that benchmarks, tests and the cost
model price without the weights (which never reach our machines).

Values are the published config.json files' (Meta's Llama 3.1 / 3.2, Qwen3). RoPE scaling is left
out: it changes no shape and no cost. `TEST_MODELS` are shapes of no released model, for tests. A DFlash drafter is the published recipe's shape (5 layers
at the target's width, block 16, reading 5 target layers spread over the stack); a PARD drafter of
a Llama-3 target is Llama-3.2-1B with a mask token.
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001)
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)

MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}

# Shapes of no released model, for tests and CPU smoke runs: a two-layer qwen3 over a vocabulary the
# byte tokenizer's 258 ids fit in. Its PARD drafter is the same stack at one layer.
TEST_MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                 tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=None, eos_token_id=None),
}
SHAPES = (*MODELS, *TEST_MODELS)  # what a pipeline's `target: {shape: ...}` may name

DFLASH_LAYERS = 5
DFLASH_BLOCK = 16
PARD_K = 8


def model_config(name: str) -> dict[str, Any]:
    """A copy of a known model's config.json dict (a released model's, or a test shape's); a KeyError
    lists the names."""
    if name not in SHAPES:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SHAPES)}")
    return dict(MODELS.get(name) or TEST_MODELS[name])


def dflash_config(target: str, layers: int = DFLASH_LAYERS, block_size: int = DFLASH_BLOCK) -> dict[str, Any]:
    """A DFlash drafter for the known `target`: `layers` qwen3-like layers at its width, reading 5
    target layers from the second to the last (fewer where the stack has fewer), its last
    vocabulary id as the mask token."""
    t = model_config(target)
    n = t["num_hidden_layers"]
    return dict(t, model_type="qwen3", num_hidden_layers=layers, block_size=block_size,
                target_layer_ids=sorted({1 % n, n // 4, n // 2, 3 * n // 4, n - 1}), mask_token_id=t["vocab_size"] - 1)


def pard_config(target: str, k: int = PARD_K) -> dict[str, Any]:
    """A PARD drafter for the known `target`: the family's small model with a mask token (a test
    shape's: itself at one layer)."""
    if target in TEST_MODELS:
        small = dict(TEST_MODELS[target], num_hidden_layers=1)
    else:
        small = MODELS["llama-3.2-1b" if MODELS[target]["model_type"] == "llama" else "qwen3-1.7b"]
    return dict(small, pard_token=small["vocab_size"] - 1, pard_k=k)


def name_of(family: str, layers: int, hidden: int, intermediate: int, vocab: int) -> str | None:
    """The known model of these shapes, or None."""
    for name, c in MODELS.items():
        if (c["model_type"], c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"],
                c["vocab_size"]) == (family, layers, hidden, intermediate, vocab):
            return name
    return None
