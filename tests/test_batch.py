"""The batched engine (runtime/batch.py): every request's greedy output is its own batch-1 AR output,
whatever shares its batch and whenever it joins or leaves; the policies (verify budget, padding,
speculation control) move only what is verified."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.runtime.batch import BatchConfig, BatchEngine, Ragged, generate_batched, ragged_attention_reference
from specpilot.runtime.batch_control import BatchPolicy, StepCost
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.engine_api import RequestParams, StepEngine
from specpilot.runtime.model import attend, build_mask

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 30], [42] * 13, [10, 20, 30, 40], [7], [250, 3, 250, 3, 9]]
MAX_NEW = 10
RAISE = 1.0e4


@pytest.fixture(scope="module")
def models(tiny_models, torch_single_thread):
    return tiny_models["qwen3"]


@pytest.fixture(scope="module")
def references(models):
    """Each prompt's batch-1 AR output (the stock loop)."""
    return [generate_ar(models.target, p, max_new_tokens=MAX_NEW, eos_token_id=models.cfg.eos_token_id).tokens
            for p in PROMPTS]


def oracle(references, right_every: int):
    """A draft hook that plants the AR truth at every position not a multiple of `right_every`, so
    acceptance varies per request and per step (the tiny drafters' own guesses are mostly wrong)."""
    truths = {tuple(p): p + r for p, r in zip(PROMPTS, references)}

    def hook(logits, reqs, first):
        for b, (q, pos) in enumerate(zip(reqs, first)):
            truth = truths[tuple(q.prompt)]
            for j in range(logits.shape[1]):
                p = pos + j
                if p < len(truth) and p % right_every:
                    logits[b, j, truth[p]] = RAISE
        return logits
    return hook


def engine(models, kind, references, *, max_batch=3, policy=None, right_every=5, buckets=()):
    drafter = {"dflash": models.dflash, "pard": models.pard, "ar": None}[kind]
    return BatchEngine(models.target, drafter, eos_token_id=models.cfg.eos_token_id, policy=policy,
                       config=BatchConfig(max_batch=max_batch, capacity=64, buckets=buckets),
                       draft_hook=oracle(references, right_every) if drafter is not None else None)


def test_engine_is_a_step_engine(models, references):
    eng = engine(models, "dflash", references)
    assert isinstance(eng, BatchEngine)
    api: StepEngine = eng  # the serving helper's Protocol
    api.admit("a", PROMPTS[0], RequestParams(max_new_tokens=4))
    assert api.active() == ["a"] and api.max_batch == 3
    got = []
    while not eng.done("a"):
        got += api.step()["a"]
    assert got == references[0][:4]
    api.release("a")
    assert api.active() == []


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["dflash", "pard", "ar"]), max_batch=st.integers(1, 4),
       order=st.permutations(range(len(PROMPTS))), arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
       right_every=st.integers(2, 7))
def test_every_request_equals_its_batch1_ar(models, references, kind, max_batch, order, arrivals, right_every):
    """Requests join at drawn steps (waiting while the slots are full), leave when done, in any order."""
    prompts = [PROMPTS[i] for i in order]
    eng = engine(models, kind, references, max_batch=max_batch, right_every=right_every)
    outs = generate_batched(eng, prompts, MAX_NEW, arrivals=arrivals)
    assert outs == [references[i] for i in order]
    assert eng.free == list(range(max_batch))  # every slot came back


def test_speculation_accepts_and_is_counted(models, references):
    eng = engine(models, "dflash", references, right_every=1000)  # the oracle is always right
    outs = generate_batched(eng, PROMPTS[:3], MAX_NEW)
    assert outs == references[:3]
    assert eng.stats.steps < 3 * MAX_NEW / 2  # many tokens a step, not one
    assert eng.stats.committed == sum(map(len, outs))


def test_cancel_mid_generation_frees_the_slot_and_others_continue(models, references):
    eng = engine(models, "pard", references, max_batch=2)
    eng.admit("x", PROMPTS[0], RequestParams(MAX_NEW))
    eng.admit("y", PROMPTS[1], RequestParams(MAX_NEW))
    got = {"x": [], "y": []}
    for _ in range(2):
        for rid, toks in eng.step().items():
            got[rid] += toks
    eng.release("x")  # cancelled
    eng.admit("z", PROMPTS[2], RequestParams(MAX_NEW))
    got["z"] = []
    while eng.active():
        for rid, toks in eng.step().items():
            got[rid] += toks
        for rid in eng.active():
            if eng.done(rid):
                eng.release(rid)
    assert got["y"] == references[1] and got["z"] == references[2]
    assert got["x"] == references[0][:len(got["x"])]


def test_zoo_pair_dflash_batched_equals_batch1(torch_single_thread):
    from specpilot.runtime.builtin import resolve_builtin
    from specpilot.runtime.load import load_drafter, load_target

    target, cfg = load_target(resolve_builtin("code-qwen3"), dtype=torch.float32, device="cpu")
    drafter = load_drafter(resolve_builtin("code-qwen3/dflash"), target, cfg, dtype=torch.float32, device="cpu")
    prompts = [[300, 301, 302, 303, 304], [1000, 17, 2000], [77] * 9]
    refs = [generate_ar(target, p, max_new_tokens=8, eos_token_id=cfg.eos_token_id).tokens for p in prompts]
    eng = BatchEngine(target, drafter, eos_token_id=cfg.eos_token_id, config=BatchConfig(max_batch=2, capacity=64))
    assert generate_batched(eng, prompts, 8, arrivals=[0, 0, 1]) == refs


def cost() -> StepCost:
    return StepCost.from_table({1: 1.0, 8: 1.2, 16: 1.6, 64: 4.0}, {1: 0.3, 4: 0.4})


@pytest.mark.parametrize("kind", ["dflash", "pard"])
@pytest.mark.parametrize("policy", [
    dict(verify_budget=True),
    dict(verify_budget=True, ragged=False),
    dict(ragged=False),
    dict(spec_control=True),
    dict(verify_budget=True, spec_control=True, survival="acceptance"),
])
def test_policies_are_lossless(models, references, kind, policy):
    drafts = models.dflash.block_size - 1 if kind == "dflash" else models.pard.k
    eng = engine(models, kind, references, policy=BatchPolicy(max_drafts=drafts, cost=cost(), **policy), right_every=3)
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 1, 2, 2, 5]) == references


def test_verify_budget_cuts_verified_tokens(models, references):
    """A steep verify cost makes the budget verify fewer drafts than the full blocks."""
    drafts = models.dflash.block_size - 1
    steep = StepCost.from_table({1: 1.0, 2: 2.0, 64: 64.0})
    full = engine(models, "dflash", references, right_every=3)
    cut = engine(models, "dflash", references, right_every=3,
                 policy=BatchPolicy(max_drafts=drafts, verify_budget=True, cost=steep))
    assert generate_batched(full, PROMPTS[:3], MAX_NEW) == generate_batched(cut, PROMPTS[:3], MAX_NEW) == references[:3]
    assert cut.stats.verify_rows / cut.stats.steps < full.stats.verify_rows / full.stats.steps


def test_padding_to_the_longest_verifies_more_than_ragged(models, references):
    drafts = models.dflash.block_size - 1
    common = dict(max_drafts=drafts, verify_budget=True, cost=cost())
    ragged = engine(models, "dflash", references, policy=BatchPolicy(**common))
    padded = engine(models, "dflash", references, policy=BatchPolicy(ragged=False, **common))
    assert generate_batched(ragged, PROMPTS, MAX_NEW) == generate_batched(padded, PROMPTS, MAX_NEW) == references
    assert ragged.stats.padded_rows == 0 and padded.stats.padded_rows > 0


def test_spec_control_turns_off_a_request_that_never_accepts(models, references):
    """With the tiny drafter's own (wrong) guesses a request stops drafting after its warm-up,
    drafting again only to probe."""
    drafts = models.pard.k
    policy = BatchPolicy(max_drafts=drafts, spec_control=True, cost=cost(), warmup_steps=1, probe_every=4)
    eng = BatchEngine(models.target, models.pard, eos_token_id=models.cfg.eos_token_id, policy=policy,
                      config=BatchConfig(max_batch=2, capacity=64))
    eng.admit("a", PROMPTS[0], RequestParams(MAX_NEW))
    out = []
    while not eng.done("a"):
        out += eng.step()["a"]
    assert out == references[0]
    verified = eng.request("a").verified
    assert verified[0] == drafts and verified.count(0) >= len(verified) // 2


def test_spec_control_runs_the_batch_ar_when_drafting_costs_too_much(models, references):
    drafts = models.pard.k
    dear = StepCost.from_table({1: 1.0, 64: 64.0}, {1: 100.0})  # drafting dwarfs a verify
    policy = BatchPolicy(max_drafts=drafts, spec_control=True, cost=dear, warmup_steps=0, probe_every=10_000)
    eng = engine(models, "pard", references, policy=policy)
    assert generate_batched(eng, PROMPTS[:3], MAX_NEW) == references[:3]
    assert eng.stats.drafted_requests == 0 and eng.stats.ar_steps == eng.stats.steps


def test_buckets_pad_the_verify_and_stay_lossless(models, references):
    eng = engine(models, "dflash", references, buckets=(8, 16, 32))
    assert generate_batched(eng, PROMPTS[:4], MAX_NEW) == references[:4]
    assert eng.stats.padded_rows > 0


@pytest.mark.parametrize("params, match", [
    (RequestParams(4, temperature=0.7, top_p=1.5), "top_p must be in"),
    (RequestParams(60), "KV slots"),
    (RequestParams(-1), "max_new_tokens"),
])
def test_admission_refuses_what_it_cannot_run(models, references, params, match):
    eng = engine(models, "dflash", references)
    with pytest.raises(ValueError, match=match):
        eng.admit("a", PROMPTS[0], params)
    assert eng.active() == []


def test_admission_past_max_batch_is_refused(models, references):
    eng = engine(models, "ar", references, max_batch=1)
    eng.admit("a", PROMPTS[0], RequestParams(4))
    with pytest.raises(RuntimeError, match="slots are taken"):
        eng.admit("b", PROMPTS[1], RequestParams(4))
    with pytest.raises(ValueError, match="already active"):
        eng.admit("a", PROMPTS[1], RequestParams(4))


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_ragged_attention_reference_is_per_request_attention(counts, data):
    """Packed rows attend exactly as each request alone would (its slot, its past, its mask)."""
    g = torch.Generator().manual_seed(len(counts))
    slots = data.draw(st.permutations(range(5)))[:len(counts)]
    pasts = [data.draw(st.integers(0, 9)) for _ in counts]
    trees = data.draw(st.booleans())
    masks = tuple(torch.rand(c, c, generator=g).lt(0.5).tril() | torch.eye(c, dtype=torch.bool) for c in counts)
    r = Ragged(tuple(slots), tuple(pasts), tuple(counts), masks if trees else "causal", torch.device("cpu"))
    k = torch.randn(5, 2, 16, 8, generator=g)
    v = torch.randn(5, 2, 16, 8, generator=g)
    q = torch.randn(r.rows, 4, 8, generator=g)
    out = ragged_attention_reference(q, k, v, r)
    for i, (s, p, c, start) in enumerate(zip(slots, pasts, counts, r.starts)):
        mask = build_mask(masks[i] if trees else "causal", p, c, q.device)
        alone = attend(q[start:start + c].transpose(0, 1)[None], k[s:s + 1, :, :p + c], v[s:s + 1, :, :p + c], mask)
        torch.testing.assert_close(out[start:start + c], alone[0].transpose(0, 1))


@pytest.mark.interpreter
@pytest.mark.slow
def test_engine_on_the_ragged_split_kv_kernel_equals_batch1(models, references):
    """The batched engine with split-KV's ragged mode (the interpreter on a CPU) as its attention."""
    from specpilot.backends.kernel_hooks import ragged_attention

    eng = engine(models, "dflash", references, max_batch=2, right_every=3)
    eng.attention = ragged_attention(torch.device("cpu"))
    assert generate_batched(eng, PROMPTS[:3], 5, arrivals=[0, 0, 1]) == [r[:5] for r in references[:3]]


@pytest.mark.parametrize("alpha, accepted", [(1.0, None), (0.0, 0)])
def test_batch_replay_plans_follow_each_request(models, references, alpha, accepted):
    """Per-request replay plans: planned to accept every draft, each speculative step accepts the
    whole block (but where the output ends); planned to accept none, none."""
    from specpilot.profiles import AcceptDistribution
    from specpilot.runtime.batch_replay import BatchReplay

    drafts, n = models.dflash.block_size - 1, 30
    truth = {i: generate_ar(models.target, PROMPTS[i], max_new_tokens=n, eos_token_id=None).tokens for i in (0, 3)}
    hook = BatchReplay(AcceptDistribution.chain([alpha], drafts), slots=3, size=64, device="cpu")
    for i, r in truth.items():
        hook.suggest(PROMPTS[i], r)
    eng = BatchEngine(models.target, models.dflash, eos_token_id=None,
                      config=BatchConfig(max_batch=2, capacity=64), draft_hook=hook)
    eng.admit("a", PROMPTS[0], RequestParams(n))
    eng.admit("b", PROMPTS[3], RequestParams(n))
    while not (eng.done("a") and eng.done("b")):
        eng.step()
    for rid, i in (("a", 0), ("b", 3)):
        req = eng.request(rid)
        assert req.out.tokens == truth[i]
        full = req.accepted[:-1]  # the last step may be cut by max_new_tokens
        assert full and all(n == (drafts if accepted is None else accepted) for n in full)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["chain", "graphs", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_the_gpu_kernel_passes_token_forcing(tiny_model_dirs, dtype, mode):
    """On a GPU: the batched engine over split-KV's ragged mode (chains eager or as CUDA-graph
    replays, trees under their ancestor masks), requests joining over steps; every output token forced against the stock target (bf16
    near-ties are benign, as for every loop)."""
    from specpilot.runtime.batch import graph_buckets

    from specpilot.backends.kernel_hooks import ragged_attention
    from specpilot.runtime.load import load_drafter, load_target
    from specpilot.validate.forcing import force_tokens

    dirs = tiny_model_dirs["qwen3"]
    target, cfg = load_target(dirs["target"], dtype=dtype, device="cuda")
    drafter = load_drafter(dirs["dflash"], target, cfg, dtype=dtype, device="cuda")
    graphs = mode == "graphs"
    config = BatchConfig(max_batch=4, capacity=128, graphs=graphs, buckets=graph_buckets(32) if graphs else ())
    eng = BatchEngine(target, drafter, eos_token_id=cfg.eos_token_id, config=config,
                      attention=ragged_attention(torch.device("cuda")), tree=(8, 2) if mode == "tree" else None)
    outs = generate_batched(eng, PROMPTS, 24, arrivals=[0, 0, 1, 2, 5, 5])
    report = force_tokens(target, cfg, PROMPTS, outs, "float32" if dtype == torch.float32 else "bfloat16")
    assert report.passed and report.tokens_checked == sum(map(len, outs))
    assert not graphs or all(step[3].graph is not None for step in eng.graphed.steps.values())  # captured
    assert not graphs or (eng.graphed_draft.steps and eng.graphed_draft.replays["eager"] == 0
                          and all(step[-1].graph is not None for step in eng.graphed_draft.steps.values()))
    if dtype == torch.float32:
        refs = [generate_ar(target, p, max_new_tokens=24, eos_token_id=cfg.eos_token_id).tokens for p in PROMPTS]
        assert outs == refs


@pytest.mark.parametrize("ragged", [True, False])
def test_a_batch_wide_first_level_verifies_what_the_budget_pays_for(models, references, ragged):
    """Two-level verification at batch > 1 (drafter first level, verify-budget's choice): every
    request's tree of 12 drafted nodes, then the batch's best nodes by survival, at most 4 a drafting
    request, as many as the step-cost table pays for. A flat cost verifies the most, a steep one
    fewer; outputs stay each request's batch-1 AR output."""
    drafts = models.dflash.block_size - 1
    rows = {}
    for name, cost in (("flat", StepCost.from_table({1: 1.0, 512: 1.0})),
                       ("steep", StepCost.from_table({1: 1.0, 512: 512.0}))):
        policy = BatchPolicy(max_drafts=drafts, verify_budget=True, ragged=ragged, cost=cost)
        eng = engine(models, "dflash", references, policy=policy, right_every=4)
        eng.tree, eng.keep = (12, 3), 4
        assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 0, 1, 2, 2]) == references
        assert eng.stats.pruned_nodes > 0
        # ragged: anchors + at most keep a request on average; padded: every request to the longest kept tree
        assert eng.stats.verify_rows <= eng.stats.steps * eng.max_batch * (1 + (4 if ragged else 12))
        rows[name] = eng.stats.verify_rows / eng.stats.steps
    assert rows["steep"] < rows["flat"]
    with pytest.raises(ValueError, match="keep=0"):
        BatchEngine(models.target, models.dflash, eos_token_id=None, tree=(8, 2), keep=0)
    eng = engine(models, "dflash", references, policy=BatchPolicy(max_drafts=drafts, ragged=True), right_every=4)
    eng.tree, eng.keep = (12, 3), 4  # no verify budget: keep a request on average, the batch's best survivals
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 0, 1, 2, 2]) == references
    assert eng.stats.pruned_nodes > 0 and eng.stats.verify_rows <= eng.stats.steps * eng.max_batch * (1 + 4)


@pytest.mark.parametrize("kind", ["dflash", "ar"])
def test_graphed_verify_buckets_equal_batch1(models, references, kind):
    """The verify forward over preallocated inputs a (bucket, rows a request) shape (what a CUDA graph
    replays; on a CPU it runs as is): the same outputs, one runner a shape."""
    drafter = models.dflash if kind == "dflash" else None
    eng = BatchEngine(models.target, drafter, eos_token_id=models.cfg.eos_token_id,
                      config=BatchConfig(max_batch=3, capacity=64, buckets=(4, 8, 16, 32), graphs=True),
                      draft_hook=oracle(references, 3) if drafter is not None else None)
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 1, 2, 2, 5]) == references
    assert eng.graphed.steps and all(rows in (4, 8, 16, 32) for rows, _ in eng.graphed.steps)
    assert kind == "ar" or eng.stats.tau > 1.5  # acceptance (in the graph) kept the planted drafts


@pytest.mark.parametrize("kind, max_batch", [("dflash", 3), ("pard", 3), ("dflash", 5), ("pard", 5)])
def test_graphed_drafting_drafts_what_the_eager_engine_drafts(models, references, kind, max_batch):
    """The drafter's forwards over preallocated inputs a shape (GraphedDraft: DFlash's context update
    and block pass, PARD's forward and head) with the verify's, requests joining and leaving, spec
    control varying each request's draft length: step for step the drafter's logits (and so its
    drafts) are the eager engine's, every output its batch-1 AR output, and every drafter forward
    went through a graph's shape."""
    drafts = models.dflash.block_size - 1 if kind == "dflash" else models.pard.k
    runs = {}
    for graphs in (False, True):
        seen = []
        plant = oracle(references, 3)

        def hook(logits, reqs, first, seen=seen, plant=plant):
            seen.append(([q.rid for q in reqs], list(first), logits.clone()))
            return plant(logits, reqs, first)
        policy = BatchPolicy(max_drafts=drafts, spec_control=True, cost=cost(), warmup_steps=1, probe_every=3)
        eng = BatchEngine(models.target, models.dflash if kind == "dflash" else models.pard,
                          eos_token_id=models.cfg.eos_token_id, policy=policy, draft_hook=hook,
                          config=BatchConfig(max_batch=max_batch, capacity=64, buckets=(4, 8, 16, 32), graphs=graphs))
        assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 1, 1, 2, 4, 6]) == references
        runs[graphs] = seen, eng
    (eager, _), (graphed, eng) = runs[False], runs[True]
    assert len(graphed) == len(eager) > 3
    for (rids, first, logits), (g_rids, g_first, g_logits) in zip(eager, graphed):
        assert (g_rids, g_first) == (rids, first) and g_logits.shape == logits.shape
        assert torch.equal(g_logits.argmax(-1), logits.argmax(-1))
        torch.testing.assert_close(g_logits, logits, rtol=1e-5, atol=1e-5)
    assert len({len(rids) for rids, _, _ in graphed}) > 1  # the drafting batch changed size
    served = eng.graphed_draft.replays
    assert served["eager"] == 0 and served["block" if kind == "dflash" else "pard"] == len(graphed)
    assert kind == "pard" or served["context"] > 0
    padded = {key[-1] for key in eng.graphed_draft.steps if key[0] != "context"}
    assert padded <= {1, 2, 4, max_batch}


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(["dflash", "pard"]), budget=st.integers(1, 12), topk=st.integers(1, 3),
       ragged=st.booleans(), arrivals=st.lists(st.integers(0, 4), min_size=6, max_size=6))
def test_batched_trees_equal_batch1(models, references, kind, budget, topk, ragged, arrivals):
    """Per-request best-first trees verified in one packed forward under their ancestor masks,
    each request's path compacted in its own slot: every output is its batch-1 AR output."""
    drafts = models.dflash.block_size - 1 if kind == "dflash" else models.pard.k
    eng = engine(models, kind, references, policy=BatchPolicy(max_drafts=drafts, ragged=ragged), right_every=4)
    eng.tree = (budget, topk)
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=arrivals) == references
    assert eng.stats.tau > 1.0  # the planted truth is the top-1 spine: trees accept it
