"""Tree verification: tree building, the ancestor mask, acceptance, KV compaction, the decode loops
(lossless against AR greedy), the tree-verify pass, and the torch backend through the CLI.

Planted drafters: `TreeOracle` gives per-position logits around the AR continuation where the
right token is the top-1 ("sure"), the 2nd choice behind a decoy ("second": only a tree accepts
it) or below every top-k ("missing": nothing accepts it). The DFlash oracle also checks that its
context features are the target's hidden states of exactly the accepted tokens, at their positions.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specpilot.cli import main
from specpilot.dsl import parse_pipeline
from specpilot.errors import PipelineError
from specpilot.ir import lower, print_program, verify_program
from specpilot.passes import run_passes
from specpilot.passes.block_size import DraftBlockSize
from specpilot.passes.tree_verify import CANDIDATE_BUDGETS, CANDIDATE_TOPK, TreeVerify
from specpilot.runtime.cache import KVCache
from specpilot.runtime.decode import Generation, generate_ar, generate_dflash, generate_pard
from specpilot.runtime.model import ModelOutput, Transformer
from specpilot.runtime.tiny import MASK_TOKEN_ID
from specpilot.runtime.tree import (Tree, accept_tree, ancestor_mask, best_first_tree, chain_tree, compact_kv,
                                    draft_topk, kary_tree)
from specpilot.runtime.tree_decode import generate_dflash_tree, generate_pard_tree, propose_tree, verify_tree

from conftest import tiny_spec
from test_ir import DFLASH, PARD, TARGET

pytestmark = pytest.mark.usefixtures("torch_single_thread")

FAMILIES = ("llama", "qwen3")
BLOCK = 8  # DFlash block: anchor + 7 draft positions
K = 8  # PARD draft positions
BUILDERS = {"best-first": best_first_tree, "chain": chain_tree, "k-ary": kary_tree}


# --- tree construction ---------------------------------------------------------------------------


def _lattice(seed: int, positions: int, topk: int, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return draft_topk(torch.randn(positions, vocab, generator=g) * 3, topk)


def _check_tree(tree: Tree, logp: torch.Tensor, ids: torch.Tensor, anchor: int) -> None:
    parent, depth, token, score = (t.tolist() for t in (tree.parent, tree.depth, tree.token, tree.score))
    assert (parent[0], depth[0], token[0], score[0]) == (-1, 0, anchor, 0.0)
    children: dict[int, list[int]] = {}
    for i in range(1, tree.size):
        p = parent[i]
        assert 0 <= p < i, "parents precede children"
        assert depth[i] == depth[p] + 1 and depth[i] <= logp.shape[0]
        row = ids[depth[i] - 1].tolist()
        assert token[i] in row, "a node takes one of the top-k tokens of its position"
        assert score[i] == pytest.approx(score[p] + float(logp[depth[i] - 1, row.index(token[i])]), abs=1e-5)
        children.setdefault(p, []).append(token[i])
    assert all(len(c) == len(set(c)) for c in children.values()), "siblings carry distinct tokens"


def _all_path_scores(logp: torch.Tensor) -> list[float]:
    """Every path of the top-k lattice (brute force), scored as the builder scores it."""
    lp = logp.tolist()
    scores = []
    for d in range(1, len(lp) + 1):
        for ranks in itertools.product(range(len(lp[0])), repeat=d):
            s = 0.0
            for j, r in enumerate(ranks):
                s += lp[j][r]
            scores.append(s)
    return sorted(scores, reverse=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), positions=st.integers(1, 4), topk=st.integers(1, 3),
       budget=st.integers(1, 40), shape=st.sampled_from(sorted(BUILDERS)))
def test_tree_construction_properties(seed, positions, topk, budget, shape):
    logp, ids = _lattice(seed, positions, topk)
    tree = BUILDERS[shape](logp, ids, 7, budget=budget)
    _check_tree(tree, logp, ids, 7)
    lattice = sum(topk**d for d in range(1, positions + 1))
    expected = min(budget, positions) if shape == "chain" else min(budget, lattice)
    assert tree.size == expected + 1, "the budget is respected (and filled when the lattice allows)"
    if shape == "best-first":
        scores = tree.score[1:].tolist()
        assert scores == sorted(scores, reverse=True), "best-first emits nodes by non-increasing score"
        assert scores == pytest.approx(_all_path_scores(logp)[:expected], abs=1e-5), "the N best paths"
    if shape == "chain":
        assert tree.token[1:].tolist() == ids[:expected, 0].tolist()


def test_best_first_by_hand():
    # position 1: a 0.5, b 0.3, c 0.2; position 2: x 0.9, y 0.1
    logp = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.1, 1e-9]]).log()
    ids = torch.tensor([[10, 11, 12], [20, 21, 22]])
    tree = best_first_tree(logp, ids, 1, budget=4)
    # a (.5), a-x (.45), b (.3), b-x (.27); then c (.2) would come before a-y (.05)
    assert tree.token.tolist() == [1, 10, 20, 11, 20]
    assert tree.parent.tolist() == [-1, 0, 1, 0, 3]
    assert best_first_tree(logp, ids, 1, budget=5).token.tolist()[-1] == 12
    assert kary_tree(logp, ids, 1, budget=5).token.tolist() == [1, 10, 11, 12, 20, 21]
    assert chain_tree(logp, ids, 1, budget=5).token.tolist() == [1, 10, 20]
    with pytest.raises(ValueError, match="budget must be >= 1"):
        best_first_tree(logp, ids, 1, budget=0)


def test_padding_keeps_shapes_static_and_is_never_accepted():
    logp, ids = _lattice(0, 2, 2)
    tree = best_first_tree(logp, ids, 3, budget=64)  # lattice of 6 nodes
    padded = tree.padded(65)
    assert padded.size == 65 and padded.padded(65) is padded
    assert padded.parent[7:].eq(-1).all() and padded.score[7:].eq(float("-inf")).all()
    mask = ancestor_mask(padded)
    assert mask[7:, :].sum(1).eq(1).all() and mask[7:, 7:].diagonal().all()  # a pad sees only itself
    argmax = torch.full((65,), 3)  # pads carry the anchor token: make the target "agree" with them
    path, _ = accept_tree(padded, argmax)
    assert all(i < 7 for i in path)
    with pytest.raises(ValueError, match="cannot pad"):
        padded.padded(3)


# --- ancestor mask and acceptance ---------------------------------------------------------------


def _random_tree(seed: int, n: int, vocab: int) -> Tree:
    rng = random.Random(seed)
    parent, depth, token = [-1], [0], [rng.randrange(vocab)]
    for i in range(1, n):
        p = rng.randrange(i)
        used = {token[j] for j in range(1, i) if parent[j] == p}
        free = [t for t in range(vocab) if t not in used]
        parent.append(p)
        depth.append(depth[p] + 1)
        token.append(rng.choice(free) if free else vocab + i)
    return Tree.from_lists(parent, depth, token)


def _ancestors_brute(tree: Tree, i: int) -> set[int]:
    out, parent = {i}, tree.parent.tolist()
    while parent[i] >= 0:
        i = parent[i]
        out.add(i)
    return out


def _accept_brute(tree: Tree, argmax: list[int]) -> tuple[list[int], int]:
    parent, token = tree.parent.tolist(), tree.token.tolist()
    path = [0]
    while True:
        nxt = [c for c in range(tree.size) if parent[c] == path[-1] and token[c] == argmax[path[-1]]]
        assert len(nxt) <= 1
        if not nxt:
            return path, argmax[path[-1]]
        path.append(nxt[0])


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 40), vocab=st.integers(1, 4))
def test_ancestor_mask_and_accept_tree_match_brute_force(seed, n, vocab):
    tree = _random_tree(seed, n, vocab)
    mask = ancestor_mask(tree)
    for i in range(n):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == _ancestors_brute(tree, i)
    rng = random.Random(seed + 1)
    argmax = [rng.randrange(vocab + 1) for _ in range(n)]
    assert accept_tree(tree, argmax) == _accept_brute(tree, argmax)
    assert accept_tree(tree, torch.tensor(argmax), mask) == _accept_brute(tree, argmax)


def test_accept_tree_takes_a_second_branch():
    #        0(anchor 5)
    #       /        \
    #    1(a=7)     2(b=8)
    #      |          |
    #    3(9)       4(9)
    tree = Tree.from_lists([-1, 0, 0, 1, 2], [0, 1, 1, 2, 2], [5, 7, 8, 9, 9])
    assert accept_tree(tree, [8, 0, 9, 0, 4]) == ([0, 2, 4], 4)
    assert accept_tree(tree, [7, 1, 9, 3, 4]) == ([0, 1], 1)
    assert accept_tree(tree, [6, 1, 9, 3, 4]) == ([0], 6)


# --- KV compaction -------------------------------------------------------------------------------


def test_compact_kv_moves_the_path_into_place():
    layers, start = 2, 5
    cache = KVCache([torch.randn(1, 2, 20, 4) for _ in range(layers)],
                    [torch.randn(1, 2, 20, 4) for _ in range(layers)], 20)
    cache.length = start + 9
    before = ([k.clone() for k in cache.k], [v.clone() for v in cache.v])
    path = [start, start + 1, start + 3, start + 4, start + 8]  # overlapping moves
    compact_kv(cache, start, path)
    assert cache.length == start + 5
    for layer in range(layers):
        for old, new in ((before[0][layer], cache.k[layer]), (before[1][layer], cache.v[layer])):
            torch.testing.assert_close(new[:, :, :start], old[:, :, :start], rtol=0, atol=0)
            torch.testing.assert_close(new[:, :, start : start + 5], old[:, :, path], rtol=0, atol=0)
    compact_kv(cache, start, [start, start + 1])  # already contiguous: only the length moves
    assert cache.length == start + 2
    with pytest.raises(ValueError, match="overflow"):
        compact_kv(cache, 15, list(range(15, 21)))


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_tree_equals_linear_forwards(family, tiny_models):
    """Every node's argmax and hidden states equal a plain causal forward over its root path, and
    after compaction the cache equals the one that forward leaves."""
    m = tiny_models[family]
    layers = tuple(m.dflash.target_layer_ids)
    prefix = list(b"tree attention")
    g = torch.Generator().manual_seed(1)
    tree = propose_tree(torch.randn(5, m.cfg.vocab_size, generator=g), prefix[-1], budget=24, topk=3,
                        shape="best-first", device=torch.device("cpu"))
    with torch.inference_mode():
        cache = m.target.new_cache(1, 64)
        m.target(torch.tensor([prefix[:-1]]), cache)
        start = cache.length
        argmax, hidden, _ = verify_tree(m.target, cache, tree, layers)
        assert cache.length == start + tree.size
        paths = {i: sorted(_ancestors_brute(tree, i)) for i in range(tree.size)}
        for i, path in paths.items():
            ids = torch.tensor([prefix[:-1] + tree.token[path].tolist()])
            ref = m.target(ids, m.target.new_cache(1, 64), hidden_layers=layers)
            assert int(argmax[i]) == int(ref.logits[0, -1].argmax())
            torch.testing.assert_close(hidden[0, i], ref.hidden[0, -1], atol=1e-4, rtol=1e-4)
        deepest = max(paths, key=lambda i: len(paths[i]))
        path = paths[deepest]
        compact_kv(cache, start, [start + i for i in path])
        ref_cache = m.target.new_cache(1, 64)
        m.target(torch.tensor([prefix[:-1] + tree.token[path].tolist()]), ref_cache)
        assert cache.length == ref_cache.length == start + len(path)
        for a, b in zip(cache.k + cache.v, ref_cache.k + ref_cache.v):
            torch.testing.assert_close(a[:, :, : cache.length], b[:, :, : cache.length], atol=1e-5, rtol=1e-5)


# --- planted drafters ----------------------------------------------------------------------------


class TreeOracle:
    """Drafter logits for the token at sequence position p, around the AR reference."""

    def __init__(self, reference: list[int], vocab: int, second_every: int = 0, missing_every: int = 0) -> None:
        self.reference, self.vocab = reference, vocab
        self.second_every, self.missing_every = second_every, missing_every

    def token_at(self, p: int) -> int:
        return self.reference[p] if p < len(self.reference) else 0

    def logits(self, positions: list[int]) -> torch.Tensor:
        out = torch.zeros(1, len(positions), self.vocab)
        for row, p in enumerate(positions):
            right = self.token_at(p)
            decoy = (right + 1) % self.vocab
            if self.missing_every and p % self.missing_every == 0:
                out[0, row, decoy], out[0, row, right] = 20.0, -20.0  # below every top-k
            elif self.second_every and p % self.second_every == 0:
                out[0, row, decoy], out[0, row, right] = 10.0, 9.5  # the 2nd choice
            else:
                out[0, row, right] = 20.0
        return out

    def check_committed(self, ids: list[int], start: int) -> None:
        for i, token in enumerate(ids):
            if start + i < len(self.reference):
                assert token == self.reference[start + i], f"fed {token} at position {start + i}"


class OraclePard(nn.Module):
    def __init__(self, oracle: TreeOracle, k: int) -> None:
        super().__init__()
        self.oracle, self.k = oracle, k
        self.device = torch.device("cpu")

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache([], [], max_len)

    def forward(self, input_ids: torch.Tensor, cache: KVCache, *, only_last: bool = False, **_) -> ModelOutput:
        ids, start = input_ids[0].tolist(), cache.length
        real = len(ids) if only_last else len(ids) - (self.k - 1)
        self.oracle.check_committed(ids[:real], start)
        assert all(t == MASK_TOKEN_ID for t in ids[real:])
        cache.advance(len(ids))
        logits = self.oracle.logits([start + i + 1 for i in range(len(ids))])  # position p predicts p + 1
        return ModelOutput(logits=logits[:, -1:] if only_last else logits, hidden=None)


class OracleDFlash(nn.Module):
    def __init__(self, oracle: TreeOracle, target: Transformer, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.oracle, self.target_layer_ids, self.mask_token_id = oracle, layers, MASK_TOKEN_ID
        with torch.inference_mode():
            ids = torch.tensor([oracle.reference])
            self.reference_hidden = target(ids, target.new_cache(1, ids.shape[1]), hidden_layers=layers).hidden

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache([], [], max_len)

    def add_context(self, new_context_hidden: torch.Tensor, cache: KVCache) -> None:
        n, start = new_context_hidden.shape[1], cache.length
        torch.testing.assert_close(new_context_hidden, self.reference_hidden[:, start : start + n], atol=1e-4, rtol=1e-5)
        cache.advance(n)

    def forward(self, block_ids: torch.Tensor, new_context_hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        self.add_context(new_context_hidden, cache)
        anchor, ids = cache.length, block_ids[0].tolist()
        self.oracle.check_committed(ids[:1], anchor)
        assert ids[1:] == [MASK_TOKEN_ID] * (len(ids) - 1)
        return self.oracle.logits([anchor + j for j in range(1, len(ids))])


def _ar(m, prompt: list[int], n: int, eos: int | None = None) -> Generation:
    return generate_ar(m.target, prompt, max_new_tokens=n, eos_token_id=eos)


def _oracles(m, prompt: list[int], n: int, **kw) -> tuple[OraclePard, OracleDFlash]:
    oracle = TreeOracle(prompt + _ar(m, prompt, n + BLOCK + K).tokens, m.cfg.vocab_size, **kw)
    return OraclePard(oracle, K), OracleDFlash(oracle, m.target, m.dflash.target_layer_ids)


def _trees(m, prompt, n, eos=None, *, budget, topk, pard=None, dflash=None, shape="best-first"):
    common = dict(budget=budget, topk=topk, mask_token_id=MASK_TOKEN_ID, max_new_tokens=n, eos_token_id=eos,
                  shape=shape)
    return {
        "pard": generate_pard_tree(m.target, pard if pard is not None else m.pard, prompt, k=K, **common),
        "dflash": generate_dflash_tree(m.target, dflash if dflash is not None else m.dflash, prompt,
                                       block_size=BLOCK, **common),
    }


def _chains(m, prompt, n, *, pard, dflash):
    common = dict(mask_token_id=MASK_TOKEN_ID, max_new_tokens=n, eos_token_id=None)
    return {"pard": generate_pard(m.target, pard, prompt, k=K, **common),
            "dflash": generate_dflash(m.target, dflash, prompt, block_size=BLOCK, **common)}


def _check_accounting(gen: Generation, name: str) -> None:
    assert gen.steps == len(gen.accepted)
    assert all(0 <= a <= (K if name == "pard" else BLOCK - 1) for a in gen.accepted)
    if gen.tokens:
        assert len(gen.tokens) == 1 + gen.steps + sum(gen.accepted)


# --- losslessness: the tree loops equal AR greedy -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shape", ("best-first", "k-ary", "chain"))
def test_random_drafters_match_ar(family, shape, tiny_models):
    m = tiny_models[family]
    for prompt in (list(b"Hello world"), list(b"x")):
        ar = _ar(m, prompt, 24)
        for name, gen in _trees(m, prompt, 24, budget=16, topk=4, shape=shape).items():
            assert gen.tokens == ar.tokens, (name, shape)
            _check_accounting(gen, name)


@settings(max_examples=8, deadline=None)
@given(family=st.sampled_from(FAMILIES), prompt=st.lists(st.integers(0, 255), min_size=1, max_size=30),
       max_new=st.integers(0, 30), budget=st.sampled_from((1, 5, 16, 64)), topk=st.sampled_from((1, 2, 8)))
def test_random_drafters_match_ar_property(family, prompt, max_new, budget, topk, tiny_models):
    m = tiny_models[family]
    ar = _ar(m, prompt, max_new)
    for name, gen in _trees(m, prompt, max_new, budget=budget, topk=topk).items():
        assert gen.tokens == ar.tokens, name
        _check_accounting(gen, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_second_choices_only_the_tree_accepts(family, tiny_models):
    """The right token is the drafter's 2nd choice every 3rd position: the chain stops there, the
    tree (64 nodes hold every top-2 branch of a block) accepts whole blocks."""
    m = tiny_models[family]
    prompt = list(b"branch")
    n = 1 + 3 * 9  # prefill token + three full PARD steps (8 drafts + bonus)
    ar = _ar(m, prompt, n)
    pard, dflash = _oracles(m, prompt, n, second_every=3)
    trees = _trees(m, prompt, n, budget=64, topk=4, pard=pard, dflash=dflash)
    chains = _chains(m, prompt, n, pard=pard, dflash=dflash)
    assert trees["pard"].accepted == [K, K, K]
    assert trees["dflash"].accepted == [BLOCK - 1] * 3 + [n - 1 - 3 * BLOCK - 1]  # 3 full blocks, a cut one
    for name in ("pard", "dflash"):
        assert trees[name].tokens == chains[name].tokens == ar.tokens, name
        assert max(chains[name].accepted) < 3 and chains[name].tau < trees[name].tau, chains[name].accepted
        _check_accounting(trees[name], name)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_outside_the_top_k_stop_the_path(family, tiny_models):
    m = tiny_models[family]
    prompt = list(b"partial")
    ar = _ar(m, prompt, 40)
    pard, dflash = _oracles(m, prompt, 40, second_every=4, missing_every=7)
    for name, gen in _trees(m, prompt, 40, budget=32, topk=2, pard=pard, dflash=dflash).items():
        assert gen.tokens == ar.tokens, name
        _check_accounting(gen, name)
        top = K if name == "pard" else BLOCK - 1
        assert max(gen.accepted) < top and any(a > 1 for a in gen.accepted), (name, gen.accepted)


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_an_accepted_path(family, tiny_models):
    m = tiny_models[family]
    prompt = list(b"Stop here")
    free = _ar(m, prompt, 40).tokens
    # an EOS id first seen mid-output, not at the end of a full step of either loop
    cut = next(i for i, t in enumerate(free) if i >= 4 and free.index(t) == i and (i - 1) % (K + 1) != K
               and (i - 1) % BLOCK != BLOCK - 1)
    eos = free[cut]
    ar = _ar(m, prompt, 40, eos)
    assert ar.tokens == free[: cut + 1]
    pard, dflash = _oracles(m, prompt, 40, second_every=3)
    for name, gen in _trees(m, prompt, 40, eos, budget=64, topk=4, pard=pard, dflash=dflash).items():
        assert gen.tokens == ar.tokens, name
        _check_accounting(gen, name)
        assert gen.accepted[-1] < (K if name == "pard" else BLOCK - 1), "the last path was cut at EOS"


@settings(max_examples=8, deadline=None)
@given(family=st.sampled_from(FAMILIES), max_new=st.integers(1, 30), second_every=st.sampled_from((0, 2, 3)))
def test_max_new_tokens_inside_an_accepted_path(family, max_new, second_every, tiny_models):
    m = tiny_models[family]
    prompt = list(b"The limit")
    ar = _ar(m, prompt, max_new)
    pard, dflash = _oracles(m, prompt, max_new, second_every=second_every)
    for name, gen in _trees(m, prompt, max_new, budget=64, topk=2, pard=pard, dflash=dflash).items():
        assert gen.tokens == ar.tokens and len(gen.tokens) == max_new, name
        _check_accounting(gen, name)


def test_bad_arguments():
    with pytest.raises(ValueError, match="tree shape"):
        propose_tree(torch.zeros(3, 10), 0, budget=4, topk=2, shape="bush", device=torch.device("cpu"))


# --- the pass -----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", [DFLASH, PARD], ids=["dflash", "pard"])
def test_tree_verify_rewrites_the_step_consistently(drafter):
    p = lower(TARGET, drafter)
    q, [rec] = run_passes(p, [TreeVerify(budget=32, topk=8)])
    assert rec.changed and rec.lossless and rec.before != rec.after
    assert q.target == p.target and q.drafter == p.drafter
    step = {op: q.step.one(op)[1] for op in ("draft", "propose", "verify", "accept", "commit")}
    assert step["draft"] == p.step.one("draft")[1]
    assert (step["propose"]["shape"], step["propose"]["budget"], step["propose"]["topk"]) == ("tree", 32, 8)
    assert (step["verify"]["mode"], step["verify"]["q"]) == ("tree", 33)
    assert step["accept"]["rule"] == "tree-path" and step["commit"]["kv"] == "compact"
    before, after = print_program(p).splitlines(), print_program(q).splitlines()
    assert sum(a != b for a, b in zip(before, after)) == 4  # propose, verify, accept, commit
    verify_program(q)
    # the same pass again changes nothing; another budget changes propose and verify only
    again, [rec2] = run_passes(q, [TreeVerify(budget=32, topk=8)])
    assert not rec2.changed and again == q
    r, _ = run_passes(q, [TreeVerify(budget=16, topk=8)])
    assert sum(a != b for a, b in zip(print_program(q).splitlines(), print_program(r).splitlines())) == 2
    # a later block size keeps the tree (its depth bound moves, its verify length does not)
    s, _ = run_passes(q, [DraftBlockSize(size=4)])
    assert s.step.one("verify")[1]["q"] == 33 and s.step.one("propose")[1]["shape"] == "tree"


def test_tree_verify_schedule_space_and_pipeline_strings():
    p = lower(TARGET, DFLASH)
    space = TreeVerify.schedule_space(p)
    assert len(space) == len(CANDIDATE_BUDGETS) * len(CANDIDATE_TOPK)
    q, _ = run_passes(p, [TreeVerify(budget=64, topk=4)])
    space = TreeVerify.schedule_space(q)
    assert TreeVerify(budget=64, topk=4) not in space
    assert len(space) == len(CANDIDATE_BUDGETS) * len(CANDIDATE_TOPK) - 1
    assert all(c.apply(q).changed for c in space)
    assert parse_pipeline("tree-verify{budget=16, topk=4}") == [TreeVerify(budget=16, topk=4)]
    assert parse_pipeline("tree-verify") == [TreeVerify(budget=64, topk=4)]
    assert TreeVerify(budget=16, topk=2).spec() == "tree-verify{budget=16, topk=2}"
    assert parse_pipeline(TreeVerify(budget=16, topk=2).spec()) == [TreeVerify(budget=16, topk=2)]
    for bad in ("tree-verify{budget=0}", "tree-verify{topk=0}"):
        with pytest.raises(PipelineError, match="must be >= 1"):
            parse_pipeline(bad)


# --- the torch backend, through the CLI ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_compile_with_tree_verify_passes_token_forcing(kind, tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(tiny_spec(kind))
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["compile", str(spec), "--passes", "tree-verify{budget=16, topk=4}",
                                  "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"] == "tree-verify{budget=16, topk=4}"
    assert report["outputs_equal_ar"] == "2/2" and report["tokens_checked"] == 24
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] and validation["hard_failures"] == 0
    assert 'shape="tree"' in (out / "ir.txt").read_text()
