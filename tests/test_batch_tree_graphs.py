"""Batched tree verification on the graphed path (runtime/batch.py GraphedVerify.tree): a greedy tree
step's trees built on the device by the batched builder, the verify under their ancestor masks, the
greedy tree acceptance and each request's KV compaction in one replay, one host read a step. On a
CPU the same code runs without capture: it must do step for step what the eager tree step does, and
every request's output must be its batch-1 AR output."""

from __future__ import annotations

import pytest
import torch

from specpilot.kernels.best_first_tree import best_first_tree as best_first_kernel
from specpilot.kernels.best_first_tree import best_first_tree_reference
from specpilot.runtime.batch import BatchConfig, BatchEngine, generate_batched, ragged_attention_reference
from specpilot.runtime.batch_control import BatchPolicy, StepCost
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.graph_decode import accept_tree_on_device, accept_trees_on_device, ancestor_mask_static
from specpilot.runtime.tree import (Tree, accept_tree, ancestor_mask, best_first_size, best_first_tree,
                                    best_first_tree_padded)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 30], [42] * 13, [10, 20, 30, 40], [7], [250, 3, 250, 3, 9]]
MAX_NEW = 10
RAISE = 1.0e4
BUCKETS = (4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def models(tiny_models, torch_single_thread):
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def references(models):
    return [generate_ar(models.target, p, max_new_tokens=MAX_NEW, eos_token_id=models.cfg.eos_token_id).tokens
            for p in PROMPTS]


def planted(references, right_every: int, seen: list):
    """A draft hook that records what the drafter gave (rids, positions, logits) and plants the AR
    truth at every position not a multiple of `right_every` (so acceptance varies per request and
    step, and a miss leaves the truth in the top-k below a wrong top-1 some of the time), for the
    prompts of even index; the others keep the tiny drafter's guesses (mostly wrong: spec control
    turns their speculation off, so steps mix drafting and AR requests)."""
    truths = {tuple(p): p + r for p, r in zip(PROMPTS[::2], references[::2])}

    def hook(logits, reqs, first):
        seen.append(([q.rid for q in reqs], list(first), logits.clone()))
        for b, (q, pos) in enumerate(zip(reqs, first)):
            truth = truths.get(tuple(q.prompt), ())
            for j in range(logits.shape[1]):
                p = pos + j
                if p < len(truth):
                    logits[b, j, truth[p]] = RAISE if p % right_every else logits[b, j].max() - 0.5
        return logits
    return hook


def run(models, references, kind, *, graphs, tree=(6, 2), max_batch=3, policy=None, arrivals=(0, 1, 1, 2, 4, 6),
        builder=None):
    drafter = models.dflash if kind == "dflash" else models.pard
    seen: list = []
    eng = BatchEngine(models.target, drafter, eos_token_id=models.cfg.eos_token_id, policy=policy,
                      config=BatchConfig(max_batch=max_batch, capacity=64, buckets=BUCKETS if graphs else (),
                                         graphs=graphs),
                      draft_hook=planted(references, 3, seen), tree=tree, tree_builder=builder)
    outs = generate_batched(eng, PROMPTS, MAX_NEW, arrivals=list(arrivals))
    return eng, outs, seen


def spec_control(models, kind, ragged=True):
    drafts = models.dflash.block_size - 1 if kind == "dflash" else models.pard.k
    return BatchPolicy(max_drafts=drafts, spec_control=True, ragged=ragged, warmup_steps=1, probe_every=3,
                       cost=StepCost.from_table({1: 1.0, 64: 1.2}, {1: 0.1, 8: 0.2}))


def test_batched_builder_builds_each_tree_as_the_host_heap():
    """The batched builders ([B, D, K] in, [B, budget + 1] out): tree i is the batch-1 builder's tree
    of row i, whatever the other rows hold."""
    g = torch.Generator().manual_seed(3)
    logp, ids = torch.log_softmax(torch.randn(4, 5, 40, generator=g) * 2, -1).topk(3, -1)
    anchors = torch.tensor([9, 8, 7, 6])
    for build in (best_first_tree_padded, best_first_tree_reference, best_first_kernel):
        batch = build(logp, ids, anchors, 9)
        assert all(t.shape == (4, 10) for t in batch)
        for i in range(4):
            one = best_first_tree(logp[i], ids[i], int(anchors[i]), budget=9).padded(10)
            assert [t[i].tolist() for t in batch[:3]] == [one.parent.tolist(), one.depth.tolist(), one.token.tolist()]
    tokens = best_first_kernel(logp, ids, anchors, 9)[2]
    assert not torch.equal(tokens[0], tokens[1])  # each program read its own row
    for budget, d, k in ((9, 5, 3), (20, 3, 2), (6, 2, 1), (30, 3, 3)):  # what the graphed step sizes its trees by
        lp, tok = logp[0, :d, :k], ids[0, :d, :k]
        assert best_first_size(budget, d, k) == best_first_tree(lp, tok, 1, budget=budget).size - 1


def test_batched_tree_acceptance_is_each_trees_own():
    """accept_trees_on_device over a batch = accept_tree per tree (a batch-1 loop's), ancestors by the
    batched static mask; a row cut to its root accepts nothing."""
    g = torch.Generator().manual_seed(5)
    logp, ids = torch.log_softmax(torch.randn(3, 4, 12, generator=g), -1).topk(3, -1)
    parent, depth, token, _ = best_first_tree_padded(logp, ids, torch.tensor([1, 2, 3]), 8)
    parent[2, 1:], depth[2, 1:] = -1, 0  # a request that does not draft: only its anchor
    anc = ancestor_mask_static(parent, 4)
    argmax = torch.randint(0, 12, (3, 9), generator=g)
    argmax[0, 0] = token[0, 1]  # the first tree accepts at least one node
    n, path, span = accept_trees_on_device(parent, depth, token, anc, argmax, 5)
    for i in range(3):
        tree = Tree(parent[i], depth[i], token[i], torch.zeros(9))
        assert torch.equal(anc[i], ancestor_mask(tree))
        want_path, bonus = accept_tree(tree, argmax[i])
        assert int(n[i]) == len(want_path) - 1 and path[i, :int(n[i]) + 1].tolist() == want_path
        assert span[i, :int(n[i]) + 1].tolist() == [int(token[i, j]) for j in want_path[1:]] + [bonus]
        one = accept_tree_on_device(parent[i], depth[i], token[i], anc[i], argmax[i], 5)
        assert int(one[0]) == int(n[i]) and torch.equal(one[2][:int(n[i]) + 1], span[i, :int(n[i]) + 1])
    assert int(n[0]) >= 1 and int(n[2]) == 0


@pytest.mark.parametrize("kind, tree, max_batch, ragged", [
    ("dflash", (6, 2), 3, True), ("pard", (6, 2), 3, True), ("dflash", (9, 3), 5, True), ("pard", (4, 1), 5, True),
    ("pard", (9, 2), 3, False)])
def test_graphed_tree_steps_equal_the_eager_engines(models, references, kind, tree, max_batch, ragged):
    """Requests joining and leaving, spec control turning speculation on and off per request (so some
    steps mix drafting and AR requests, some are all AR): the graphed engine drafts the same logits,
    accepts the same paths and commits the same tokens as the eager tree engine, step for step, and
    verifies as many rows (a tree of the lattice's size where that is below the budget; without ragged
    packing every tree padded to the budget); every output is its batch-1 AR output; every step went
    through a tree graph of a (bucket, nodes rounded up, D, nodes) shape."""
    eager, eager_outs, eager_seen = run(models, references, kind, graphs=False, tree=tree, max_batch=max_batch,
                                        policy=spec_control(models, kind, ragged))
    graphed, outs, seen = run(models, references, kind, graphs=True, tree=tree, max_batch=max_batch,
                              policy=spec_control(models, kind, ragged))
    assert outs == eager_outs == references
    assert len(seen) == len(eager_seen) > 3
    for (rids, first, logits), (g_rids, g_first, g_logits) in zip(eager_seen, seen):
        assert (g_rids, g_first) == (rids, first)
        torch.testing.assert_close(g_logits, logits, rtol=1e-5, atol=1e-5)
    for rid in map(str, range(len(PROMPTS))):
        assert graphed.requests.get(rid) is None  # all released
    assert (graphed.stats.steps, graphed.stats.committed, graphed.stats.spec_committed, graphed.stats.ar_steps) == \
        (eager.stats.steps, eager.stats.committed, eager.stats.spec_committed, eager.stats.ar_steps)
    assert graphed.stats.tau == eager.stats.tau > 1.0
    assert graphed.stats.verify_rows == eager.stats.verify_rows  # trees of the eager step's sizes
    keys = [k for k in graphed.graphed.steps if k[0] == "tree"]
    assert keys and all(total in BUCKETS and t & (t - 1) == 0 and width <= t for _, total, t, _, width in keys)
    assert any(width == tree[0] + 1 for *_, width in keys)  # steps with drafted trees
    assert graphed.stats.ar_steps > 0 and any(d == 0 for *_, d, _ in keys)  # and all-AR steps, graphed too
    assert kind == "dflash" or len({d for *_, d, _ in keys if d}) > 1  # PARD's draft positions follow spec control
    assert not any(k[0] != "tree" for k in graphed.graphed.steps)  # no chain verify ran


def test_graphed_trees_keep_per_request_histories(models, references):
    """Each request's accepted drafts and verified nodes a step are the eager engine's (the control's
    inputs), with the batched builder of the kernels' host reference."""
    policy = spec_control(models, "dflash")
    runs = {}
    for graphs in (False, True):
        eng = BatchEngine(models.target, models.dflash, eos_token_id=models.cfg.eos_token_id, policy=policy,
                          config=BatchConfig(max_batch=4, capacity=64, buckets=BUCKETS if graphs else (),
                                             graphs=graphs),
                          draft_hook=planted(references, 4, []), tree=(7, 2),
                          tree_builder=best_first_tree_reference if graphs else None)
        history = {}
        for i, p in enumerate(PROMPTS[:4]):
            eng.admit(str(i), p, RequestParams(max_new_tokens=MAX_NEW))
        while eng.active():
            eng.step()
            for rid in eng.active():
                if eng.done(rid):
                    q = eng.request(rid)
                    history[rid] = (eng.output(rid), q.accepted, q.verified)
                    eng.release(rid)
        runs[graphs] = history
    assert runs[True] == runs[False]
    assert all(out == references[int(rid)] for rid, (out, _, _) in runs[True].items())


def test_a_sampled_request_sends_the_tree_step_eager(models, references):
    """A step with a sampled request runs the eager tree step (graphs return greedy acceptance only);
    the greedy requests beside it still get their batch-1 AR output."""
    eng = BatchEngine(models.target, models.pard, eos_token_id=models.cfg.eos_token_id,
                      config=BatchConfig(max_batch=3, capacity=64, buckets=BUCKETS, graphs=True),
                      draft_hook=planted(references, 3, []), tree=(5, 2))
    eng.admit("g", PROMPTS[0], RequestParams(max_new_tokens=MAX_NEW))
    eng.admit("s", PROMPTS[1], RequestParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3))
    eng.step()
    eng.step()
    assert not any(k[0] == "tree" for k in eng.graphed.steps)
    eng.release("s")
    while not eng.done("g"):
        eng.step()
    assert eng.output("g") == references[0]
    assert any(k[0] == "tree" for k in eng.graphed.steps)


@pytest.mark.interpreter
@pytest.mark.slow
def test_graphed_trees_on_the_kernels_equal_batch1(models, references):
    """The graphed tree step on what a GPU runs it with: the trees by the best-first kernel (a program
    a tree) and the attention by split-KV's ragged mode over the static tree masks (the interpreter on
    a CPU, no capture): every output its batch-1 AR output, the drafts' logits the eager engine's."""
    from specpilot.backends.kernel_hooks import split_kv_ragged

    prompts, new = PROMPTS[:3], 5
    runs = {}
    for graphs in (False, True):
        seen: list = []
        eng = BatchEngine(models.target, models.dflash, eos_token_id=models.cfg.eos_token_id,
                          config=BatchConfig(max_batch=2, capacity=64, buckets=(16,) if graphs else (), graphs=graphs),
                          draft_hook=planted(references, 3, seen), tree=(5, 2),
                          attention=split_kv_ragged if graphs else ragged_attention_reference,
                          tree_builder=best_first_kernel if graphs else None)
        runs[graphs] = generate_batched(eng, prompts, new, arrivals=[0, 0, 1]), seen, eng
    (eager, eager_seen, _), (outs, seen, eng) = runs[False], runs[True]
    assert outs == eager == [r[:new] for r in references[:3]]
    assert len(seen) == len(eager_seen) and all(torch.allclose(a[2], b[2], atol=1e-5) for a, b in zip(seen, eager_seen))
    assert eng.graphed.replays["tree"] == eng.stats.steps and eng.stats.tau > 1.0


def test_graphed_trees_refuse_what_they_cannot_run(models):
    config = BatchConfig(max_batch=2, capacity=64, buckets=(8, 16), graphs=True)
    with pytest.raises(ValueError, match="keep"):
        BatchEngine(models.target, models.dflash, eos_token_id=None, config=config, tree=(6, 2), keep=3)
    with pytest.raises(ValueError, match="drafter"):
        BatchEngine(models.target, None, eos_token_id=None, config=config, tree=(6, 2))


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_batched_graphs_graph_the_tree_step(tiny_model_dirs, torch_single_thread, monkeypatch, kind):
    """`TorchEngine.batched(graphs=True)` over a tree-verify program: the drafting and the tree step
    (the backend's batched builder) run over their graphs' static shapes; every output token forced
    against the stock target. A two-level program's engine stays eager (no graphs)."""
    from specpilot.backends.torch_backend import build_engine
    from specpilot.dsl import parse_pipeline
    from specpilot.hf.checkpoint import read_config
    from specpilot.ir import lower
    from specpilot.passes import run_passes
    from specpilot.validate.forcing import force_tokens

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # SDPA per request: the kernels have their own tests
    dirs = tiny_model_dirs["qwen3"]
    stock = lower(read_config(dirs["target"])[0], read_config(dirs[kind])[0], block_size=4, batch=3)
    program, _ = run_passes(stock, parse_pipeline("tree-verify{budget=6, topk=2},ragged-verify,spec-control",
                                                  source="test"))
    engine = build_engine(program, dirs["target"], dirs[kind], torch.device("cpu"))
    batched = engine.batched(capacity=64, graphs=True)  # no cost: profiled on the graphed forwards
    assert batched.tree == (6, 2) and batched.config.graphs and batched.graphed_draft is not None
    assert batched.tree_builder is best_first_tree_reference  # kernel_hooks' builder where Triton does not run
    prompts = [[5, 6, 7, 8], [100, 200], [42] * 9, [10, 20, 30], [7]]
    outs = generate_batched(batched, prompts, 8, arrivals=[0, 0, 1, 3, 3])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) > 0
    assert any(k[0] == "tree" for k in batched.graphed.steps) and batched.graphed_draft.replays["eager"] == 0
    two_level = run_passes(stock, parse_pipeline("two-level-verify{budget=3, draft-budget=9, topk=2}",
                                                 source="test"))[0]
    eager = engine.with_program(two_level).batched(capacity=64, graphs=True)
    assert eager.keep == 3 and eager.graphed is None and eager.graphed_draft is None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_graphed_tree_steps_capture_on_cuda(kind):
    """On a GPU the tree step is captured (the best-first kernel, split-KV's ragged mode over the
    in-graph tree masks, acceptance and compaction, nothing read on the host inside) and replayed for
    every step; each greedy request gets its batch-1 AR tokens on the same device. The host-heap
    builder is refused there."""
    from sampling_fixtures import K, MASK, PROMPT, Tiny
    from specpilot.backends.kernel_hooks import ragged_attention, tree_builder
    from specpilot.runtime.model import PardDrafter

    cuda = Tiny("cuda")
    dev = cuda.target.device
    drafter = cuda.dflash if kind == "dflash" else PardDrafter(model=cuda.pard, mask_token_id=MASK, k=K)
    config = BatchConfig(max_batch=4, capacity=48, buckets=(8, 16, 32), graphs=True)
    with pytest.raises(ValueError, match="device tree builder"):
        BatchEngine(cuda.target, drafter, eos_token_id=None, config=config, tree=(5, 2), attention=ragged_attention(dev))
    eng = BatchEngine(cuda.target, drafter, eos_token_id=None, config=config, tree=(5, 2),
                      attention=ragged_attention(dev), tree_builder=tree_builder(dev))
    prompts = [list(PROMPT), [4, 0, 2, 2], [3, 3], [1, 4, 1, 4, 0]]
    outs = generate_batched(eng, prompts, 8, arrivals=[0, 0, 1, 3])
    for p, out in zip(prompts, outs):
        assert out == generate_ar(cuda.target, p, max_new_tokens=8, eos_token_id=None).tokens
    graphs = [entry[-1].graph for key, entry in eng.graphed.steps.items() if key[0] == "tree"]
    assert graphs and all(g is not None for g in graphs)
    assert eng.graphed.replays["tree"] == eng.stats.steps and eng.graphed.replays["eager"] == 0
