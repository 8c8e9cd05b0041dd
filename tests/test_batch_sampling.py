"""Sampling in the batched engine (runtime/batch.py): greedy and sampled requests share one batch.

A sampled request draws from its own seeded uniforms and verifies its own number of drafts, so its
tokens are the batch-1 loop's for its seed, whatever shares its batch (chains: rejection sampling;
trees: one draw from p a node). Its distribution, sampled in batches of other requests, matches AR
sampling's by the chi-square test of tests/test_sampling.py (alpha 1e-3), and the same test catches
a planted bias (drafts accepted too often; every request of a batch drawing the same uniforms).
Greedy requests in a mixed batch keep their batch-1 AR output token for token.
"""

from __future__ import annotations

import pytest

from sampling_fixtures import K, MASK, PROMPT, Tiny
from specpilot.runtime import decode, sampling, tree_decode
from specpilot.runtime.batch import BatchConfig, BatchEngine
from specpilot.runtime.batch_control import BatchPolicy, StepCost
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.model import PardDrafter
from specpilot.runtime.sampling import SamplingParams
from specpilot.validate.sampling import ar_distribution, chi_square_check

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LENGTH = 3  # tokens per sampled continuation (as in test_sampling.py)
SAMPLES = 300
OTHERS = [(4, 0, 2, 2), (3, 3), (1, 4, 1, 4, 0)]  # prompts of the requests that share the batch
PARAMS = SamplingParams(temperature=0.8, top_p=0.9)
BUDGET, TOPK = 5, 2


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


def batch_engine(tiny: Tiny, kind: str, max_batch: int = 4, tree: bool = False, policy=None,
                 keep: int | None = None) -> BatchEngine:
    drafter = {"pard": PardDrafter(model=tiny.pard, mask_token_id=MASK, k=K), "dflash": tiny.dflash, "ar": None}[kind]
    return BatchEngine(tiny.target, drafter, eos_token_id=None, config=BatchConfig(max_batch=max_batch, capacity=32),
                       tree=(BUDGET, TOPK) if tree else None, policy=policy, keep=keep)


def batch1(tiny: Tiny, kind: str, tree: bool, prompt, n: int, params: SamplingParams) -> list[int]:
    """The batch-1 loop of `kind` (the serve path's ChainSession / Engine.generate)."""
    common = dict(max_new_tokens=n, eos_token_id=None, sampling=params)
    if kind == "ar":
        return decode.generate_ar(tiny.target, prompt, **common).tokens
    if tree:
        if kind == "pard":
            return tree_decode.generate_pard_tree(tiny.target, tiny.pard, prompt, k=K, budget=BUDGET, topk=TOPK,
                                                  mask_token_id=MASK, **common).tokens
        return tree_decode.generate_dflash_tree(tiny.target, tiny.dflash, prompt, block_size=K + 1, budget=BUDGET,
                                                topk=TOPK, mask_token_id=MASK, **common).tokens
    if kind == "pard":
        return decode.generate_pard(tiny.target, tiny.pard, prompt, k=K, mask_token_id=MASK, **common).tokens
    return decode.generate_dflash(tiny.target, tiny.dflash, prompt, block_size=K + 1, mask_token_id=MASK,
                                  **common).tokens


def run(engine: BatchEngine, requests: dict[str, tuple], arrivals: dict[str, int] | None = None) -> dict[str, list[int]]:
    """requests: rid -> (prompt, RequestParams); each admitted at its arrival step (default 0, as
    slots allow), released when done. Returns every request's tokens."""
    arrivals = arrivals or {}
    pending = sorted(requests, key=lambda rid: arrivals.get(rid, 0))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    step = 0
    while pending or engine.active():
        while pending and arrivals.get(pending[0], 0) <= step and len(engine.active()) < engine.max_batch:
            rid = pending.pop(0)
            engine.admit(rid, list(requests[rid][0]), requests[rid][1])
        for rid, tokens in engine.step().items():
            out[rid] += tokens
        for rid in engine.active():
            if engine.done(rid):
                engine.release(rid)
        step += 1
        assert step < 1000
    return out


def sampled(params: SamplingParams, seed: int, n: int = LENGTH) -> RequestParams:
    return RequestParams(n, temperature=params.temperature, top_p=params.top_p, seed=seed)


@pytest.mark.parametrize("kind, tree", [("pard", False), ("dflash", False), ("ar", False), ("pard", True),
                                        ("dflash", True)])
def test_a_sampled_request_gets_its_batch1_loops_tokens_whatever_shares_its_batch(tiny, kind, tree):
    """Alone, or beside greedy and other sampled requests that join at other steps: the same tokens,
    the batch-1 loop's for its seed. The greedy requests beside it keep their batch-1 AR output."""
    n = 8
    for seed in range(4):
        want = batch1(tiny, kind, tree, PROMPT, n, PARAMS.__class__(PARAMS.temperature, PARAMS.top_p, seed))
        alone = run(batch_engine(tiny, kind, tree=tree), {"s": (PROMPT, sampled(PARAMS, seed, n))})["s"]
        crowd = {"s": (PROMPT, sampled(PARAMS, seed, n)), "g0": (OTHERS[0], RequestParams(n)),
                 "x": (OTHERS[1], sampled(SamplingParams(1.0), seed + 100, n)), "g1": (OTHERS[2], RequestParams(6))}
        got = run(batch_engine(tiny, kind, tree=tree), crowd, arrivals={"g0": 0, "x": 0, "s": 1 + seed % 2, "g1": 2})
        assert alone == got["s"] == want, (kind, tree, seed)
        for rid in ("g0", "g1"):
            assert got[rid] == decode.generate_ar(tiny.target, crowd[rid][0], max_new_tokens=crowd[rid][1].max_new_tokens,
                                                  eos_token_id=None).tokens, (kind, tree, rid)


def test_batch_wide_policies_leave_a_sampled_requests_tokens_alone(tiny):
    """Under the verify budget, padding to the longest share and spec control (chains), and under
    two-level's batch-wide first level (trees), a greedy request's share moves with the batch; a
    sampled one keeps its own, so its tokens are the same alone and in a crowd (and greedy ones
    stay AR's)."""
    cost = StepCost.from_table({1: 1.0, 4: 1.1, 8: 3.0, 16: 9.0})
    chains = dict(policy=BatchPolicy(max_drafts=K, verify_budget=True, ragged=False, spec_control=True, cost=cost,
                                     survival="acceptance"))
    trees = dict(tree=True, keep=2, policy=BatchPolicy(max_drafts=K, verify_budget=True, ragged=False, cost=cost))
    for setup in (chains, trees):
        for seed in range(3):
            alone = run(batch_engine(tiny, "pard", **setup), {"s": (PROMPT, sampled(PARAMS, seed, 10))})["s"]
            crowd = {"s": (PROMPT, sampled(PARAMS, seed, 10)),
                     **{f"g{i}": (p, RequestParams(10)) for i, p in enumerate(OTHERS)}}
            got = run(batch_engine(tiny, "pard", **setup), crowd)
            assert got["s"] == alone, (setup, seed)
            for i, p in enumerate(OTHERS):
                assert got[f"g{i}"] == decode.generate_ar(tiny.target, p, max_new_tokens=10, eos_token_id=None).tokens


def sampled_in_batches(tiny: Tiny, kind: str, tree: bool, params: SamplingParams, samples: int,
                       max_batch: int = 16) -> list[tuple[int, ...]]:
    """`samples` seeded requests of PROMPT, LENGTH tokens each, run max_batch at a time with a greedy
    request and a differently seeded sampled request of other prompts in every batch."""
    out = []
    per = max_batch - 2
    for first in range(0, samples, per):
        seeds = range(first, min(first + per, samples))
        requests = {f"s{s}": (PROMPT, sampled(params, s)) for s in seeds}
        requests["g"] = (OTHERS[0], RequestParams(LENGTH + 2))
        requests["x"] = (OTHERS[1], sampled(SamplingParams(1.3), 10_000 + first))
        got = run(batch_engine(tiny, kind, max_batch, tree), requests, arrivals={"g": 0, "x": 1})
        out += [tuple(got[f"s{s}"]) for s in seeds]
    assert all(len(o) == LENGTH for o in out)
    return out


@pytest.mark.parametrize("kind, tree, params", [("pard", False, SamplingParams(1.0)),
                                                ("dflash", False, SamplingParams(0.7, 0.8)),
                                                ("dflash", True, SamplingParams(1.0))])
def test_sampled_requests_in_a_mixed_batch_keep_ar_sampling_distribution(tiny, kind, tree, params):
    """SAMPLES requests (each its own seed) in batches with others: 3-token continuations and first
    tokens against the exact AR distribution, chi-square at alpha 1e-3."""
    samples = sampled_in_batches(tiny, kind, tree, params, SAMPLES)
    check = chi_square_check(samples, ar_distribution(tiny.next_probs(params), LENGTH))
    assert check.passed, check.summary()
    first = chi_square_check([s[:1] for s in samples], ar_distribution(tiny.next_probs(params), 1))
    assert first.passed, first.summary()


def test_planted_biases_in_the_batched_engine_are_detected(tiny, monkeypatch):
    """The same test, 200 requests: drafts accepted with min(1, 2 p/q), and the requests of a batch
    drawing the same uniforms (one seed a batch, as a generator shared by the batch would), each
    fail it."""
    params = SamplingParams(1.0)
    exact = ar_distribution(tiny.next_probs(params), LENGTH)
    with monkeypatch.context() as m:
        m.setattr(sampling, "acceptance_probability", lambda p, q: (2 * p / q).clamp(max=1.0))
        check = chi_square_check(sampled_in_batches(tiny, "pard", False, params, 200), exact)
    assert not check.passed, check.summary()
    for_seed = sampling.StepRandom.for_seed
    with monkeypatch.context() as m:
        m.setattr(sampling.StepRandom, "for_seed", classmethod(lambda cls, seed, device: for_seed(seed // 14, device)))
        check = chi_square_check(sampled_in_batches(tiny, "pard", False, params, 200), exact)
    assert not check.passed, check.summary()


def test_bad_sampling_parameters_are_refused_at_admission(tiny):
    engine = batch_engine(tiny, "pard")
    with pytest.raises(ValueError, match="request 'a': top_p must be in"):
        engine.admit("a", list(PROMPT), RequestParams(4, temperature=0.5, top_p=0.0))
    assert engine.active() == [] and engine.free == list(range(4))


@pytest.mark.gpu
def test_sampled_and_greedy_requests_share_a_graphed_batch_on_cuda():
    """On a GPU, with the verify forwards as CUDA-graph replays by token bucket: greedy-only steps
    replay graphs, steps with a sampled request run eagerly; a sampled request still gets its batch-1
    loop's tokens for its seed (same device), and the greedy ones their batch-1 AR tokens."""
    from specpilot.backends.kernel_hooks import ragged_attention

    cuda = Tiny("cuda")
    drafter = PardDrafter(model=cuda.pard, mask_token_id=MASK, k=K)
    n = 8
    with pytest.raises(ValueError, match="need an attention that reads the Ragged's device tensors"):
        BatchEngine(cuda.target, drafter, eos_token_id=None,
                    config=BatchConfig(max_batch=4, capacity=32, buckets=(4, 8, 16), graphs=True))
    for seed in range(3):
        engine = BatchEngine(cuda.target, drafter, eos_token_id=None, attention=ragged_attention(cuda.target.device),
                             config=BatchConfig(max_batch=4, capacity=32, buckets=(4, 8, 16), graphs=True))
        crowd = {"s": (PROMPT, sampled(PARAMS, seed, n)), "g0": (OTHERS[0], RequestParams(n + 4)),
                 "g1": (OTHERS[2], RequestParams(n + 4))}
        got = run(engine, crowd, arrivals={"g0": 0, "g1": 0, "s": 2})
        assert engine.graphed.steps  # the greedy-only steps were replayed
        want = batch1(cuda, "pard", False, PROMPT, n, SamplingParams(PARAMS.temperature, PARAMS.top_p, seed))
        assert got["s"] == want, seed
        for rid in ("g0", "g1"):
            assert got[rid] == decode.generate_ar(cuda.target, crowd[rid][0], max_new_tokens=n + 4,
                                                  eos_token_id=None).tokens
