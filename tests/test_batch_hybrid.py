"""Hybrid (Gated DeltaNet + attention) targets in the batched engine (runtime/batch_hybrid.py): every
request's greedy output is its own batch-1 AR output whatever shares its batch, whenever it joins or
leaves and whichever slot it reuses; the verify of each request equals that request's batch-1 tree
forward; accept / reject steps leave each request's row exactly the state of its accepted tokens;
token forcing through `Engine.batched` on the zoo's hybrid pair; what is not built is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_tree
from specpilot.errors import EngineError
from specpilot.runtime.batch import (BatchConfig, BatchEngine, Ragged, SlotKV, generate_batched,
                                     ragged_attention_reference)
from specpilot.runtime.batch_control import BatchPolicy, StepCost
from specpilot.runtime.batch_hybrid import hybrid_ragged_forward, hybrid_slots
from specpilot.runtime.decode import generate_ar
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.hybrid_tree import (TreePending, commit_conv, commit_paths, commit_state, conv_sources,
                                           conv_tree, delta_rule_tree)
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tiny_hybrid import build_tiny_hybrid
from specpilot.runtime.tree import ancestor_mask

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 30], [42] * 13, [10, 20, 30, 40], [7], [250, 3, 250, 3, 9]]
MAX_NEW = 10
RAISE = 1.0e4
# fp32: a chain over the same tokens moves by ~5e-5 with how it is cut into forwards (test_hybrid_tree.py)
STATE_TOL = dict(atol=2e-4, rtol=1e-3)
ODD = {"linear_key_head_dim": 12, "linear_value_head_dim": 20, "linear_conv_kernel_dim": 3,
       "linear_num_key_heads": 1, "linear_num_value_heads": 3, "full_attention_interval": 3, "num_layers": 3}


class Pair:
    def __init__(self, root, **overrides) -> None:
        dirs = build_tiny_hybrid(root, **overrides)
        self.target, self.cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
        self.dflash = load_drafter(dirs["dflash"], self.target, self.cfg, dtype=torch.float32, device="cpu")
        self.pard = load_drafter(dirs["pard"], self.target, self.cfg, dtype=torch.float32, device="cpu")
        self.refs = [generate_ar(self.target, p, max_new_tokens=MAX_NEW, eos_token_id=None).tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return {"default": Pair(tmp_path_factory.mktemp("hybrid")), "odd": Pair(tmp_path_factory.mktemp("odd"), **ODD)}


def oracle(pair: Pair, right_every: int):
    """Plants the AR truth at every position not a multiple of `right_every`: acceptance varies per
    request and step, whole blocks rejected among them (the tiny drafters' own guesses are mostly wrong)."""
    truths = {tuple(p): p + r for p, r in zip(PROMPTS, pair.refs)}

    def hook(logits, reqs, first):
        for b, (q, pos) in enumerate(zip(reqs, first)):
            truth = truths[tuple(q.prompt)]
            for j in range(logits.shape[1]):
                if pos + j < len(truth) and (pos + j) % right_every:
                    logits[b, j, truth[pos + j]] = RAISE
        return logits
    return hook


def engine(pair: Pair, kind: str, *, max_batch: int = 3, right_every: int = 3, tree=None, policy=None,
           buckets=()) -> BatchEngine:
    drafter = {"dflash": pair.dflash, "pard": pair.pard, "ar": None}[kind]
    return BatchEngine(pair.target, drafter, eos_token_id=None, policy=policy, tree=tree,
                       config=BatchConfig(max_batch=max_batch, capacity=64, buckets=buckets),
                       draft_hook=oracle(pair, right_every) if drafter is not None else None)


# --- the batched rule against one request at a time ------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       kernel=st.sampled_from([2, 3, 4]))
def test_a_tree_a_batch_row_equals_each_row_alone(seed, sizes, kernel):
    """delta_rule_tree, conv_sources / conv_tree and commit_paths over trees [B, T, T] (shorter trees
    padded with lone nodes) give each row what its own tree alone gives."""
    g = torch.Generator().manual_seed(seed)
    b, h, t, dk, dv, c = len(sizes), 2, max(sizes), 5, 7, 6
    trees = [random_tree(seed + i, n, 50) for i, n in enumerate(sizes)]
    anc = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
    for i, tree in enumerate(trees):
        anc[i, :tree.size, :tree.size] = ancestor_mask(tree)
    q, k = torch.randn(b, h, t, dk, generator=g), torch.randn(b, h, t, dk, generator=g)
    v, s0 = torch.randn(b, h, t, dv, generator=g), torch.randn(b, h, dk, dv, generator=g)
    decay, beta = -torch.rand(b, h, t, generator=g) * 2, torch.rand(b, h, t, generator=g)
    conv0, inputs = torch.randn(b, c, kernel - 1, generator=g), torch.randn(b, c, t, generator=g)
    weight = torch.randn(c, 1, kernel, generator=g)
    out, kn, w, cum_g = delta_rule_tree(q, k, v, decay, beta, s0, anc)
    sources = conv_sources(anc, kernel)
    mixed = conv_tree(conv0, inputs, weight, sources)
    paths, accepted = [], []
    for i, tree in enumerate(trees):
        n = tree.size
        one = (slice(i, i + 1), slice(None), slice(0, n))
        alone = delta_rule_tree(q[one], k[one], v[one], decay[one], beta[one], s0[i:i + 1], anc[i, :n, :n])
        for got, want in zip((out, kn, w, cum_g), alone):
            torch.testing.assert_close(got[one], want, atol=2e-5, rtol=1e-5)
        own = conv_sources(anc[i, :n, :n], kernel)
        assert torch.equal(sources[i, :n], own)
        torch.testing.assert_close(mixed[i:i + 1, :, :n],
                                   conv_tree(conv0[i:i + 1], inputs[i:i + 1, :, :n], weight, own))
        node = int(torch.randint(0, n, (1,), generator=g))
        path = torch.nonzero(anc[i, node, :n]).flatten().tolist()
        paths.append(path)
        window = torch.cat([conv0[i:i + 1], inputs[i:i + 1, :, :n]], -1)
        full = torch.ones(len(path), dtype=torch.bool)
        accepted.append((commit_state(s0[i:i + 1], *alone[1:], torch.tensor(path), full),
                         commit_conv(TreePending(*alone[1:], window, own), torch.tensor([path[-1]]), kernel)))
    longest = max(map(len, paths))
    padded = torch.tensor([p + [0] * (longest - len(p)) for p in paths])
    state, conv = commit_paths(s0, TreePending(kn, w, cum_g, torch.cat([conv0, inputs], -1), sources), padded,
                               torch.tensor([len(p) - 1 for p in paths]))
    for i, (s, cv) in enumerate(accepted):
        torch.testing.assert_close(state[i:i + 1], s, atol=2e-5, rtol=1e-5)
        assert torch.equal(conv[i:i + 1], cv)


@pytest.mark.parametrize("which", ["default", "odd"])
def test_the_batched_verify_equals_each_request_alone(pairs, which):
    """hybrid_ragged_forward over requests of odd prompt lengths in scattered slots, each verifying a
    tree, a chain or its anchor alone (ragged, padded to a bucket): every request's logits and hidden
    rows are its batch-1 forward's over its own cache; nothing is committed before the commit; the
    commit of one root path a request leaves its row and K/V as the batch-1 cache's commit_path."""
    pair = pairs[which]
    model, dev = pair.target, torch.device("cpu")
    prompts = [PROMPTS[0], PROMPTS[4], PROMPTS[2], PROMPTS[1]]
    chain = ([3, 1, 4, 1, 5], torch.ones(5, 5, dtype=torch.bool).tril(), torch.arange(5))
    anchor = ([9], torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    trees = [random_tree(1, 7, 258), random_tree(2, 11, 258, pad=2)]
    steps = [(t.token.tolist(), ancestor_mask(t), t.depth) for t in trees]
    steps = [steps[0], chain, steps[1], anchor]
    keep = [5, 2, 9, 0]  # the node whose root path each request accepts
    cache, states = hybrid_slots(model, 6, 64)
    kv = SlotKV(cache, 6)
    slots = (4, 0, 2, 3)
    layers = (0, len(model.model.layers) - 1)
    with torch.inference_mode():
        r = Ragged(slots, (0,) * 4, tuple(map(len, prompts)), "causal", dev)
        hybrid_ragged_forward(model, kv, states, torch.tensor(sum(prompts, [])), r, ragged_attention_reference,
                              prefill=True)
        committed = [x.clone() for x in (*states.state, *states.conv)]
        counts = tuple(len(tokens) for tokens, _, _ in steps)
        positions = [len(p) + depth for p, (_, _, depth) in zip(prompts, steps)]
        r = Ragged(slots, tuple(map(len, prompts)), counts, tuple(mask for _, mask, _ in steps), dev,
                   positions=torch.cat(positions), pad_to=sum(counts) + 3, pad_slot=5)
        ids = [t for tokens, _, _ in steps for t in tokens]
        x, hidden = hybrid_ragged_forward(model, kv, states, torch.tensor(ids + [0, 0, 0]), r,
                                          ragged_attention_reference, layers)
        assert all(torch.equal(a, b) for a, b in zip(committed, (*states.state, *states.conv)))
        logits = model.head(x[:r.rows])
        paths, alone = [], []
        for i, (p, (tokens, mask, _)) in enumerate(zip(prompts, steps)):
            cache1 = model.new_cache(1, 64)
            model(torch.tensor([p]), cache1)
            want = model(torch.tensor([tokens]), cache1, mask=mask, positions=positions[i][None], hidden_layers=layers)
            rows = slice(r.starts[i], r.starts[i] + counts[i])
            torch.testing.assert_close(logits[rows], want.logits[0], atol=2e-4, rtol=0)
            torch.testing.assert_close(hidden[rows], want.hidden[0], atol=2e-4, rtol=2e-4)
            paths.append(torch.nonzero(mask[keep[i]]).flatten().tolist())  # ancestors precede: root first
            cache1.commit_path(len(p), paths[-1])
            alone.append(cache1)
        states.commit(paths)
        assert states.pending is None
        for i, (slot, cache1) in enumerate(zip(slots, alone)):
            kv.compact(slot, len(prompts[i]), [len(prompts[i]) + j for j in paths[i]])
            assert kv.lengths[slot] == cache1.length == len(prompts[i]) + len(paths[i])
            for a, b in zip((*states.state, *states.conv), (*cache1.state, *cache1.conv)):
                torch.testing.assert_close(a[slot], b[0], **STATE_TOL)
            for a, b in zip(kv.cache.k + kv.cache.v, cache1.kv.k + cache1.kv.v):
                torch.testing.assert_close(a[slot, :, :cache1.length], b[0, :, :cache1.length], atol=1e-5, rtol=1e-5)


# --- the engine ------------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(which=st.sampled_from(["default", "odd"]), kind=st.sampled_from(["dflash", "pard", "ar"]),
       tree=st.sampled_from([None, (6, 2), (11, 3)]), max_batch=st.integers(1, 4),
       order=st.permutations(range(len(PROMPTS))), arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
       right_every=st.integers(2, 6))
def test_every_request_equals_its_batch1_ar(pairs, which, kind, tree, max_batch, order, arrivals, right_every):
    """Chains or trees, requests of odd prompt lengths joining at drawn steps (waiting while the slots
    are full, so slots are reused), leaving when done, in any order: each its batch-1 AR output."""
    pair = pairs[which]
    prompts = [PROMPTS[i] for i in order]
    eng = engine(pair, kind, max_batch=max_batch, right_every=right_every, tree=tree if kind != "ar" else None)
    assert generate_batched(eng, prompts, MAX_NEW, arrivals=arrivals) == [pair.refs[i] for i in order]
    assert eng.free == list(range(max_batch)) and eng.states.pending is None


@pytest.mark.parametrize("kind, tree", [("dflash", None), ("pard", (8, 2))])
def test_a_reused_slot_starts_from_an_empty_state(pairs, kind, tree):
    """One slot, requests one after another: each starts from a zeroed row (a request admitted
    into a slot whose row still held its predecessor's state would not give its AR output)."""
    pair = pairs["default"]
    eng = engine(pair, kind, max_batch=1, tree=tree)
    assert generate_batched(eng, PROMPTS[:4], MAX_NEW) == pair.refs[:4]
    eng.admit("x", PROMPTS[0], RequestParams(MAX_NEW))
    assert all(not x[0].any() for x in (*eng.states.state, *eng.states.conv))


@pytest.mark.parametrize("which", ["default", "odd"])
@pytest.mark.parametrize("kind, tree", [("dflash", None), ("pard", None), ("dflash", (9, 3)), ("pard", (6, 2))])
def test_accept_and_reject_steps_leave_exactly_the_accepted_state(pairs, which, kind, tree):
    """The stale-state class of bug: after every step, whatever each request accepted or rejected
    (planted truths at varying positions, whole blocks rejected among them; requests joining and
    leaving), its row of every Gated DeltaNet layer and its K/V are those of a fresh batch-1 run
    over the tokens it committed, and a step accepted and rejected drafts."""
    pair = pairs[which]
    model = pair.target
    eng = engine(pair, kind, max_batch=3, right_every=4, tree=tree)
    pending = [("a", 0, 0), ("b", 2, 0), ("c", 5, 1), ("d", 1, 3)]
    checked, steps = 0, []
    for step in range(40):
        for rid, i, at in list(pending):
            if at <= step and len(eng.active()) < eng.max_batch:
                eng.admit(rid, PROMPTS[i], RequestParams(MAX_NEW))
                pending.remove((rid, i, at))
        eng.step()
        for rid in eng.active():
            q = eng.request(rid)
            kept = q.seq[:-1]  # the last token is the next step's anchor, not in the caches yet
            fresh = model.new_cache(1, 64)
            with torch.inference_mode():
                for s in range(0, len(kept), 3):  # a chain cut into forwards of a few tokens
                    model(torch.tensor([kept[s:s + 3]]), fresh)
            assert eng.kv.lengths[q.slot] == fresh.length == len(kept)
            for a, b in zip((*eng.states.state, *eng.states.conv), (*fresh.state, *fresh.conv)):
                torch.testing.assert_close(a[q.slot], b[0], **STATE_TOL)
            for a, b in zip(eng.kv.cache.k + eng.kv.cache.v, fresh.kv.k + fresh.kv.v):
                torch.testing.assert_close(a[q.slot, :, :fresh.length], b[0, :, :fresh.length], **STATE_TOL)
            checked += 1
        for rid in eng.active():
            if eng.done(rid):
                q = eng.request(rid)
                steps += [(a, v) for a, v in zip(q.accepted, (v for v in q.verified if v))]
                assert eng.output(rid) == pair.refs[PROMPTS.index(eng.request(rid).prompt)]
                eng.release(rid)
        if not pending and not eng.active():
            break
    assert not eng.active() and checked > 10
    assert any(0 < a for a, _ in steps) and any(a < v for a, v in steps)  # drafts accepted, drafts rejected


@pytest.mark.parametrize("policy", [dict(verify_budget=True), dict(verify_budget=True, ragged=False),
                                    dict(spec_control=True)])
def test_batch_policies_stay_lossless(pairs, policy):
    """verify-budget (ragged or padded to the longest share) and spec control only change how many
    drafts each request verifies; verify forwards padded to buckets too."""
    pair = pairs["default"]
    cost = StepCost.from_table({1: 1.0, 8: 1.2, 16: 1.6, 64: 4.0}, {1: 0.3, 4: 0.4})
    eng = engine(pair, "dflash", policy=BatchPolicy(max_drafts=pair.dflash.block_size - 1, cost=cost, **policy),
                 buckets=(8, 16, 32))
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 1, 2, 2, 5]) == pair.refs


def test_a_batch_wide_drafter_first_level_stays_lossless(pairs):
    """Two-level verification's drafter first level at batch: the batch's best nodes of every
    request's drafted tree of 12, at most 4 a request on average, verified over the hybrid's rows."""
    pair = pairs["default"]
    eng = BatchEngine(pair.target, pair.dflash, eos_token_id=None, tree=(12, 3), keep=4,
                      config=BatchConfig(max_batch=3, capacity=64), draft_hook=oracle(pair, 4))
    assert generate_batched(eng, PROMPTS, MAX_NEW, arrivals=[0, 0, 0, 1, 2, 2]) == pair.refs
    assert eng.stats.pruned_nodes > 0 and eng.stats.tau > 1.0


@pytest.mark.parametrize("kind, tree", [("dflash", None), ("pard", (5, 2))])
def test_a_sampled_request_gets_its_batch1_loops_tokens_whatever_shares_its_batch(pairs, kind, tree):
    """Rejection sampling (chains) or a draw a node (trees) over the hybrid's rows: a sampled request's
    tokens are its batch-1 loop's for its seed, alone or beside greedy and other sampled requests."""
    from specpilot.runtime import decode, tree_decode
    from specpilot.runtime.sampling import SamplingParams
    from specpilot.runtime.tiny_hybrid import MASK_TOKEN_ID

    pair, n, prompt = pairs["default"], 8, PROMPTS[5]
    for seed in range(2):
        common = dict(max_new_tokens=n, eos_token_id=None, sampling=SamplingParams(0.8, 0.9, seed),
                      mask_token_id=MASK_TOKEN_ID)
        if tree:
            want = tree_decode.generate_pard_tree(pair.target, pair.pard, prompt, k=pair.pard.k, budget=tree[0],
                                                  topk=tree[1], **common).tokens
        else:
            want = decode.generate_dflash(pair.target, pair.dflash, prompt, block_size=pair.dflash.block_size,
                                          **common).tokens
        params = RequestParams(n, temperature=0.8, top_p=0.9, seed=seed)
        got = {}
        for crowd in (False, True):
            eng = BatchEngine(pair.target, pair.dflash if kind == "dflash" else pair.pard, eos_token_id=None,
                              tree=tree, config=BatchConfig(max_batch=3, capacity=64))
            requests = {"s": (prompt, params)}
            if crowd:
                requests |= {"g": (PROMPTS[0], RequestParams(n)),
                             "x": (PROMPTS[2], RequestParams(n, temperature=1.0, seed=seed + 9))}
            for rid, (p, rp) in requests.items():
                eng.admit(rid, p, rp)
            out = {rid: [] for rid in requests}
            while not all(eng.done(rid) for rid in requests):
                for rid, tokens in eng.step().items():
                    out[rid] += tokens
            got[crowd] = out
        assert got[False]["s"] == got[True]["s"] == want
        assert got[True]["g"] == pair.refs[0][:n]


def test_what_is_not_built_for_hybrids_is_refused(pairs):
    pair = pairs["default"]
    with pytest.raises(ValueError, match="graphs is not built for hybrid"):
        BatchEngine(pair.target, pair.dflash, eos_token_id=None,
                    config=BatchConfig(max_batch=2, capacity=64, buckets=(8,), graphs=True))
    with pytest.raises(ValueError, match="not built for hybrid"):
        BatchEngine(pair.target, pair.dflash, eos_token_id=None, tree=(8, 2), keep=4, first="early-exit-split",
                    exit_layer=1)


# --- the zoo's hybrid pair through the engine API --------------------------------------------------


@pytest.fixture(scope="module")
def zoo_hybrid(tmp_path_factory):
    """The zoo's code-qwen3-next target and its DFlash drafter (block 16) as a torch engine, fp32."""
    from specpilot.backends.torch_backend import build_engine
    from specpilot.compiler import prepare
    from specpilot.runtime.tokenizer import load_tokenizer
    from specpilot.spec import load_spec

    spec = tmp_path_factory.mktemp("zoo") / "hybrid.yaml"
    spec.write_text("name: z\ntarget: code-qwen3-next\ndrafter:\n  kind: dflash\ngpu: h200\ndtype: float32\n"
                    "serving:\n  max_new_tokens: 12\nbenchmark:\n  prompts: code-smoke\n  num_prompts: 1\n")
    p = prepare(load_spec(spec), None, "cpu")
    engine = build_engine(p.program, p.dirs.target, p.dirs.drafter, p.device)
    tok = load_tokenizer(p.dirs.target)
    prompts = [tok.encode(t).ids for t in ("def add(a, b):", "class Stack:\n    def push(self, x):", "import os\n")]
    return engine, prompts


@pytest.mark.parametrize("passes", ["", "tree-verify{budget=16, topk=4}"])
def test_zoo_hybrid_pair_batched_passes_token_forcing(zoo_hybrid, passes):
    """`Engine.batched` on the hybrid pair (chains of its 16-token blocks, or trees): three prompts
    of different lengths, two slots, one joining late; every output token forced against the stock
    target, and each output is the engine's own batch-1 output."""
    from specpilot.dsl import parse_pipeline
    from specpilot.passes import run_passes
    from specpilot.validate.forcing import force_tokens

    engine, prompts = zoo_hybrid
    if passes:
        engine = engine.with_program(run_passes(engine.program, parse_pipeline(passes, source="test"))[0])
    batched = engine.batched(max_batch=2, capacity=128, attention=ragged_attention_reference)
    assert batched.states is not None and batched.tree == ((16, 4) if passes else None)
    outs = generate_batched(batched, prompts, 12, arrivals=[0, 0, 2])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) == 36
    assert outs == [engine.generate(p, 12).tokens for p in prompts]
    assert batched.stats.tau > 1.0
    with pytest.raises(EngineError, match="Gated DeltaNet hybrid"):
        engine.batched(max_batch=2, capacity=128, graphs=True)


def test_batching_passes_serve_the_zoo_hybrid_pair(zoo_hybrid):
    """verify-budget, ragged-verify and spec-control apply to the hybrid program, the verifier takes
    it, and the engine it builds (its step-cost table profiled on the hybrid's own forwards) passes
    token forcing; a two-level verify with an early-exit first
    level is left at batch 1 by the passes, and refused under policy 'continuous' by the verifier."""
    from specpilot.dsl import parse_pipeline
    from specpilot.ir.verify import program_problems
    from specpilot.passes import run_passes
    from specpilot.validate.forcing import force_tokens

    engine, prompts = zoo_hybrid
    program, records = run_passes(engine.program, parse_pipeline("verify-budget,ragged-verify,spec-control",
                                                                 source="test"))
    assert all(r.changed for r in records) and not program_problems(program)
    batched = engine.with_program(program).batched(max_batch=2, capacity=128, attention=ragged_attention_reference)
    assert batched.policy.verify_budget and batched.policy.ragged and batched.policy.spec_control
    assert batched.policy.cost is not None and batched.states.pending is None  # profiled here, nothing committed
    outs = generate_batched(batched, prompts, 12, arrivals=[0, 0, 2])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) == 36
    early = "two-level-verify{budget=4, draft-budget=8, topk=2, first=early-exit-split, exit-layer=1}"
    program, records = run_passes(engine.program, parse_pipeline(f"{early},verify-budget", source="test"))
    assert records[0].changed and not records[1].changed and "Gated DeltaNet" in records[1].summary
    name, node = program.step.one("schedule")
    continuous = program.with_graph("step", program.step.with_node(name, node.replace(policy="continuous", batch=2)))
    assert any("first=drafter" in p for p in program_problems(continuous))


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [None, (8, 2)])
def test_engine_on_the_gpu_kernels_passes_token_forcing(tmp_path, tree):
    """On a GPU: the tiny hybrid in the batched engine over split-KV's ragged mode and the gdn_tree
    kernel (a tree a request), requests joining over steps; every output token forced against the
    stock target, and in fp32 each output is its batch-1 AR output."""
    from specpilot.backends.kernel_hooks import install_gdn_tree, ragged_attention
    from specpilot.validate.forcing import force_tokens

    dirs = build_tiny_hybrid(tmp_path / "h")
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cuda")
    drafter = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cuda")
    install_gdn_tree(target, "triton")
    eng = BatchEngine(target, drafter, eos_token_id=None, config=BatchConfig(max_batch=4, capacity=128),
                      attention=ragged_attention(torch.device("cuda")), tree=tree)
    outs = generate_batched(eng, PROMPTS, 24, arrivals=[0, 0, 1, 2, 5, 5])
    report = force_tokens(target, cfg, PROMPTS, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs))
    assert outs == [generate_ar(target, p, max_new_tokens=24, eos_token_id=None).tokens for p in PROMPTS]
