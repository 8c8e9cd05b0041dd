"""The shipped examples and the zoo pair: specs load, the pair loads, and decoding is lossless."""

from pathlib import Path

import pytest
import torch

from specpilot.compiler import lower_spec, resolve_models
from specpilot.runtime import decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.spec import load_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_specs_lower(path):
    spec = load_spec(path)
    program = lower_spec(spec, resolve_models(spec), "float32")
    drafts = spec.drafter.shape if spec.drafter.kind == "replay" else spec.drafter.kind  # a replay runs its shape
    assert program.step.one("draft")[1]["kind"] == drafts


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_zoo_pair_is_lossless_and_accepts_drafts(kind):
    target, cfg = load_target(resolve_builtin("code-qwen3"), dtype=torch.float32, device="cpu")
    drafter = load_drafter(resolve_builtin(f"code-qwen3/{kind}"), target, cfg, dtype=torch.float32, device="cpu")
    prompt = load_tokenizer(resolve_builtin("code-qwen3")).encode("def fibonacci(n):\n    if n < 2:\n").ids
    ar = decode.generate_ar(target, prompt, max_new_tokens=24, eos_token_id=cfg.eos_token_id)
    if kind == "dflash":
        sp = decode.generate_dflash(target, drafter, prompt, block_size=16, mask_token_id=drafter.mask_token_id,
                                    max_new_tokens=24, eos_token_id=cfg.eos_token_id)
    else:
        sp = decode.generate_pard(target, drafter, prompt, k=8, mask_token_id=drafter.mask_token_id,
                                  max_new_tokens=24, eos_token_id=cfg.eos_token_id)
    assert sp.tokens == ar.tokens
    assert sum(sp.accepted) > 0  # a trained drafter gets drafts accepted (a random one almost never does)
