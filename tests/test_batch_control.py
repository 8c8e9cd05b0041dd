"""The verify budget's choice (runtime/batch_control.choose_verify_budget) against every split, the
step-cost table's interpolation, and speculation control's lengths."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.runtime.batch_control import (BatchPolicy, SpecControl, StepCost, choose_verify_budget,
                                             survival_from_confidence, survival_from_rate)

survivals = st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4).map(lambda xs: survival_from_confidence(xs)),
                     min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(survival=survivals, fixed=st.floats(0.1, 5.0), per_token=st.floats(0.0, 1.0), draft=st.floats(0.0, 2.0))
def test_the_budget_is_the_best_of_every_split(survival, fixed, per_token, draft):
    """No split of drafts over the requests (each a prefix) beats the chosen one in expected tokens per ms."""
    cost = lambda t: fixed + per_token * t  # noqa: E731
    choice = choose_verify_budget(survival, cost, draft_ms=draft)
    b = len(survival)

    def rate(split):
        tokens = sum(split)
        ms = cost(b + tokens) + (draft if tokens else 0.0)
        return (b + sum(sum(row[:k]) for row, k in zip(survival, split))) / ms

    best = max(rate(split) for split in itertools.product(*(range(len(row) + 1) for row in survival)))
    assert rate(choice.per_request) == pytest.approx(best, rel=1e-9)
    assert all(0 <= k <= len(row) for k, row in zip(choice.per_request, survival))
    assert choice.tokens_per_ms == pytest.approx(rate(choice.per_request), rel=1e-9)


def test_survival_splits_the_budget_toward_the_likelier_request():
    flat = lambda t: 1.0 + 0.01 * t  # noqa: E731  (weight-bound: drafts nearly free)
    steep = lambda t: 0.1 * t  # noqa: E731  (compute-bound: each token costs its share)
    sure, doubtful = survival_from_rate(0.95, 6), survival_from_rate(0.3, 6)
    assert choose_verify_budget([sure, doubtful], flat).per_request == (6, 2)  # 0.3^3 = 0.027 < 0.01 ms x 6 tok/ms
    assert choose_verify_budget([sure, sure], lambda t: 1.0 + 0.001 * t).per_request == (6, 6)
    assert choose_verify_budget([doubtful, doubtful], steep).per_request == (0, 0)  # AR pays better


def test_step_cost_interpolates_and_extrapolates_linearly():
    cost = StepCost.from_table({8: 2.0, 16: 3.0, 32: 7.0}, {1: 0.5, 8: 1.0})
    assert cost.verify(12) == pytest.approx(2.5) and cost.verify(64) == pytest.approx(15.0)
    assert cost.verify(4) == pytest.approx(1.5) and cost.draft(0) == 0.0 and cost.draft(4) == pytest.approx(0.5 + 3 / 14)
    with pytest.raises(ValueError, match="increasing tokens"):
        StepCost(((8, 1.0), (8, 2.0)))


def test_spec_control_follows_each_requests_rate():
    cost = StepCost.from_table({1: 1.0, 64: 1.5}, {1: 0.1, 8: 0.2})
    control = SpecControl(BatchPolicy(max_drafts=8, spec_control=True, cost=cost, warmup_steps=1, probe_every=3,
                                      off_below=0.2))
    assert control.lengths(["a", "b"]) == {"a": 8, "b": 8}  # warm-up: full blocks
    for _ in range(4):
        control.rate("a").observe(8, 8, 0.5)  # accepts every draft
        control.rate("b").observe(8, 0, 0.5)  # accepts none
    lengths = [control.lengths(["a", "b"]) for _ in range(4)]
    assert all(l["a"] == 8 for l in lengths)
    assert [l["b"] for l in lengths][:3] == [0, 0, 0] and lengths[3]["b"] > 0  # off, then a probe
    with pytest.raises(ValueError, match="cost"):
        BatchPolicy(max_drafts=4, verify_budget=True)
