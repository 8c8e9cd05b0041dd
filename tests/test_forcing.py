"""Token forcing: it passes AR greedy output, and catches a planted wrong token where it sits."""

import pytest
import torch

from specpilot.runtime import decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_target
from specpilot.validate.forcing import check_prompt, force_tokens, tolerance


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import os

    os.environ["SPECPILOT_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return load_target(resolve_builtin("tiny-llama"), dtype=torch.float32, device="cpu")
    finally:
        del os.environ["SPECPILOT_CACHE"]


PROMPTS = [list(range(40, 60)), [10, 20, 30, 40, 50]]


def test_ar_output_passes(target):
    model, cfg = target
    outputs = [decode.generate_ar(model, p, max_new_tokens=20, eos_token_id=None).tokens for p in PROMPTS]
    report = force_tokens(model, cfg, PROMPTS, outputs, "float32")
    assert report.passed and report.tokens_checked == 40 and report.near_ties == 0
    assert all(p.first_divergence is None for p in report.prompts)


@pytest.mark.parametrize("position", [0, 7, 19])
def test_planted_wrong_token_is_a_hard_failure(target, position):
    model, cfg = target
    out = decode.generate_ar(model, PROMPTS[0], max_new_tokens=20, eos_token_id=None).tokens
    planted = list(out)
    planted[position] = (out[position] + 1) % cfg.vocab_size
    check = check_prompt(model, cfg, PROMPTS[0], planted, "float32")
    assert check.first_divergence == position
    assert [m.position for m in check.hard_failures][:1] == [position]
    m = check.hard_failures[0]
    assert m.candidate == planted[position] and m.reference == out[position] and m.margin > m.tolerance


def test_a_tie_within_tolerance_is_a_near_tie(target, monkeypatch):
    model, cfg = target
    out = decode.generate_ar(model, PROMPTS[1], max_new_tokens=8, eos_token_id=None).tokens
    planted = list(out)
    planted[3] = (out[3] + 1) % cfg.vocab_size
    # a tolerance wide enough to cover the margin turns the same mismatch into a near-tie
    monkeypatch.setitem(__import__("specpilot.validate.forcing", fromlist=["x"]).RELATIVE_TOLERANCE, "float32", 1e9)
    check = check_prompt(model, cfg, PROMPTS[1], planted, "float32")
    # tokens after the planted one are judged on the planted prefix, so they may differ too
    assert not check.hard_failures and check.near_ties[0].position == 3 and check.first_divergence == 3


def test_tolerance_scales_with_the_logit():
    assert tolerance("bfloat16", 0.5) == pytest.approx(3e-2)
    assert tolerance("bfloat16", -20.0) == pytest.approx(0.6)
    assert tolerance("float32", 10.0) < tolerance("bfloat16", 10.0)
