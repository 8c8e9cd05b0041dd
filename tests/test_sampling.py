"""Speculative sampling keeps the target's distribution (runtime/sampling.py, docs/SAMPLING.md).

A tiny-vocabulary model (V = 6) makes the target's distribution over 3-token continuations
enumerable (validate/sampling.py). Exact checks: one chain step and one tree step, enumerated
with the acceptance rules the loops run, equal AR sampling's distribution to float rounding, and a
planted wrong rule is off by a visible total variation. Statistical checks: seeded runs of the real
loops (AR, DFlash chain, PARD chain, PARD tree, DFlash tree) against the exact AR distribution by
chi-square at alpha = 1e-3, and the same test flags a loop with a planted bias (drafts accepted too
often; randomness reused across steps). The graphed loops (graph_decode) draw exactly what the eager
ones draw for the same seed.
"""

from __future__ import annotations

import pytest
import torch

from sampling_fixtures import K, MASK, PROMPT, V, Tiny
from specpilot.runtime import decode, graph_decode, sampling, tree_decode
from specpilot.runtime.sampling import (SamplingParams, StepRandom, acceptance_probability, probabilities,
                                        residual_distribution, sample_tokens, uniforms)
from specpilot.runtime.tree import accept_tree, ancestor_mask, best_first_tree, draft_topk
from specpilot.validate.sampling import (ar_distribution, chain_step_distribution, chi_square_check,
                                         total_variation, tree_step_distribution)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LENGTH = 3  # tokens per sampled continuation
SAMPLES = 300  # seeded runs per statistical check
EXACT = 1e-9  # total variation allowed between exact distributions that must be equal (float64 rounding)
PLANTED = 0.01  # total variation a planted wrong rule must at least show


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


PARAMS = (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.7, top_p=0.8, seed=0))


# --- the pieces --------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_nucleus_reaching_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 3.0, -2.0, 1.0]])
    for top_p in (0.3, 0.6, 0.9, 0.999, 1.0):
        got = probabilities(logits, SamplingParams(temperature=1.3, top_p=top_p))
        full = torch.softmax(logits.double() / 1.3, -1)
        for row, want in zip(got, full):
            order = want.argsort(descending=True).tolist()
            keep, mass = [], 0.0
            for t in order:  # brute force: add tokens by probability until the mass reaches top_p
                keep.append(t)
                mass += float(want[t])
                if mass >= top_p:
                    break
            expect = torch.zeros_like(want)
            expect[keep] = want[keep] / want[keep].sum()
            torch.testing.assert_close(row, expect)


def test_inverse_cdf_draw_is_exact_on_a_uniform_grid():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.125, 0.125], [0.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    m = 4096
    u = (torch.arange(m, dtype=torch.float64) + 0.5) / m
    for row in probs:
        draws = sample_tokens(row.expand(m, -1), u)
        freq = torch.bincount(draws, minlength=row.shape[0]).double() / m
        torch.testing.assert_close(freq, row, atol=1.0 / m, rtol=0)


def test_uniforms_are_uniform_independent_and_reproducible():
    key = StepRandom.for_seed(7, "cpu").key
    a = torch.cat([uniforms(key, step, sampling.STREAM_ACCEPT, 64) for step in range(200)])
    b = torch.cat([uniforms(key, step, sampling.STREAM_BONUS, 64) for step in range(200)])
    assert torch.equal(a, torch.cat([uniforms(key, step, sampling.STREAM_ACCEPT, 64) for step in range(200)]))
    bins = (a * 20).long()
    check = chi_square_check(bins.tolist(), {i: 1 / 20 for i in range(20)})
    assert check.passed, check.summary()
    pairs = ((a * 5).long() * 5 + (b * 5).long()).tolist()  # the two streams, jointly: 25 equal cells
    check = chi_square_check(pairs, {i: 1 / 25 for i in range(25)})
    assert check.passed, check.summary()
    assert not torch.equal(a, uniforms(StepRandom.for_seed(8, "cpu").key, 0, sampling.STREAM_ACCEPT, a.shape[0]))


def test_params_are_checked():
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(seed=-1), dict(seed=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


# --- exact: one speculative step, enumerated ---------------------------------------------------


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-p0.8"])
def test_chain_step_is_exactly_ar(tiny, params):
    """Rejection sampling (sampling.acceptance_probability, residual_distribution) with the PARD
    drafter's per-position q, and with an arbitrary q: the step's output, then AR, is AR's."""
    ar = ar_distribution(tiny.next_probs(params), LENGTH)
    for start in ((), (4,)):
        q_pard = tiny.pard_q(params, start)
        q_random = torch.softmax(torch.randn(K, V, generator=torch.Generator().manual_seed(3)).double() * 2, -1)
        for q in (q_pard, q_random):
            spec = chain_step_distribution(tiny.next_probs(params), lambda s, i: q[i], k=K, length=LENGTH - len(start),
                                           accept=acceptance_probability, residual=residual_distribution, start=start)
            want = {o: p for o, p in ar.items()} if not start else _conditional(ar, start)
            assert total_variation(spec, want) < EXACT


def _conditional(dist: dict, start: tuple) -> dict:
    total = sum(p for o, p in dist.items() if o[: len(start)] == start)
    return {o: p / total for o, p in dist.items() if o[: len(start)] == start}


def test_planted_chain_rule_errors_are_caught(tiny):
    params = PARAMS[0]
    ar = ar_distribution(tiny.next_probs(params), LENGTH)
    q = tiny.pard_q(params, ())
    planted = {
        "accepts too often": (lambda p, qd: (1.5 * p / qd).clamp(max=1.0), residual_distribution),
        "resamples from p after a rejection": (acceptance_probability, lambda p, qd: p),
        "accepts every draft": (lambda p, qd: torch.ones((), dtype=torch.float64), residual_distribution),
    }
    for name, (accept, residual) in planted.items():
        spec = chain_step_distribution(tiny.next_probs(params), lambda s, i: q[i], k=K, length=LENGTH,
                                       accept=accept, residual=residual)
        assert total_variation(spec, ar) > PLANTED, name


def _tree(tiny: Tiny, params: SamplingParams, budget: int):
    """The PARD drafter's best-first tree of `budget` nodes after PROMPT (what generate_pard_tree verifies)."""
    ids = torch.tensor([PROMPT + (MASK,) * (K - 1)])
    with torch.inference_mode():
        logits = tiny.pard(ids, tiny.pard.new_cache(1, ids.shape[1])).logits[0, -K:]
    logp, tok = draft_topk(logits, 2)
    return best_first_tree(logp, tok, PROMPT[-1], budget=budget)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-p0.8"])
def test_tree_step_is_exactly_ar(tiny, params):
    """One independent draw from p per node, then the greedy tree acceptance on the draws (eager
    tree.accept_tree and the graphed loops' accept_tree_on_device): AR's distribution."""
    tree = _tree(tiny, params, budget=3)
    parent, token = tree.parent.tolist(), tree.token.tolist()
    mask = ancestor_mask(tree)
    ar = ar_distribution(tiny.next_probs(params), LENGTH)

    def eager(draws):
        return accept_tree(tree, draws, mask)

    def device(draws):
        n, path, span = graph_decode.accept_tree_on_device(tree.parent, tree.depth, tree.token, mask,
                                                           torch.tensor(draws), K + 1)
        n = int(n)
        return path[: n + 1].tolist(), int(span[n])

    for rule in (eager, device):
        spec = tree_step_distribution(tiny.next_probs(params), parent, token, length=LENGTH, rule=rule)
        assert total_variation(spec, ar) < EXACT


def test_planted_tree_rule_error_is_caught(tiny):
    """Taking the first child whenever the root's draw misses every child accepts too often."""
    params = PARAMS[0]
    tree = _tree(tiny, params, budget=3)
    parent, token = tree.parent.tolist(), tree.token.tolist()

    def greedy_fallback(draws):
        path, bonus = accept_tree(tree, draws)
        if len(path) == 1:
            child = parent.index(0)
            return [0, child], draws[child]
        return path, bonus

    spec = tree_step_distribution(tiny.next_probs(params), parent, token, length=LENGTH, rule=greedy_fallback)
    assert total_variation(spec, ar_distribution(tiny.next_probs(params), LENGTH)) > PLANTED


# --- statistical: the real loops over many seeds -----------------------------------------------


def _loops(tiny: Tiny):
    t, common = tiny.target, dict(max_new_tokens=LENGTH, eos_token_id=None)
    return {
        "ar": lambda s: decode.generate_ar(t, PROMPT, sampling=s, **common),
        "dflash-chain": lambda s: decode.generate_dflash(t, tiny.dflash, PROMPT, block_size=K + 1, mask_token_id=MASK,
                                                         sampling=s, **common),
        "pard-chain": lambda s: decode.generate_pard(t, tiny.pard, PROMPT, k=K, mask_token_id=MASK, sampling=s,
                                                     **common),
        "pard-tree": lambda s: tree_decode.generate_pard_tree(t, tiny.pard, PROMPT, k=K, budget=5, topk=2,
                                                              mask_token_id=MASK, sampling=s, **common),
        "dflash-tree": lambda s: tree_decode.generate_dflash_tree(t, tiny.dflash, PROMPT, block_size=K + 1, budget=5,
                                                                  topk=2, mask_token_id=MASK, sampling=s, **common),
    }


def _graphed_loops(tiny: Tiny):
    """The same loops, one CUDA graph a step (graph_decode; on a CPU the step function runs as is)."""
    t, common = tiny.target, dict(max_new_tokens=LENGTH, eos_token_id=None)
    g = graph_decode
    return {
        "ar": lambda s: g.generate_ar_graphed(t, PROMPT, sampling=s, **common),
        "dflash-chain": lambda s: g.generate_dflash_graphed(t, tiny.dflash, PROMPT, block_size=K + 1,
                                                            mask_token_id=MASK, sampling=s, **common),
        "pard-chain": lambda s: g.generate_pard_graphed(t, tiny.pard, PROMPT, k=K, mask_token_id=MASK, sampling=s,
                                                        **common),
        "pard-tree": lambda s: g.generate_pard_tree_graphed(t, tiny.pard, PROMPT, k=K, budget=5, topk=2,
                                                            mask_token_id=MASK, sampling=s, **common),
        "dflash-tree": lambda s: g.generate_dflash_tree_graphed(t, tiny.dflash, PROMPT, block_size=K + 1, budget=5,
                                                                topk=2, mask_token_id=MASK, sampling=s, **common),
    }


def _sampled(loop, params: SamplingParams, n: int = SAMPLES) -> list[tuple[int, ...]]:
    out = []
    for seed in range(n):
        g = loop(SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed))
        assert len(g.tokens) == LENGTH
        out.append(tuple(g.tokens))
    return out


LOOP_PARAMS = {"ar": PARAMS[0], "dflash-chain": PARAMS[1], "pard-chain": PARAMS[0], "pard-tree": PARAMS[1],
               "dflash-tree": PARAMS[0]}


@pytest.mark.parametrize("name", list(LOOP_PARAMS))
def test_sampled_loop_matches_ar_distribution(tiny, name):
    """SAMPLES seeded runs of 3 tokens against the exact AR distribution (chi-square, alpha 1e-3:
    a correct loop fails with probability 1e-3 over the choice of seeds), and the first token alone."""
    params = LOOP_PARAMS[name]
    samples = _sampled(_loops(tiny)[name], params)
    exact = ar_distribution(tiny.next_probs(params), LENGTH)
    check = chi_square_check(samples, exact)
    assert check.passed, f"{name}: {check.summary()}"
    first = chi_square_check([s[:1] for s in samples], ar_distribution(tiny.next_probs(params), 1))
    assert first.passed, f"{name}, first token: {first.summary()}"


@pytest.mark.parametrize("name", list(LOOP_PARAMS))
def test_graphed_loop_samples_what_the_eager_loop_samples(tiny, name):
    """Same seed, same draws: the graphed step consumes the counter-based uniforms exactly as the
    eager loop does, so its tokens are the eager loop's (up to a float tie at a CDF boundary, which
    these seeds do not hit)."""
    params = LOOP_PARAMS[name]
    eager, graphed = _loops(tiny)[name], _graphed_loops(tiny)[name]
    for seed in range(12):
        s = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed)
        assert graphed(s).tokens == eager(s).tokens, (name, seed)


def test_sampled_loop_is_reproducible_and_seeded(tiny):
    loop = _loops(tiny)["dflash-chain"]
    a = [loop(SamplingParams(temperature=1.0, seed=s)).tokens for s in range(8)]
    assert a == [loop(SamplingParams(temperature=1.0, seed=s)).tokens for s in range(8)]
    assert len({tuple(x) for x in a}) > 1


def test_planted_bias_in_a_loop_is_detected(tiny, monkeypatch):
    """The statistical test has power: drafts accepted with min(1, 2 p/q) in the chain loop, and
    one set of uniforms reused at every step in the tree loop, both fail it on the same seeds."""
    params = PARAMS[0]
    exact = ar_distribution(tiny.next_probs(params), LENGTH)
    with monkeypatch.context() as m:
        m.setattr(sampling, "acceptance_probability", lambda p, q: (2 * p / q).clamp(max=1.0))
        check = chi_square_check(_sampled(_loops(tiny)["pard-chain"], params, 200), exact)
    assert not check.passed, check.summary()
    with monkeypatch.context() as m:
        m.setattr(sampling.StepRandom, "advance", lambda self: None)
        check = chi_square_check(_sampled(_loops(tiny)["pard-tree"], params, 200), exact)
    assert not check.passed, check.summary()


def test_greedy_is_untouched(tiny):
    """Temperature 0 (the default) is the greedy, token-forced loop: every loop's tokens equal AR
    greedy's."""
    ar = decode.generate_ar(tiny.target, PROMPT, max_new_tokens=LENGTH, eos_token_id=None).tokens
    for name, loop in [*_loops(tiny).items(), *_graphed_loops(tiny).items()]:
        assert loop(SamplingParams()).tokens == ar, name


@pytest.mark.gpu
def test_sampled_graphed_loops_on_cuda():
    """On a GPU the sampled steps are captured as CUDA graphs: they draw what the eager loops draw
    (same seeds), and the graphed tree loop keeps AR's distribution."""
    cuda = Tiny("cuda")
    for name in LOOP_PARAMS:
        params = LOOP_PARAMS[name]
        for seed in range(6):
            s = SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed)
            assert _graphed_loops(cuda)[name](s).tokens == _loops(cuda)[name](s).tokens, (name, seed)
    params = PARAMS[1]
    check = chi_square_check(_sampled(_graphed_loops(cuda)["pard-tree"], params),
                             ar_distribution(cuda.next_probs(params), LENGTH))
    assert check.passed, check.summary()
