"""The cost model prices a two-level verify: the first level's layers over the drafted tree, the rest
of the target over the survivors (no layer twice), a host round trip to choose them, and a τ between
the one-level trees of the kept and the drafted nodes."""

from __future__ import annotations

import pytest

from specpilot.cost import CostModel, Workload, step_time
from specpilot.cost.two_level import REACH, layer_of, tau_two_level
from specpilot.hf.known import dflash_config, model_config
from specpilot.ir import lower
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.two_level_verify import TwoLevelVerify


@pytest.fixture(scope="module")
def llama8b():
    return lower(model_config("llama-3.1-8b"), dflash_config("llama-3.1-8b"), dtype="bfloat16")


def _predict(model, program, p):
    return model.predict(p.apply(program).program, Workload(tau=4.0))


def _time(est, keep) -> float:
    return sum(r.time for r in est.rows if keep(r)) * est.scale


def test_the_first_level_costs_only_its_layers_over_the_pruned_nodes(llama8b):
    model = CostModel("h200")
    tree = _predict(model, llama8b, TreeVerify(budget=16, topk=4))
    n_layers = len(llama8b.target.find("attention"))
    gpu = model.gpu
    for exit_layer in (2, 8):
        for first, head in (("early-exit-drafter", True), ("early-exit-split", False)):
            two = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, topk=4, first=first,
                                                          exit_layer=exit_layer))
            # the target at 65 and at 17 rows: the step's extra is layers < L (and the early head) at 65 rows
            # less the same layers at 17 rows, which the survivors no longer recompute
            at = {q: step_time(llama8b.target, gpu, 1, q, 512, dtype="bfloat16", cuda_graphs=False) for q in (65, 17)}

            def first_part(r):
                i = layer_of(r.name)
                return (i is not None and i < exit_layer) or r.op in ("input", "embed")

            extra = _time(at[65], first_part) - _time(at[17], first_part)
            if head:
                extra += _time(at[65], lambda r: layer_of(r.name) is None and r.op in ("rmsnorm", "lm_head"))
            got = two.steps.verify.time - tree.steps.verify.time
            assert got == pytest.approx(extra * tree.steps.verify.scale, rel=1e-9)
            assert 0 < got < tree.steps.verify.time * (exit_layer / n_layers + (0.3 if head else 0.05))
            assert any(r.name.startswith("first/") for r in two.steps.verify.rows)
            assert any(r.op == "prune" for r in two.steps.overhead_rows)
    split = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, first="early-exit-split", exit_layer=2))
    exit_ = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, first="early-exit", exit_layer=2))
    deeper = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, first="early-exit", exit_layer=8))
    assert split.steps.verify.time < exit_.steps.verify.time < deeper.steps.verify.time


def test_tau_moves_by_each_first_levels_measured_reach(llama8b):
    """τ = τ(N) + reach · (τ(M) − τ(N)): a perfect first level (reach 1) gets the tree of M's τ, the
    drafter's ranking (0) the tree of N's, a worse one (negative, as measured on the hybrid pair) less."""
    model = CostModel("h200")
    small = _predict(model, llama8b, TreeVerify(budget=16, topk=4)).tau.value
    big = _predict(model, llama8b, TreeVerify(budget=64, topk=4)).tau.value
    assert big > small
    assert tau_two_level(small, big, "drafter") == small
    for first in REACH:
        extra = {"exit_layer": 4} if first != "drafter" else {}
        got = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, first=first, **extra)).tau.value
        assert got == pytest.approx(small + REACH[first] * (big - small))
        assert (got > small) == (REACH[first] > 0) or REACH[first] == 0
    # the drafter first level at batch 1 keeps the one-level tree of N: the same τ and the same verify
    drafter = _predict(model, llama8b, TwoLevelVerify(budget=16, draft_budget=64, first="drafter"))
    tree = _predict(model, llama8b, TreeVerify(budget=16, topk=4))
    assert drafter.tau.value == pytest.approx(tree.tau.value)
    assert drafter.steps.verify.time == pytest.approx(tree.steps.verify.time)
    with pytest.raises(ValueError, match="first level must be one of"):
        tau_two_level(1.0, 2.0, "oracle")


def test_the_model_ranks_two_level_against_one_level_trees(llama8b):
    """At batch 1 on the H200 the 8B verify is memory-bound: 65 rows through two layers cost little
    beside 17 rows through 32, so a first level with no head over the vocabulary is priced below the
    one-level tree of 64 and above the one of 16; its t_token (with its measured reach) ranks it."""
    model = CostModel("h200")
    t = {label: _predict(model, llama8b, p) for label, p in (
        ("tree-16", TreeVerify(budget=16, topk=4)), ("tree-64", TreeVerify(budget=64, topk=4)),
        ("split", TwoLevelVerify(budget=16, draft_budget=64, first="early-exit-split", exit_layer=2)))}
    assert t["tree-16"].steps.verify.time < t["split"].steps.verify.time < t["tree-64"].steps.verify.time
    for e in t.values():  # what ranks them: the whole step (the host's choice of survivors too) per token
        s = e.steps
        assert e.t_token.value == pytest.approx((s.draft.time + s.verify.time + s.overhead) / s.tau)
    prune = [r for r in t["split"].steps.overhead_rows if r.op == "prune"]
    assert prune and prune[0].time >= model.gpu.host_sync_s
