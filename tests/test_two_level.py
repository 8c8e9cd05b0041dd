"""Two-level verification: the first levels rank and prune drafted trees, the target alone accepts
(outputs equal AR greedy, token-forced through the CLI), the pass rewrites the step consistently."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_tree, tiny_spec
from specpilot.cli import main
from specpilot.dsl import parse_pipeline
from specpilot.errors import PipelineError
from specpilot.ir import lower, print_program, verify_program
from specpilot.passes import run_passes
from specpilot.passes.two_level_verify import TwoLevelVerify
from specpilot.runtime import tree_decode
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tiny import MASK_TOKEN_ID
from specpilot.runtime.tiny_hybrid import build_tiny_hybrid
from specpilot.runtime.tree import Tree, ancestor_mask, best_first_tree, draft_topk
from specpilot.runtime.tree_decode import commit_tree, verify_tree_logits
from specpilot.runtime.two_level import (
    FirstLevel, drafter_scores, early_exit_scores, exit_forward, first_level, prune_tree, share_budget, split_scores,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _random_tree(seed: int, n: int) -> Tree:
    return random_tree(seed, n, 50)


# --- pruning -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 30), keep=st.integers(1, 12), pad=st.integers(0, 3))
def test_pruned_trees_are_ancestor_closed_and_keep_the_best(seed, n, keep, pad):
    tree = _random_tree(seed, n).padded(n + pad)
    g = torch.Generator().manual_seed(seed + 1)
    scores = torch.randn(tree.size, generator=g)  # any scores: closure must hold even when they grow along paths
    scores[n:] = float("-inf")
    pruned = prune_tree(tree, scores, keep)
    assert pruned.size == keep + 1
    real = [i for i in range(pruned.size) if i == 0 or int(pruned.parent[i]) >= 0]
    assert len(real) == min(keep, n - 1) + 1
    for i in real[1:]:  # parents precede, depths agree, the root path exists in the original tree
        p = int(pruned.parent[i])
        assert 0 <= p < i and int(pruned.depth[i]) == int(pruned.depth[p]) + 1
    paths = {tuple(pruned.token[ancestor_mask(pruned)[i]].tolist()) for i in real}
    original = {tuple(tree.token[ancestor_mask(tree)[i]].tolist()) for i in range(n)}
    assert paths <= original


def test_path_products_keep_exactly_the_best_nodes():
    tree = _random_tree(4, 20)
    local = -torch.rand(20, generator=torch.Generator().manual_seed(2))
    local[0] = 0
    scores = ancestor_mask(tree).float() @ local  # a survival product: never grows along a path
    pruned = prune_tree(tree, scores, 7)
    assert sorted(pruned.score[1:].tolist(), reverse=True) == sorted(scores[1:].tolist(), reverse=True)[:7]


@pytest.mark.parametrize("seed", range(4))
def test_drafter_confidence_is_best_first_at_the_second_budget(seed):
    """On a best-first tree the drafter's survival products keep the best-first tree of N nodes: at
    batch 1 this first level is the one-level tree at the second level's budget."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(seed)) * 2
    logp, ids = draft_topk(logits, 4)
    big, small = best_first_tree(logp, ids, 1, budget=40), best_first_tree(logp, ids, 1, budget=11)
    pruned = prune_tree(big, drafter_scores(big), 11)

    def paths(t):
        anc = ancestor_mask(t)
        return sorted(tuple(t.token[anc[i]].tolist()) for i in range(t.size))

    assert paths(pruned) == paths(small)


def test_a_batch_shares_one_first_level_budget():
    scores = [torch.tensor([0.0, -0.1, -0.5, -3.0]), torch.tensor([0.0, -0.2, float("-inf")]), torch.tensor([0.0])]
    assert share_budget(scores, 3) == [2, 1, 0]
    assert share_budget(scores, 10) == [3, 1, 0]
    assert share_budget(scores, 0) == [0, 0, 0]
    with pytest.raises(ValueError, match=">= 0"):
        share_budget(scores, -1)


# --- the early-exit scorer ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    dirs = build_tiny_hybrid(tmp_path_factory.mktemp("two-level-hybrid"))
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
    return dirs, target, load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("which", ["qwen3", "hybrid"])
def test_early_exit_scores_are_the_exit_head_along_each_path(which, tiny_models, hybrid):
    target = tiny_models["qwen3"].target if which == "qwen3" else hybrid[1]
    tree = _random_tree(9, 11).padded(13)
    anc = ancestor_mask(tree)
    exit_layer = 1
    with torch.inference_mode():
        cache = target.new_cache(1, 40)
        target(torch.tensor([[5, 6, 7]]), cache)
        state = [s.clone() for s in getattr(cache, "state", [])]
        scores = early_exit_scores(target, cache, tree, exit_layer)
        assert cache.length == 3 and all(torch.equal(a, b) for a, b in zip(state, getattr(cache, "state", [])))
        full = target(tree.token[None], cache, mask=anc, positions=(3 + tree.depth)[None], hidden_layers=(exit_layer - 1,))
    logp = torch.log_softmax(target.head(target.final_norm(full.hidden))[0], -1)
    local = torch.where(tree.parent >= 0, logp[tree.parent.clamp(min=0), tree.token], 0.0)
    want = anc.float() @ local
    real = (tree.parent >= 0) | (torch.arange(tree.size) == 0)
    torch.testing.assert_close(scores[real], want[real], atol=1e-4, rtol=1e-4)
    assert torch.isinf(scores[~real]).all()
    with pytest.raises(ValueError, match="exit_layer must be in 1.."):
        early_exit_scores(target, cache, tree, len(target.model.layers))


@pytest.mark.parametrize("which", ["qwen3", "hybrid"])
def test_split_scores_share_the_drafters_mass_among_siblings_by_the_exit(which, tiny_models, hybrid):
    target = tiny_models["qwen3"].target if which == "qwen3" else hybrid[1]
    base = _random_tree(11, 14)
    local = -torch.rand(14, generator=torch.Generator().manual_seed(3))
    local[0] = 0
    tree = Tree(base.parent, base.depth, base.token, ancestor_mask(base).float() @ local).padded(16)
    with torch.inference_mode():
        cache = target.new_cache(1, 40)
        target(torch.tensor([[5, 6, 7]]), cache)
        hidden = exit_forward(target, cache, tree, 1).layers[-1]
        scores = split_scores(target, tree, hidden)
        logits = target.head(target.final_norm(hidden))[0]
    parent = tree.parent.tolist()
    want = [0.0] * 14
    for i in range(1, 14):  # by loops: the drafter's mass over i's siblings (and i), split by the exit's softmax
        sib = [j for j in range(1, 14) if parent[j] == parent[i]]
        mass = torch.logsumexp(local[sib], 0)
        split = logits[parent[i], tree.token[sib]].log_softmax(0)[sib.index(i)]
        want[i] = want[parent[i]] + float(mass + split)
    torch.testing.assert_close(scores[:14], torch.tensor(want), atol=1e-4, rtol=1e-4)
    assert torch.isinf(scores[14:]).all()
    lone = [i for i in range(1, 14) if sum(p == parent[i] for p in parent) == 1]
    for i in lone:  # a lone child keeps the drafter's own step
        assert abs(float(scores[i] - scores[parent[i]] - local[i])) < 1e-5


# --- layer reuse: the second level continues the survivors from the early exit's layer -------------


def _cache_state(cache) -> list[torch.Tensor]:
    """What a cache holds for the next step: every valid K/V slot (and a hybrid's committed states)."""
    kv = getattr(cache, "kv", cache)
    out = [t[:, :, : cache.length] for t in (*kv.k, *kv.v)]
    return out + [t.clone() for t in (*getattr(cache, "state", []), *getattr(cache, "conv", []))]


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Every element within rel of the tensor's largest magnitude (float32 sums over different row
    counts round differently; 1e-5 of the scale is ~80 float32 ulps)."""
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= rel * max(1.0, float(want.abs().max())), float((got - want).abs().max())


@pytest.mark.parametrize("which", ["qwen3", "hybrid"])
@pytest.mark.parametrize("seed, drafted, keep, exit_layer", [(1, 30, 7, 1), (2, 25, 11, 2), (3, 6, 9, 2)])
def test_layer_reuse_equals_the_recompute(which, seed, drafted, keep, exit_layer, tiny_models, hybrid):
    """Survivors continued from layer L (their layer-L rows and layer < L K/V gathered from the first
    level's forward over the whole drafted tree) give the logits, hidden states and, after the
    commit, the cache of a full verify of the survivors; keep > drafted pads the survivors."""
    target = tiny_models["qwen3"].target if which == "qwen3" else hybrid[1]
    tree = _random_tree(seed, drafted).padded(drafted + 2)
    scores = -torch.rand(tree.size, generator=torch.Generator().manual_seed(seed))
    hidden_layers = tuple(range(len(target.model.layers)))  # every layer's output, those below L too
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        caches = [target.new_cache(1, 64) for _ in range(2)]
        for c in caches:
            target(prompt, c)
        level = FirstLevel("early-exit-drafter", keep, target, exit_layer, reuse=True)
        pruned = level(tree, caches[0])
        assert pruned.size == keep + 1 and level.pending is not None
        got = level.verify(target, caches[0], pruned, hidden_layers)
        want = verify_tree_logits(target, caches[1], pruned, hidden_layers)
        assert caches[0].length == caches[1].length == 5 + keep + 1
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)  # logits
        _close_to_scale(got[1], want[1])  # residual streams of size ~80: fp32 rounding of other row counts
        assert torch.equal(got[2], want[2])
        for g, w in zip(_cache_state(caches[0]), _cache_state(caches[1])):  # every layer's K/V of every survivor
            _close_to_scale(g, w)
        path = [0] + [i for i in range(1, pruned.size) if int(pruned.parent[i]) == 0][:1]  # the root and a child
        for c in caches:
            commit_tree(c, 5, path)
        for g, w in zip(_cache_state(caches[0]), _cache_state(caches[1])):
            _close_to_scale(g, w)
        nxt = torch.tensor([[11]])
        torch.testing.assert_close(target(nxt, caches[0]).logits, target(nxt, caches[1]).logits, atol=1e-5, rtol=1e-5)


def test_reuse_off_recomputes_and_leaves_the_cache_as_it_was(hybrid):
    target = hybrid[1]
    tree = _random_tree(5, 12)
    with torch.inference_mode():
        cache = target.new_cache(1, 40)
        target(torch.tensor([[5, 6, 7]]), cache)
        level = first_level("early-exit", 4, target, exit_layer=2, reuse=False)
        pruned = level(tree, cache)
        assert level.pending is None and not cache.pending_tree and cache.length == 3
        logits, _, _ = level.verify(target, cache, pruned)
    assert logits.shape[0] == 5 and cache.length == 8


# --- lossless: the target alone accepts ------------------------------------------------------------


@pytest.mark.parametrize("which", ["qwen3", "hybrid"])
@pytest.mark.parametrize("first, exit_layer", [("drafter", 1), ("early-exit", 1), ("early-exit-drafter", 2),
                                               ("early-exit-split", 2)])
def test_two_level_loops_equal_ar(which, first, exit_layer, tiny_models, hybrid):
    if which == "qwen3":
        m = tiny_models["qwen3"]
        target, dflash, pard = m.target, m.dflash, m.pard
    else:
        target, dflash, pard = hybrid[1], hybrid[2], None
    prompt = list(b"def add(a, b):")
    ar = generate_ar(target, prompt, max_new_tokens=16, eos_token_id=None)
    prune = first_level(first, 5, target, exit_layer=exit_layer)
    common = dict(budget=20, topk=3, mask_token_id=MASK_TOKEN_ID, max_new_tokens=16, eos_token_id=None, prune=prune)
    assert tree_decode.generate_dflash_tree(target, dflash, prompt, block_size=4, **common).tokens == ar.tokens
    if pard is not None:
        assert tree_decode.generate_pard_tree(target, pard, prompt, k=4, **common).tokens == ar.tokens


# --- the pass -----------------------------------------------------------------------------------------


def _configs(dirs):
    return [json.loads((dirs[k] / "config.json").read_text()) for k in ("target", "dflash")]


def test_the_pass_rewrites_the_step_consistently(hybrid):
    p = lower(*_configs(hybrid[0]))
    q, [rec] = run_passes(p, [TwoLevelVerify(budget=8, draft_budget=24, topk=3, first="early-exit", exit_layer=2)])
    assert rec.changed and rec.lossless and q.target == p.target and q.drafter == p.drafter
    verify_program(q)
    propose, verify = q.step.one("propose")[1], q.step.one("verify")[1]
    assert (propose["shape"], propose["budget"], propose["topk"]) == ("tree", 24, 3)
    assert dict(verify.items()) == {"mode": "two-level", "q": 9, "first": "early-exit", "exit_layer": 2}
    assert q.step.one("accept")[1]["rule"] == "tree-path" and q.step.one("commit")[1]["kv"] == "compact"
    d, _ = run_passes(q, [TwoLevelVerify(budget=8, draft_budget=24, topk=3, first="drafter")])
    assert "exit_layer" not in d.step.one("verify")[1] and d.step.one("verify")[1]["first"] == "drafter"
    again, [rec2] = run_passes(d, [TwoLevelVerify(budget=8, draft_budget=24, topk=3, first="drafter")])
    assert not rec2.changed and again == d
    assert sum(a != b for a, b in zip(print_program(p).splitlines(), print_program(q).splitlines())) == 4
    space = TwoLevelVerify.schedule_space(p)
    assert {c.first for c in space} == {"drafter", "early-exit", "early-exit-drafter", "early-exit-split"}
    assert all(c.apply(p).changed for c in space)
    assert parse_pipeline("two-level-verify{budget=8, draft-budget=24, first=drafter}") == [
        TwoLevelVerify(budget=8, draft_budget=24, first="drafter")]


@pytest.mark.parametrize("text, fragment", [
    ("two-level-verify{budget=8, draft-budget=4}", "draft-budget must be >= budget"),
    ("two-level-verify{first=oracle}", "first must be one of drafter, early-exit, early-exit-drafter"),
    ("two-level-verify{budget=0}", "budget must be >= 1"),
])
def test_bad_parameters_are_refused(text, fragment):
    with pytest.raises(PipelineError, match=fragment):
        parse_pipeline(text)


def test_an_exit_past_the_target_is_refused(hybrid):
    p = lower(*_configs(hybrid[0]))  # 4 layers
    with pytest.raises(PipelineError, match=r"'exit-layer' = 4 is out of range for this deployment: expected 1\.\.3"):
        run_passes(p, [TwoLevelVerify(exit_layer=4)])


# --- the backend, through the CLI: token forcing ------------------------------------------------------


@pytest.mark.parametrize("target, kind, passes", [
    ("code-qwen3-next", "dflash", "two-level-verify{budget=8, draft-budget=32, first=early-exit, exit-layer=2}"),
    ("code-qwen3", "pard", "two-level-verify{budget=8, draft-budget=32, first=drafter}"),
    ("code-qwen3", "dflash", "two-level-verify{budget=8, draft-budget=32, first=early-exit-drafter, exit-layer=3}"),
])
def test_compile_with_two_level_verify_passes_token_forcing(target, kind, passes, tmp_path, monkeypatch):
    calls = []
    real = tree_decode.generate_dflash_tree if kind == "dflash" else tree_decode.generate_pard_tree

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(tree_decode, real.__name__, spy)
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(tiny_spec(kind).replace("target: tiny-qwen3", f"target: {target}").replace("block_size: 4",
                                                                                                "block_size: 8"))
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["compile", str(spec), "--passes", passes, "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["outputs_equal_ar"] == "2/2" and report["tokens_checked"] == 24
    assert json.loads((out / "validation.json").read_text())["passed"]
    assert calls and all(c["budget"] == 32 and c["prune"] is not None for c in calls)
