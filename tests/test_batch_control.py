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


# The H100 run at c1 (bench/results/batched_h100_graphs.json): a flat verify table (11.1 ms at one row,
# 11.6 ms at 16) and DFlash's HumanEval profile, yet 6 verify rows a step and a third of the steps AR.
FLAT = StepCost.from_table({1: 11.09, 2: 11.2, 4: 11.18, 8: 11.22, 16: 11.64}, {1: 2.0})


def profile_draws(n: int) -> list[int]:
    from specpilot.profiles import load_profile

    return load_profile("dflash-qwen3-8b").distribution("humaneval", drafts=15).draws(n, 0)


def test_running_rate_is_the_chains_acceptance_not_the_mean_of_step_ratios():
    draws = profile_draws(2000)
    mle = sum(draws) / (sum(draws) + sum(n < 15 for n in draws))
    control = SpecControl(BatchPolicy(max_drafts=15, spec_control=True, cost=FLAT))
    seen = []
    for n in draws:
        control.rate("a").observe(15, n, control.policy.ema)
        seen.append(control.rate("a").alpha)
    assert abs(sum(seen[10:]) / len(seen[10:]) - mle) < 0.03  # per-step ratios average 0.68 against 0.86


def test_flat_table_verifies_full_blocks_at_c1_under_high_acceptance():
    """Each step: spec control's length, then verify-budget's choice over the request's rate
    survival (a replay engine's), then the profile's accept length observed for the drafts verified."""
    policy = BatchPolicy(max_drafts=15, verify_budget=True, spec_control=True, cost=FLAT, survival="acceptance")
    control = SpecControl(policy)
    chosen = []
    for n in profile_draws(300):
        k = control.lengths(["a"])["a"]
        per = choose_verify_budget([survival_from_rate(control.rate("a").alpha, k)], FLAT.verify).per_request[0] if k else 0
        chosen.append(per)
        control.rate("a").observe(per, min(n, per), policy.ema)
    assert chosen.count(0) == 0  # speculation stays on: its tokens per ms beat AR's throughout
    assert sum(chosen) / len(chosen) > 13.5 and sorted(chosen)[len(chosen) // 2] == 15


def test_batch_turned_ar_probes_again():
    cost = StepCost.from_table({1: 1.0, 64: 1.1}, {1: 2.0})  # drafting dear: AR pays at a low rate
    control = SpecControl(BatchPolicy(max_drafts=8, spec_control=True, cost=cost, warmup_steps=0, probe_every=4,
                                      off_below=0.01))
    for _ in range(3):
        control.rate("a").observe(8, 0, 0.5)
    lengths = [control.lengths(["a"])["a"] for _ in range(5)]
    assert lengths[:4] == [0, 0, 0, 0] and lengths[4] > 0  # AR, then a probe: the rate can change only by verifying
    before = control.rate("a").alpha
    control.rate("a").observe(lengths[4], lengths[4], 0.5)  # the probe accepted everything
    assert control.rate("a").alpha > before


@settings(max_examples=60, deadline=None)
@given(survival=survivals, fixed=st.integers(0, 40), points=st.lists(st.tuples(st.integers(1, 64), st.floats(0.1, 50.0)),
                                                                      min_size=1, max_size=5, unique_by=lambda p: p[0]),
       draft=st.floats(0.0, 2.0))
def test_priced_span_chooses_as_the_per_total_calls(survival, fixed, points, draft):
    cost = StepCost.from_table(dict(points))
    past = cost.verify_past(fixed)
    assert past.span(1, 70) == [cost.verify(n + fixed) for n in range(1, 71)]
    assert choose_verify_budget(survival, past, draft_ms=draft) == \
        choose_verify_budget(survival, lambda n: cost.verify(n + fixed), draft_ms=draft)
