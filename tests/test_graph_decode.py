"""The graphed decode loops (device-side state and acceptance) against the eager loops.

On the CPU the step functions run without capture, so these tests check exactly the code that a
CUDA graph records: device-length caches, masks from a device length, acceptance by tensor ops,
and the output accounting reconstructed from per-step counts. The zoo pair (trained) gives real
partial acceptance; the tiny random pairs cover both families.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.runtime import decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime import graph_decode as gd
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import build_mask, build_mask_device

from conftest import FAMILIES

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=9), st.lists(st.integers(0, 3), min_size=10, max_size=10))
def test_accept_on_device_matches_accept_greedy(drafts, target):
    target = target[: len(drafts) + 1]
    n, span = gd.accept_on_device(torch.tensor(drafts), torch.tensor(target))
    expect = decode.accept_greedy(drafts, target)
    assert int(n) == expect
    assert span[: expect + 1].tolist() == drafts[:expect] + [target[expect]]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 20), st.integers(1, 6), st.integers(0, 10), st.sampled_from(["causal", "full", "tree"]))
def test_device_mask_is_the_host_mask_plus_hidden_stale_slots(past, t, slack, kind):
    keys = past + t + slack
    if kind == "tree":
        g = torch.Generator().manual_seed(past * 31 + t)
        mask = torch.rand(t, t, generator=g) < 0.5
        mask |= torch.eye(t, dtype=torch.bool)
    else:
        mask = kind
    dev = build_mask_device(mask, torch.tensor(past), t, keys, torch.device("cpu"))
    host = build_mask(mask, past, t, torch.device("cpu"))
    host = torch.ones(1, 1, t, past + t, dtype=torch.bool) if host is None else host
    assert torch.equal(dev[..., : past + t], host)
    assert not dev[..., past + t :].any()


@pytest.fixture(scope="module")
def zoo():
    zoo = resolve_builtin("code-qwen3").parent
    target, cfg = load_target(zoo / "target", dtype=torch.float32, device="cpu")
    dflash = load_drafter(zoo / "dflash", target, cfg, dtype=torch.float32, device="cpu")
    pard = load_drafter(zoo / "pard", target, cfg, dtype=torch.float32, device="cpu")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(zoo / "target" / "tokenizer.json"))
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    return target, cfg, dflash, pard, tok.encode(prompt).ids


def _loops(target, dflash, pard):
    d = dict(block_size=dflash.block_size, mask_token_id=dflash.mask_token_id)
    p = dict(k=pard.k, mask_token_id=pard.mask_token_id)
    return {
        "ar": (lambda ids, **kw: decode.generate_ar(target, ids, **kw),
               lambda ids, **kw: gd.generate_ar_graphed(target, ids, **kw)),
        "dflash": (lambda ids, **kw: decode.generate_dflash(target, dflash, ids, **d, **kw),
                   lambda ids, **kw: gd.generate_dflash_graphed(target, dflash, ids, **d, **kw)),
        "pard": (lambda ids, **kw: decode.generate_pard(target, pard, ids, **p, **kw),
                 lambda ids, **kw: gd.generate_pard_graphed(target, pard, ids, **p, **kw)),
    }


def _same(eager, graphed):
    assert graphed.tokens == eager.tokens
    assert graphed.accepted == eager.accepted
    assert graphed.steps == eager.steps


def test_zoo_pair_graphed_equals_eager(zoo):
    target, cfg, dflash, pard, ids = zoo
    ar = decode.generate_ar(target, ids, max_new_tokens=32, eos_token_id=cfg.eos_token_id)
    for name, (eager, graphed) in _loops(target, dflash, pard).items():
        e = eager(ids, max_new_tokens=32, eos_token_id=cfg.eos_token_id)
        g = graphed(ids, max_new_tokens=32, eos_token_id=cfg.eos_token_id)
        _same(e, g)
        assert g.tokens == ar.tokens, name
        if name != "ar":
            assert sum(g.accepted) > 0  # the trained drafters do get tokens accepted


def test_zoo_pair_cut_by_eos_and_max_new_tokens(zoo):
    """EOS inside an accepted span and max_new_tokens mid-span: same output and accounting."""
    target, cfg, dflash, pard, ids = zoo
    ar = decode.generate_ar(target, ids, max_new_tokens=30, eos_token_id=None)
    eos = ar.tokens[17]  # the id of an output token acts as EOS (its first occurrence ends the output)
    loops = _loops(target, dflash, pard)
    for name, (eager, graphed) in loops.items():
        for kw in (dict(max_new_tokens=30, eos_token_id=eos), dict(max_new_tokens=23, eos_token_id=None)):
            _same(eager(ids, **kw), graphed(ids, **kw))


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_pairs_graphed_equal_ar(family, tiny_models):
    m = tiny_models[family]
    loops = _loops(m.target, m.dflash, m.pard)
    for ids in ([3, 1, 4, 1, 5], list(range(40, 71))):
        ar = decode.generate_ar(m.target, ids, max_new_tokens=30, eos_token_id=None)
        for name, (eager, graphed) in loops.items():
            g = graphed(ids, max_new_tokens=30, eos_token_id=None)
            _same(eager(ids, max_new_tokens=30, eos_token_id=None), g)
            assert g.tokens == ar.tokens, name


def test_runner_is_reused_and_capacity_is_checked(tiny_models):
    m = tiny_models["qwen3"]
    gd.generate_ar_graphed(m.target, [1, 2, 3], max_new_tokens=5, eos_token_id=None)
    runners = dict(gd.runners_of(m.target))
    gd.generate_ar_graphed(m.target, [4, 5], max_new_tokens=9, eos_token_id=None)
    assert dict(gd.runners_of(m.target)) == runners  # same capacity bucket: same runner, same graphs
    runner = next(iter(runners.values()))
    with pytest.raises(ValueError, match="capacity"):
        runner.generate(list(range(10)), max_new_tokens=runner.capacity, eos_token_id=None)


def test_runner_is_not_reused_once_a_weight_moves(tiny_models):
    """Graphs replay raw pointers: after install_fused-style re-storage of a weight (target or
    drafter) the old runner's graphs would read freed memory, so a new runner must serve."""
    m = tiny_models["qwen3"]
    kw = dict(max_new_tokens=5, eos_token_id=None)
    dflash = dict(block_size=m.dflash.block_size, mask_token_id=m.dflash.mask_token_id)
    gd.generate_ar_graphed(m.target, [1, 2, 3], **kw)
    gd.generate_dflash_graphed(m.target, m.dflash, [1, 2, 3], **dflash, **kw)
    before = set(gd.runners_of(m.target))
    q = m.target.model.layers[1].self_attn.q_proj
    q.weight.data = q.weight.data.clone()  # same values, new storage
    gd.generate_ar_graphed(m.target, [1, 2, 3], **kw)
    after_target = set(gd.runners_of(m.target))
    assert len(after_target - before) == 1
    gd.generate_dflash_graphed(m.target, m.dflash, [1, 2, 3], **dflash, **kw)
    assert len(set(gd.runners_of(m.target)) - after_target) == 1
    fc = next(p for p in m.dflash.parameters())
    fc.data = fc.data.clone()
    seen = set(gd.runners_of(m.target))
    gd.generate_dflash_graphed(m.target, m.dflash, [1, 2, 3], **dflash, **kw)
    assert len(set(gd.runners_of(m.target)) - seen) == 1  # a drafter weight moved: new graphs too


# --- graphed trees --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**16), st.integers(0, 3))
def test_device_tree_acceptance_matches_accept_tree(nodes, seed, pad):
    from specpilot.runtime.tree import Tree, accept_tree, ancestor_mask

    g = torch.Generator().manual_seed(seed)
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, nodes + 1)]
    depth = [0]
    for p in parent[1:]:
        depth.append(depth[p] + 1)
    token = torch.randint(0, 3, (nodes + 1,), generator=g).tolist()
    tree = Tree.from_lists(parent, depth, token).padded(nodes + 1 + pad)
    argmax = torch.randint(0, 3, (tree.size,), generator=g)
    levels = max(depth) + 1
    anc = gd.ancestor_mask_static(tree.parent, levels)
    assert torch.equal(anc, ancestor_mask(tree))
    path, bonus = accept_tree(tree, argmax)
    n, dev_path, span = gd.accept_tree_on_device(tree.parent, tree.depth, tree.token, anc, argmax, levels)
    assert int(n) == len(path) - 1
    assert dev_path[: len(path)].tolist() == path
    assert span[: len(path)].tolist() == tree.token[path[1:]].tolist() + [bonus]


def test_compaction_of_a_stacked_cache_equals_per_layer_moves(tiny_models):
    """compact_on_device moves every layer's k and v in one gather/scatter over the stacked
    buffer; the same moves done layer by layer (a cache without one) must give the same cache."""
    from specpilot.runtime.cache import DeviceKVCache

    cfg = tiny_models["qwen3"].target.cfg
    stacked = DeviceKVCache.for_model(cfg, 1, 24, torch.float32, "cpu")
    assert stacked.stacked is not None and stacked.k[1].data_ptr() == stacked.stacked[0, 1].data_ptr()
    stacked.stacked.copy_(torch.randn(stacked.stacked.shape, generator=torch.Generator().manual_seed(0)))
    layered = DeviceKVCache([k.clone() for k in stacked.k], [v.clone() for v in stacked.v], 24)
    start, path, n = torch.tensor(9), torch.tensor([0, 3, 4, 7, 2]), torch.tensor(3)  # overlapping moves
    for cache in (stacked, layered):
        cache.length.fill_(9 + 8)
        gd.compact_on_device(cache, start, path, n)
        assert int(cache.length) == 13
    for a, b in zip(stacked.k + stacked.v, layered.k + layered.v):
        assert torch.equal(a, b)


@pytest.mark.parametrize("budget", [5, 16])
def test_zoo_pair_graphed_trees_equal_eager_trees(budget, zoo):
    from specpilot.runtime import tree_decode as td

    target, cfg, dflash, pard, ids = zoo
    kw = dict(budget=budget, topk=4, max_new_tokens=24, eos_token_id=cfg.eos_token_id)
    ar = decode.generate_ar(target, ids, max_new_tokens=24, eos_token_id=cfg.eos_token_id)
    d = dict(block_size=dflash.block_size, mask_token_id=dflash.mask_token_id)
    eager = td.generate_dflash_tree(target, dflash, ids, **d, **kw)
    graphed = gd.generate_dflash_tree_graphed(target, dflash, ids, **d, **kw)
    _same(eager, graphed)
    assert graphed.tokens == ar.tokens
    p = dict(k=pard.k, mask_token_id=pard.mask_token_id)
    eager = td.generate_pard_tree(target, pard, ids, **p, **kw)
    graphed = gd.generate_pard_tree_graphed(target, pard, ids, **p, **kw)
    _same(eager, graphed)
    assert graphed.tokens == ar.tokens
