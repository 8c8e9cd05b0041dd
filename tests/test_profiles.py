"""Acceptance profiles: every number cites its source, the per-position fit reproduces the published
τ, the cost model prices a profile as the replay draws it, and the draws follow the profile."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.cost import AcceptanceModel
from specpilot.profiles import STATUSES, AcceptDistribution, ProfileError, load_profile, profile_names

USABLE = [n for n in profile_names() if load_profile(n).usable]


@pytest.mark.parametrize("name", profile_names())
def test_every_profile_names_its_paper_table_and_how_it_was_read(name):
    p = load_profile(name)
    assert p.status in STATUSES
    assert re.fullmatch(r"\d{4}\.\d{4,5}", p.source.arxiv)
    assert p.source.paper and p.source.table and p.source.read and p.model
    if p.base is None:  # a chain profile: τ within what its block allows, or empty only when missing
        for bench, tau in p.taus.items():
            assert (tau is None) == (p.status == "missing"), bench
            assert tau is None or 1.0 <= tau <= p.drafts + 1


def test_the_profiles_the_issue_names_are_there():
    dflash = load_profile("dflash-qwen3-8b")
    assert {"humaneval", "math-500", "gsm8k", "mt-bench"} <= set(dflash.benchmarks)
    assert dflash.source.arxiv == "2602.06036" and dflash.block_size == 16 and dflash.target == "qwen3-8b"
    tree = load_profile("ddtree-qwen3-8b")
    assert tree.kind == "tree" and tree.source.arxiv == "2604.12989" and tree.status == "modeled"
    assert load_profile("pard-llama-3.1-8b").source.arxiv == "2504.18583"


def test_a_profile_without_its_numbers_refuses_to_give_any():
    p = load_profile("pard-llama-3.1-8b")
    assert not p.usable
    with pytest.raises(ProfileError, match="2504.18583"):
        p.tau("humaneval")
    with pytest.raises(ProfileError, match="no acceptance profile 'nope'"):
        load_profile("nope")


@pytest.mark.parametrize("name", [n for n in USABLE if load_profile(n).base is None])
def test_the_fitted_alpha_gives_back_each_published_tau(name):
    p = load_profile(name)
    for bench in p.benchmarks:
        d = p.distribution(bench, drafts=p.drafts)
        assert d.tau == pytest.approx(p.tau(bench), abs=1e-9)
        assert p.tau_source(p.drafts, None) == "published"
        assert p.tau_source(p.drafts - 1, None) == "modeled" and p.tau_source(p.drafts, 16) == "modeled"


def test_trees_grow_with_their_budget_and_a_one_wide_tree_is_the_chain():
    p = load_profile("ddtree-qwen3-8b")
    taus = [p.distribution("humaneval", drafts=15, budget=b).tau for b in (16, 32, 64, 128)]
    assert taus == sorted(taus) and taus[0] > p.tau("humaneval")
    chain = p.distribution("humaneval", drafts=15)
    assert p.distribution("humaneval", drafts=15, budget=15, topk=1).survival == pytest.approx(chain.survival)


@pytest.mark.parametrize("budget", [None, 32])
def test_the_cost_model_prices_a_profile_as_the_replay_draws_it(budget):
    p = load_profile("dflash-qwen3-8b")
    model = AcceptanceModel.from_profile(p, "gsm8k")
    replay = p.distribution("gsm8k", drafts=15, budget=budget, topk=4)
    priced = model.tau_chain(15) if budget is None else model.tau_tree(budget, 15, width=4)
    assert priced == pytest.approx(replay.tau, rel=1e-9)
    assert model.source == "measured"


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(USABLE), bench_index=st.integers(0, 6), drafts=st.sampled_from([7, 9, 15]),
       budget=st.sampled_from([None, 16, 64]), seed=st.integers(0, 10**6))
def test_draws_follow_their_distribution_within_the_low_discrepancy_bound(name, bench_index, drafts, budget, seed):
    """400 draws of the golden-ratio stream: the mean within 1.5% of the profile's τ and the empirical
    CDF within 0.015 of the model's everywhere (measured worst over the profiles: 0.7% and 0.0054; 400
    independent draws would miss the mean by ~3.5% at one standard deviation)."""
    p = load_profile(name)
    d = p.distribution(p.benchmarks[bench_index % len(p.benchmarks)], drafts=drafts, budget=budget)
    draws = d.draws(400, seed)
    assert 1 + sum(draws) / len(draws) == pytest.approx(d.tau, rel=0.015)
    model_cdf = emp_cdf = 0.0
    for n, p_n in enumerate(d.probabilities()):
        model_cdf += p_n
        emp_cdf += draws.count(n) / len(draws)
        assert abs(model_cdf - emp_cdf) <= 0.015


def test_a_distribution_rejects_a_survival_function_that_rises():
    with pytest.raises(ValueError):
        AcceptDistribution((0.5, 0.7))


def test_the_profiles_command_lists_each_profile_with_its_status_and_source(monkeypatch):
    from click.testing import CliRunner
    from rich.console import Console

    from specpilot import cli

    monkeypatch.setattr(cli, "console", Console(width=240))  # a row a profile, whatever the terminal
    r = CliRunner().invoke(cli.main, ["profiles"])
    assert r.exit_code == 0, r.output
    for name in profile_names():
        p = load_profile(name)
        assert name in r.output and p.source.arxiv in r.output and p.status in r.output
    assert "humaneval 6.50" in r.output and "(not entered)" in r.output
