"""The StepEngine adapter over the batch-1 loops (serve/batch1.py): interleaved requests get exactly the
engine's own output, step by step, greedy or sampled (seeded per request)."""

from __future__ import annotations

import dataclasses

import pytest

from specpilot.backends.torch_backend import build_engine
from specpilot.compiler import prepare
from specpilot.runtime.batch import BatchEngine, ragged_attention_reference
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.runtime.sampling import SamplingParams
from specpilot.serve.batch1 import Batch1StepEngine, ChainSession, WholeRunSession, sampling_params
from specpilot.serve.routed import batched_engine_for, step_engine_for
from specpilot.spec import load_spec

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):"]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """kind -> (engine, tokenizer) of the zoo pair, built once per module."""
    built = {}

    def get(kind: str, passes: str = "", pair: str = "code-qwen3"):
        if (kind, passes, pair) not in built:
            built[kind, passes, pair] = zoo_engine(tmp_path_factory.mktemp("spec"), kind, passes, pair)
        return built[kind, passes, pair]

    return get


def zoo_engine(tmp_path, kind: str, passes: str = "", pair: str = "code-qwen3"):
    spec = tmp_path / f"{kind}.yaml"
    spec.write_text(f"name: z\ntarget: {pair}\ndrafter:\n  kind: {kind}\ngpu: h200\nserving:\n  max_new_tokens: 8\n"
                    f"benchmark:\n  prompts: code-smoke\n  num_prompts: 1\npasses: \"{passes}\"\n")
    p = prepare(load_spec(spec), None, "cpu")
    return build_engine(p.program, p.dirs.target, p.dirs.drafter, p.device), load_tokenizer(p.dirs.target)


def run_all(step_engine: Batch1StepEngine, requests: dict[str, tuple[list[int], RequestParams]]):
    """Admit every request and step until a step gives no request a token; returns each request's
    tokens and how many steps gave it some."""
    for rid, (ids, params) in requests.items():
        step_engine.admit(rid, ids, params)
    out = {rid: [] for rid in requests}
    chunks = {rid: 0 for rid in requests}
    for _ in range(500):
        new = step_engine.step()
        if not any(new.values()):
            break
        for rid, tokens in new.items():
            out[rid] += tokens
            chunks[rid] += bool(tokens)
    return out, chunks


@pytest.mark.parametrize("pair, kind", [("code-qwen3", "pard"), ("code-qwen3", "dflash"), ("code-qwen3-next", "dflash")])
def test_interleaved_chain_sessions_equal_the_engines_own_loop(zoo, pair, kind):
    """Attention targets and the hybrid (Gated DeltaNet) one, whose rollback selects recurrent states."""
    engine, tok = zoo(kind, pair=pair)
    se = Batch1StepEngine(engine, max_batch=3)
    requests = {str(i): (tok.encode(p).ids, RequestParams(16)) for i, p in enumerate(PROMPTS)}
    out, chunks = run_all(se, requests)
    assert isinstance(next(iter(se.sessions.values())), ChainSession)
    for rid, (ids, _) in requests.items():
        ref = engine.generate(ids, 16)
        assert out[rid] == ref.tokens
        assert chunks[rid] == 1 + ref.steps  # the prefill's token, then one speculative step per call


def test_a_tree_engine_hands_out_its_own_runs_steps(zoo):
    engine, tok = zoo("dflash", "tree-verify{budget=8}")
    se = Batch1StepEngine(engine, max_batch=2)
    ids = tok.encode(PROMPTS[0]).ids
    out, chunks = run_all(se, {"a": (ids, RequestParams(20))})
    assert isinstance(se.sessions["a"], WholeRunSession)
    ref = engine.generate(ids, 20)
    assert out["a"] == ref.tokens and chunks["a"] == 1 + ref.steps


def test_admission_beyond_max_batch_is_refused_and_release_frees_the_slot(zoo):
    engine, tok = zoo("pard")
    se = Batch1StepEngine(engine, max_batch=1)
    se.admit("a", [5, 6], RequestParams(4))
    with pytest.raises(ValueError, match="max_batch is 1"):
        se.admit("b", [5, 6], RequestParams(4))
    se.release("a")
    se.admit("b", [5, 6], RequestParams(4))
    assert se.active() == ["b"]


@pytest.mark.parametrize("kind, passes", [("pard", ""), ("dflash", ""), ("dflash", "tree-verify{budget=8}")])
def test_sampled_requests_draw_what_the_engines_own_sampled_loop_draws(zoo, kind, passes):
    """Temperature > 0: lossless speculative sampling (runtime/sampling.py), seeded per request, so a
    request interleaved with others gets exactly the engine's own sampled run for its seed."""
    engine, tok = zoo(kind, passes)
    ids = tok.encode(PROMPTS[0]).ids
    se = Batch1StepEngine(engine, max_batch=4)
    requests = {"a": (ids, RequestParams(12, temperature=0.9, top_p=0.95, seed=1)),
                "b": (ids, RequestParams(12, temperature=0.9, top_p=0.95, seed=1)),
                "c": (ids, RequestParams(12, temperature=0.9, top_p=0.95, seed=2)),
                "g": (tok.encode(PROMPTS[1]).ids, RequestParams(12))}
    out, _ = run_all(se, requests)
    assert out["a"] == out["b"] != out["c"]
    assert out["a"] == engine.generate(ids, 12, SamplingParams(0.9, 0.95, seed=1)).tokens
    assert out["g"] == engine.generate(tok.encode(PROMPTS[1]).ids, 12).tokens


def test_seeds_map_into_the_runtimes_range():
    assert sampling_params(RequestParams(4)).greedy
    assert sampling_params(RequestParams(4, temperature=0.5, seed=-1)).seed == 2**64 - 1
    a, b = (sampling_params(RequestParams(4, temperature=0.5)).seed for _ in range(2))
    assert a != b  # no seed: a fresh one each request


@pytest.mark.parametrize("pair, kind", [("code-qwen3", "pard"), ("code-qwen3", "dflash"), ("code-qwen3-next", "dflash")])
def test_greedy_and_sampled_requests_share_the_batched_engine(zoo, pair, kind):
    """serve/routed.py: every request goes to the batched engine (runtime/batch.py; a hybrid target's
    recurrent state a row a request, runtime/batch_hybrid.py); greedy ones get each its own engine
    output, a sampled one its seed's tokens of the engine's own sampled loop."""
    engine, tok = zoo(kind, pair=pair)
    # the runtime's ragged SDPA: the suite's TRITON_INTERPRET would run the split-KV kernel in the interpreter
    step_engine, how = step_engine_for(engine, 3, engine.target_cfg.max_position_embeddings,
                                       attention=ragged_attention_reference)
    assert isinstance(step_engine, BatchEngine), how
    greedy = {str(i): (tok.encode(p).ids, RequestParams(12)) for i, p in enumerate(PROMPTS)}
    sampled = (tok.encode(PROMPTS[0]).ids, RequestParams(12, temperature=0.9, top_p=0.95, seed=3))
    for rid, (ids, params) in {**greedy, "s": sampled}.items():
        step_engine.admit(rid, ids, params)
    assert sorted(step_engine.active()) == sorted([*greedy, "s"])
    out = {rid: [] for rid in step_engine.active()}
    while any(not step_engine.done(rid) for rid in step_engine.active()):
        for rid, tokens in step_engine.step().items():
            out[rid] += tokens
    for rid, (ids, _) in greedy.items():
        assert out[rid] == engine.generate(ids, 12).tokens
    assert out["s"] == engine.generate(sampled[0], 12, SamplingParams(0.9, 0.95, seed=3)).tokens
    step_engine.release("0")
    assert "0" not in step_engine.active()


def test_engines_the_batched_engine_does_not_serve_run_one_after_another(zoo):
    """A replay drafter (per-request plans the server does not make), or batching turned off."""
    engine, _ = zoo("dflash")
    replay = dataclasses.replace(engine, replay=object())  # only whether it has one is read
    batched, why = batched_engine_for(replay, 2, 256)
    assert batched is None and "replay" in why
    step_engine, how = step_engine_for(replay, 2, 256)
    assert isinstance(step_engine, Batch1StepEngine) and "replay" in how
    step_engine, how = step_engine_for(engine, 2, 256, batching=False)
    assert isinstance(step_engine, Batch1StepEngine) and "turned off" in how
