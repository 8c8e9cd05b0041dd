"""The strict referee for bf16 engines (specpilot/validate/referee.py): fp32 reference, near-ties
bounded by the measured bf16 noise, no more near-ties than the stock bf16 AR loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specpilot.runtime.decode import generate_ar
from specpilot.runtime.load import load_target
from specpilot.validate.forcing import check_prompt
from specpilot.validate.referee import judge, margin_errors, measure_noise, strict_referee


class Scripted(nn.Module):
    """A 'model' whose logits at each position are given: teacher forcing reads row i for token i+1."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.rows = nn.Parameter(rows, requires_grad=False)

    def new_cache(self, batch, length):
        return None

    def forward(self, seq, cache):
        n = seq.shape[1]
        return SimpleNamespace(logits=self.rows[:n][None])


def test_margin_errors_compare_the_fp32_top_two():
    l32 = torch.tensor([[5.0, 4.0, 0.0], [1.0, 3.0, 2.9]])
    l16 = torch.tensor([[5.0, 4.5, 0.0], [1.0, 3.0, 2.9]])
    assert margin_errors(l32, l16).tolist() == pytest.approx([0.5, 0.0])


def test_near_tie_only_within_the_measured_noise():
    # prompt [0], output [a, b]: row 0 predicts a, row 1 predicts b
    rows = torch.tensor([[20.0, 19.7, 0.0], [20.0, 19.99, 0.0], [0.0, 0.0, 0.0]])
    ref = Scripted(rows)
    # token 1 at position 0: fp32 margin 0.3, inside the old bf16 band (3e-2 x 20 = 0.6), outside a noise of 0.05
    old = check_prompt(ref, None, [0], [1, 0], "bfloat16")
    assert len(old.near_ties) == 1 and not old.hard_failures
    strict = judge(ref, [[0]], [[1, 0]], noise=0.05)
    assert strict.hard_failures == 1 and strict.near_ties == 0
    # token 1 at position 1: margin 0.01, within the noise: a near-tie
    strict = judge(ref, [[0]], [[0, 1]], noise=0.05)
    assert strict.hard_failures == 0 and strict.near_ties == 1


def test_more_near_ties_than_the_stock_loop_is_rejected():
    rows = torch.tensor([[20.0, 19.99, 0.0], [20.0, 19.99, 0.0], [0.0, 0.0, 0.0]])
    ref = Scripted(rows)
    verdict = strict_referee(ref, ref, [[0]], [[1, 1]], [[0, 0]])  # identical references: no noise, no near-tie
    assert verdict.noise.value == 0 and verdict.engine.hard_failures == 2 and not verdict.passed
    ref16 = Scripted(rows + torch.tensor([[0.0, 0.02, 0.0]] * 3))  # bf16 moved the margin by 0.02
    verdict = strict_referee(ref, ref16, [[0]], [[1, 1]], [[0, 0]])
    assert verdict.noise.value == pytest.approx(0.02, abs=1e-5)
    assert verdict.engine.near_ties == 2 and verdict.stock.near_ties == 0
    assert not verdict.passed and "near-ties" in verdict.reason
    assert strict_referee(ref, ref16, [[0]], [[0, 1]], [[0, 1]]).passed  # as many as the stock loop: passes


def test_stock_bf16_loop_passes_against_fp32_on_a_tiny_model(tiny_model_dirs):
    d = tiny_model_dirs["qwen3"]["target"]
    ref32, _ = load_target(d, dtype=torch.float32, device="cpu")
    ref16, _ = load_target(d, dtype=torch.bfloat16, device="cpu")
    prompts = [[1, 5, 9, 200], [7, 7, 3]]
    ar = [generate_ar(ref16, p, max_new_tokens=12, eos_token_id=None).tokens for p in prompts]
    noise = measure_noise(ref32, ref16, prompts, ar)
    assert noise.positions == 24 and 0 < noise.value < 1.0
    verdict = strict_referee(ref32, ref16, prompts, ar, ar)
    assert verdict.passed and verdict.engine.near_ties == verdict.stock.near_ties
    # every token the stock loop wrote is the fp32 argmax or within the measured noise of it
    assert verdict.stock.hard_failures == 0
