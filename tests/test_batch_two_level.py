"""Two-level verification's early-exit first levels in the batched engine (runtime/batch.py): the
target's first layers over every request's drafted tree in one packed forward, a batch-wide budget
split across requests by the level's scores, the second level continued from the exit layer. Every
request's greedy output is its own batch-1 AR output, whatever shares its batch and whenever it
joins or leaves (zoo pair, odd batch sizes)."""

from __future__ import annotations

import pytest
import torch

from conftest import random_tree
from specpilot.runtime import tree_decode
from specpilot.runtime.batch import BatchConfig, BatchEngine, generate_batched
from specpilot.runtime.batch_control import BatchPolicy, StepCost
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.tree import Tree, ancestor_mask
from specpilot.runtime.two_level import FirstLevel, forest, level_scores

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = [[300, 301, 302, 303, 304], [1000, 17, 2000], [77] * 9, [5, 6, 7, 8, 9, 10], [42, 43], [900, 901, 3],
           [64, 65, 66, 67]]
ARRIVALS = [0, 0, 1, 2, 4, 4, 7]
MAX_NEW = 12
COST = StepCost.from_table({1: 1.0, 16: 1.3, 64: 2.0, 512: 12.0})


@pytest.fixture(scope="module")
def zoo():
    """The code-qwen3 zoo pair (target, DFlash and PARD drafters) in fp32, each prompt's batch-1 AR output."""
    from specpilot.runtime.builtin import resolve_builtin
    from specpilot.runtime.load import load_drafter, load_target

    torch.set_num_threads(1)
    target, cfg = load_target(resolve_builtin("code-qwen3"), dtype=torch.float32, device="cpu")
    drafters = {kind: load_drafter(resolve_builtin(f"code-qwen3/{kind}"), target, cfg, dtype=torch.float32,
                                   device="cpu") for kind in ("dflash", "pard")}
    refs = [generate_ar(target, p, max_new_tokens=MAX_NEW, eos_token_id=cfg.eos_token_id).tokens for p in PROMPTS]
    return target, cfg, drafters, refs


def batch_engine(zoo, kind, first, exit_layer, *, max_batch, ragged=True, budget=False, tree=(24, 3), keep=5):
    target, cfg, drafters, _ = zoo
    drafter = drafters[kind]
    drafts = drafter.block_size - 1 if kind == "dflash" else drafter.k
    policy = BatchPolicy(max_drafts=drafts, ragged=ragged, verify_budget=budget, cost=COST if budget else None)
    return BatchEngine(target, drafter, eos_token_id=cfg.eos_token_id, config=BatchConfig(max_batch=max_batch, capacity=96),
                       policy=policy, tree=tree, keep=keep, first=first, exit_layer=exit_layer)


@pytest.mark.parametrize("kind, first, exit_layer, max_batch, ragged, budget", [
    ("dflash", "early-exit", 2, 3, True, False),
    ("dflash", "early-exit-split", 1, 5, False, True),
    ("dflash", "early-exit-drafter", 3, 3, True, True),
    ("pard", "early-exit-split", 2, 5, True, False),
    ("pard", "early-exit", 5, 3, False, True),
])
def test_early_exit_first_levels_at_batch_equal_batch1_ar(zoo, kind, first, exit_layer, max_batch, ragged, budget):
    """Seven prompts joining at steps 0..7 and leaving when done, 3 or 5 at a time: every output is its
    batch-1 AR output; the first level pruned (ragged, no budget: at most keep a request on average)."""
    eng = batch_engine(zoo, kind, first, exit_layer, max_batch=max_batch, ragged=ragged, budget=budget)
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=ARRIVALS) == zoo[3]
    assert eng.stats.pruned_nodes > 0 and eng.stats.tau > 1.0
    if ragged and not budget:
        assert eng.stats.verify_rows <= eng.stats.steps * max_batch * (1 + eng.keep)


def test_at_batch_one_the_batched_level_keeps_what_the_batch1_loop_keeps(zoo):
    """Alone in the batched engine, a request's batch-wide budget is its own keep: the early exit
    keeps the survivors the batch-1 tree loop's first level keeps, so both take the same steps."""
    target, cfg, drafters, refs = zoo
    drafter = drafters["dflash"]
    for prompt, ref in list(zip(PROMPTS, refs))[:3]:
        alone = tree_decode.generate_dflash_tree(
            target, drafter, prompt, block_size=drafter.block_size, budget=24, topk=3,
            mask_token_id=drafter.mask_token_id, max_new_tokens=MAX_NEW, eos_token_id=cfg.eos_token_id,
            prune=FirstLevel("early-exit-split", 5, target, exit_layer=2))
        eng = batch_engine(zoo, "dflash", "early-exit-split", 2, max_batch=1)
        assert generate_batched(eng, [prompt], MAX_NEW) == [alone.tokens] == [ref]
        assert eng.stats.steps == alone.steps


def test_a_sampled_request_keeps_its_own_survivors_whatever_shares_its_batch(zoo):
    """A sampled request keeps its own keep best nodes by the early exit (not the batch's share), so
    its tokens are the same alone and among greedy requests under a verify budget; the greedy ones
    stay their AR outputs."""
    def serve(requests):
        eng = batch_engine(zoo, "dflash", "early-exit-split", 2, max_batch=3, budget=True, ragged=False)
        out = {rid: [] for rid in requests}
        for rid, (prompt, params) in requests.items():
            eng.admit(rid, prompt, params)
        while eng.active():
            for rid, toks in eng.step().items():
                out[rid] += toks
            for rid in [r for r in eng.active() if eng.done(r)]:
                eng.release(rid)
        return out
    s = (PROMPTS[0], RequestParams(MAX_NEW, temperature=0.8, seed=7))
    alone = serve({"s": s})["s"]
    crowd = serve({"s": s, "g1": (PROMPTS[1], RequestParams(MAX_NEW)), "g3": (PROMPTS[3], RequestParams(MAX_NEW))})
    assert crowd["s"] == alone and len(alone) == MAX_NEW
    assert crowd["g1"] == zoo[3][1] and crowd["g3"] == zoo[3][3]


def test_the_batch_wide_budget_goes_to_the_best_scores(zoo):
    """keep_batch_wide over early-exit scores: the batch keeps its keep x requests best nodes whoever
    holds them (a request of high scores takes more than its keep, one of low scores less), each
    request's survivors ancestor-closed, re-indexed parents first."""
    eng = batch_engine(zoo, "dflash", "early-exit", 2, max_batch=3, keep=4)
    trees, scores = {}, {}
    for rid, (seed, offset) in {"hi": (1, 0.0), "mid": (2, -2.0), "lo": (3, -6.0)}.items():
        t = random_tree(seed, 12, 50)
        local = -torch.rand(12, generator=torch.Generator().manual_seed(seed)) + offset
        local[0] = 0.0
        score = ancestor_mask(t).float() @ local  # path sums of negative steps: never grow along a path
        trees[rid], scores[rid] = t, score
    drafted = dict(trees)
    reqs = [type("Q", (), {"rid": rid, "rng": None})() for rid in trees]
    kept = eng.keep_batch_wide(trees, reqs, 0, scores)
    assert sum(len(k) - 1 for k in kept.values()) == 3 * 4
    assert len(kept["hi"]) - 1 > 4 > len(kept["lo"]) - 1
    chosen = [float(scores[rid][i]) for rid, k in kept.items() for i in k[1:]]
    dropped = [float(scores[rid][i]) for rid in kept for i in range(1, 12) if i not in kept[rid]]
    assert min(chosen) >= max(dropped)
    for rid, k in kept.items():
        up = drafted[rid].parent.tolist()
        assert k[0] == 0 and all(up[i] in k for i in k[1:])  # ancestor-closed
        t = trees[rid]
        assert t.size == len(k) and torch.equal(t.token, drafted[rid].token[k])
        assert all(p < i for i, p in enumerate(t.parent.tolist()) if p >= 0)


@pytest.mark.parametrize("kind", ["early-exit", "early-exit-drafter", "early-exit-split"])
def test_a_forest_scores_each_tree_as_its_own(tiny_models, kind):
    """One head over the batch's trees side by side (`forest`) gives each node the score its own tree gives it."""
    target = tiny_models["qwen3"].target
    trees = [random_tree(s, n, 200) for s, n in ((4, 9), (5, 1), (6, 14))]
    trees = [Tree(t.parent, t.depth, t.token, ancestor_mask(t).float() @ -torch.rand(t.size)) for t in trees]
    hidden = [torch.randn(1, t.size, target.cfg.hidden_size) for t in trees]
    both, roots = forest(trees)
    with torch.inference_mode():
        got = level_scores(kind, target, both, torch.cat(hidden, dim=1), roots)
        want = torch.cat([level_scores(kind, target, t, h) for t, h in zip(trees, hidden)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_a_first_level_needs_its_exit_layer(zoo):
    with pytest.raises(ValueError, match="exit_layer in 1..7"):
        batch_engine(zoo, "dflash", "early-exit", 8, max_batch=2)
    with pytest.raises(ValueError, match="first must be one of"):
        batch_engine(zoo, "dflash", "oracle", 1, max_batch=2)
