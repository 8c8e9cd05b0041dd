"""Every decode loop's greedy output equals AR greedy, token for token.

Drafters: the random tiny ones (almost nothing accepted), planted oracles that propose the AR
continuation (full blocks accepted, bonus after the last draft), and oracles that are wrong at some
positions (partial acceptance). The oracles also check what the loop feeds them: the committed
tokens at the right positions and, for DFlash, the target's hidden states of exactly the accepted
positions.

Accounting identity asserted (see decode.py): tokens[0] comes from the prefill and step i emits
accepted[i] + 1 tokens, counting only tokens that reached the output when EOS / max_new_tokens
cuts a step short. Hence len(tokens) == 1 + steps + sum(accepted), steps == len(accepted).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specpilot.runtime.cache import KVCache
from specpilot.runtime.decode import Generation, accept_greedy, generate_ar, generate_dflash, generate_pard
from specpilot.runtime.model import ModelOutput, Transformer
from specpilot.runtime.tiny import MASK_TOKEN_ID

pytestmark = pytest.mark.usefixtures("torch_single_thread")

FAMILIES = ("llama", "qwen3")
PROMPTS = (b"Hello world", b"x", bytes(range(40, 75)))
K = 8  # PARD drafts per step
BLOCK = 8  # DFlash block (anchor + 7 drafts)


# --- planted drafters --------------------------------------------------------------------------


class Oracle:
    """The AR continuation `reference` (prompt + output), wrong where `wrong(position)` says."""

    def __init__(self, reference: list[int], vocab: int, wrong_every: int = 0) -> None:
        self.reference, self.vocab, self.wrong_every = reference, vocab, wrong_every

    def token_at(self, position: int) -> int:
        token = self.reference[position] if position < len(self.reference) else 0
        if self.wrong_every and position % self.wrong_every == 0:
            token = (token + 1) % self.vocab
        return token

    def one_hot(self, positions: list[int]) -> torch.Tensor:
        logits = torch.zeros(1, len(positions), self.vocab)
        logits[0, torch.arange(len(positions)), torch.tensor([self.token_at(p) for p in positions])] = 1.0
        return logits

    def check_committed(self, ids: list[int], start: int) -> None:
        for i, token in enumerate(ids):
            if start + i < len(self.reference):
                assert token == self.reference[start + i], f"fed {token} at position {start + i}"


class OraclePard(nn.Module):
    """Stands in for the PARD drafter's causal LM (same call signature)."""

    def __init__(self, oracle: Oracle, k: int) -> None:
        super().__init__()
        self.oracle, self.k = oracle, k
        self.device = torch.device("cpu")

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache([], [], max_len)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, *, only_last: bool = False, **_) -> ModelOutput:
        """Prefill (only_last) gets the prompt; a draft call gets fresh committed tokens + k-1 masks."""
        ids, start = input_ids[0].tolist(), cache.length
        real = len(ids) if only_last else len(ids) - (self.k - 1)
        self.oracle.check_committed(ids[:real], start)
        assert all(t == MASK_TOKEN_ID for t in ids[real:])
        cache.advance(len(ids))
        logits = self.oracle.one_hot([start + i + 1 for i in range(len(ids))])  # position p predicts p + 1
        return ModelOutput(logits=logits[:, -1:] if only_last else logits, hidden=None)


class OracleDFlash(nn.Module):
    """Stands in for the DFlash drafter; checks the context features against the target's."""

    def __init__(self, oracle: Oracle, target: Transformer, layers: tuple[int, ...], block_size: int) -> None:
        super().__init__()
        self.oracle, self.target_layer_ids, self.block_size, self.mask_token_id = oracle, layers, block_size, MASK_TOKEN_ID
        with torch.inference_mode():
            ids = torch.tensor([oracle.reference])
            self.reference_hidden = target(ids, target.new_cache(1, ids.shape[1]), hidden_layers=layers).hidden
        self.context_seen = 0

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache([], [], max_len)

    def add_context(self, new_context_hidden: torch.Tensor, cache: KVCache) -> None:
        n, start = new_context_hidden.shape[1], cache.length
        expected = self.reference_hidden[:, start : start + n]
        # fp32 matmul blocking differs between a prefill and verify chunks: 2.7e-4 seen on rows of
        # |h| up to ~50 (AVX-512); a feature of the wrong position is off by units
        torch.testing.assert_close(new_context_hidden, expected, atol=1e-3, rtol=1e-5)
        cache.advance(n)
        self.context_seen += n

    def forward(self, block_ids: torch.Tensor, new_context_hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        self.add_context(new_context_hidden, cache)
        anchor = cache.length  # the block sits right after the context
        ids = block_ids[0].tolist()
        self.oracle.check_committed(ids[:1], anchor)
        assert ids[1:] == [MASK_TOKEN_ID] * (len(ids) - 1)
        return self.oracle.one_hot([anchor + j for j in range(1, len(ids))])


# --- helpers -----------------------------------------------------------------------------------


def _ar(target: Transformer, prompt: list[int], n: int, eos: int | None = None) -> Generation:
    return generate_ar(target, prompt, max_new_tokens=n, eos_token_id=eos)


def _check_accounting(gen: Generation, k: int) -> None:
    assert gen.steps == len(gen.accepted)
    assert all(0 <= a <= k for a in gen.accepted)
    if gen.tokens:
        assert len(gen.tokens) == 1 + gen.steps + sum(gen.accepted)
    assert gen.prefill_s >= 0 and gen.decode_s >= 0


def _run_all(m, prompt: list[int], n: int, eos: int | None, pard=None, dflash=None) -> dict[str, Generation]:
    pard = pard if pard is not None else m.pard
    dflash = dflash if dflash is not None else m.dflash
    common = dict(max_new_tokens=n, eos_token_id=eos, mask_token_id=MASK_TOKEN_ID)
    return {
        "pard": generate_pard(m.target, pard, prompt, k=K, **common),
        "dflash": generate_dflash(m.target, dflash, prompt, block_size=BLOCK, **common),
    }


def _oracles(m, prompt: list[int], n: int, wrong_every: int = 0) -> tuple[OraclePard, OracleDFlash]:
    reference = prompt + _ar(m.target, prompt, n + BLOCK + K).tokens  # long enough for any lookahead
    oracle = Oracle(reference, m.cfg.vocab_size, wrong_every)
    return OraclePard(oracle, K), OracleDFlash(oracle, m.target, m.dflash.target_layer_ids, BLOCK)


# --- acceptance and accounting -------------------------------------------------------------------


def test_accept_greedy():
    assert accept_greedy([], [5]) == 0
    assert accept_greedy([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_greedy([1, 9, 3], [1, 2, 3, 4]) == 1
    assert accept_greedy([9, 2, 3], [1, 2, 3, 4]) == 0
    assert accept_greedy(torch.tensor([4, 5]), torch.tensor([4, 5, 6])) == 2


def test_tau():
    assert Generation(tokens=[1, 2, 3], steps=2).tau == 1.0
    assert Generation(tokens=[0] * 8, accepted=[3, 0, 2], steps=3).tau == pytest.approx(1 + 5 / 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_max_new_tokens_zero_and_one(family, tiny_models):
    m = tiny_models[family]
    prompt = list(b"abc")
    first = _ar(m.target, prompt, 1)
    assert len(first.tokens) == 1 and first.steps == 0
    for gen in _run_all(m, prompt, 1, None).values():
        assert gen.tokens == first.tokens and gen.accepted == [] and gen.steps == 0
    assert _ar(m.target, prompt, 0).tokens == []
    assert all(g.tokens == [] for g in _run_all(m, prompt, 0, None).values())


# --- random drafters -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_random_drafters_match_ar(family, prompt, tiny_models):
    m = tiny_models[family]
    ar = _ar(m.target, list(prompt), 30)
    assert ar.steps == len(ar.tokens) - 1 and ar.tau == 1.0
    for name, gen in _run_all(m, list(prompt), 30, None).items():
        assert gen.tokens == ar.tokens, name
        _check_accounting(gen, K if name == "pard" else BLOCK - 1)


@settings(max_examples=10, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    prompt=st.lists(st.integers(0, 255), min_size=1, max_size=40),
    max_new=st.integers(1, 40),
)
def test_random_drafters_match_ar_property(family, prompt, max_new, tiny_models):
    m = tiny_models[family]
    ar = _ar(m.target, prompt, max_new)
    assert len(ar.tokens) == max_new
    for name, gen in _run_all(m, prompt, max_new, None).items():
        assert gen.tokens == ar.tokens, name
        _check_accounting(gen, K if name == "pard" else BLOCK - 1)


# --- planted drafters ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_drafters_accept_full_blocks(family, prompt, tiny_models):
    m = tiny_models[family]
    n = 1 + 3 * (K + 1)  # prefill token + three full PARD steps (k drafts + bonus each)
    ar = _ar(m.target, list(prompt), n)
    pard, dflash = _oracles(m, list(prompt), n)
    gens = _run_all(m, list(prompt), n, None, pard=pard, dflash=dflash)
    assert gens["pard"].tokens == ar.tokens and gens["pard"].accepted == [K, K, K]
    assert gens["pard"].tau == K + 1
    # DFlash: 7 drafts + bonus per step; 27 tokens after the prefill = 3 full steps + a cut one of 3
    assert gens["dflash"].tokens == ar.tokens and gens["dflash"].accepted == [BLOCK - 1] * 3 + [2]
    # context before the last step: every token committed by then (prompt, prefill token, 3 full steps) but the anchor
    assert dflash.context_seen == len(prompt) + 1 + 3 * BLOCK - 1
    for name, gen in gens.items():
        _check_accounting(gen, K if name == "pard" else BLOCK - 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("wrong_every", (3, 5))
def test_partially_right_drafters(family, wrong_every, tiny_models):
    m = tiny_models[family]
    prompt = list(b"partial")
    ar = _ar(m.target, prompt, 40)
    pard, dflash = _oracles(m, prompt, 40, wrong_every=wrong_every)
    for name, gen in _run_all(m, prompt, 40, None, pard=pard, dflash=dflash).items():
        assert gen.tokens == ar.tokens, name
        k = K if name == "pard" else BLOCK - 1
        _check_accounting(gen, k)
        assert any(0 < a < k for a in gen.accepted) and max(gen.accepted) < k, (name, gen.accepted)


# --- EOS and max_new_tokens inside an accepted span ---------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_eos_inside_accepted_span(family, prompt, tiny_models):
    m = tiny_models[family]
    free = _ar(m.target, list(prompt), 40).tokens
    # an EOS id that first appears mid-output and not at a step boundary of either oracle loop
    candidates = [i for i, t in enumerate(free) if i >= 3 and free.index(t) == i and (i - 1) % (K + 1) != K
                  and (i - 1) % BLOCK != BLOCK - 1]
    assert candidates, free
    cut = candidates[0]
    eos = free[cut]
    ar = _ar(m.target, list(prompt), 40, eos=eos)
    assert ar.tokens == free[: cut + 1]
    pard, dflash = _oracles(m, list(prompt), 40)
    for drafters in ({}, {"pard": pard, "dflash": dflash}):
        for name, gen in _run_all(m, list(prompt), 40, eos, **drafters).items():
            assert gen.tokens == ar.tokens, (name, drafters.keys())
            _check_accounting(gen, K if name == "pard" else BLOCK - 1)
            if drafters:  # the oracle would have gone on: the last step was cut at EOS
                assert gen.accepted[-1] < (K if name == "pard" else BLOCK - 1)


@settings(max_examples=10, deadline=None)
@given(family=st.sampled_from(FAMILIES), max_new=st.integers(2, 45), wrong_every=st.sampled_from((0, 4, 7)))
def test_max_new_tokens_inside_accepted_span(family, max_new, wrong_every, tiny_models):
    m = tiny_models[family]
    prompt = list(b"The limit")
    ar = _ar(m.target, prompt, max_new)
    pard, dflash = _oracles(m, prompt, max_new, wrong_every=wrong_every)
    for name, gen in _run_all(m, prompt, max_new, None, pard=pard, dflash=dflash).items():
        assert gen.tokens == ar.tokens and len(gen.tokens) == max_new, name
        _check_accounting(gen, K if name == "pard" else BLOCK - 1)


def test_dflash_block_size_other_than_trained(tiny_models):
    """The block size is a loop parameter (a pass may change it); the drafter is non-causal over any block."""
    m = tiny_models["qwen3"]
    prompt = list(b"blocks")
    ar = _ar(m.target, prompt, 25)
    for block in (2, 5, 16):
        gen = generate_dflash(m.target, m.dflash, prompt, block_size=block, mask_token_id=MASK_TOKEN_ID,
                              max_new_tokens=25, eos_token_id=None)
        assert gen.tokens == ar.tokens
        _check_accounting(gen, block - 1)
