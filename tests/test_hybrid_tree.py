"""Tree verification of hybrid (Gated DeltaNet + attention) targets: every node sees exactly its root
path, the commit keeps exactly the accepted tokens' state, the tree loops equal AR greedy, and a
compile with tree-verify on the zoo's hybrid pair passes token forcing."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import random_tree
from specpilot.cli import main
from specpilot.hf.config import HybridConfig
from specpilot.ir import lower
from specpilot.passes import run_passes
from specpilot.passes.tree_verify import TreeVerify
from specpilot.runtime.decode import generate_ar, generate_dflash
from specpilot.runtime.hybrid import HybridCache, HybridTransformer, delta_rule_recurrent, unfuse_experts
from specpilot.runtime.hybrid_tree import (
    commit_state,
    conv_sources,
    delta_rule_tree,
    delta_rule_tree_recurrent,
    parents_from_ancestors,
    tree_state_bytes,
)
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tiny_hybrid import MASK_TOKEN_ID, build_tiny_hybrid, random_hybrid, tiny_hybrid_config
from specpilot.runtime.tree import Tree, ancestor_mask
from specpilot.runtime.tree_decode import generate_dflash_tree, generate_pard_tree

pytestmark = pytest.mark.usefixtures("torch_single_thread")

VOCAB = 258
# fp32: a node's logits (about 8 in size) against a chain forward over its path, the projections
# over different row counts: 1.3e-4 seen, the same distance as either from a float64 run (with the rule
# in WY form or node by node), so rounding, not semantics.
ATOL = 2e-4
ODD = {"linear_key_head_dim": 12, "linear_value_head_dim": 20, "linear_conv_kernel_dim": 3,
       "linear_num_key_heads": 1, "linear_num_value_heads": 3, "full_attention_interval": 3, "num_layers": 3}


def _model(**overrides) -> HybridTransformer:
    config = tiny_hybrid_config(VOCAB, **overrides)
    hf = random_hybrid(config, seed=0, norm_std=0.2)
    ours = HybridTransformer(HybridConfig.from_hf(config.to_dict(), "config.json"))
    ours.load_state_dict(unfuse_experts(hf.state_dict()), strict=True)
    return ours.eval()


@pytest.fixture(scope="module")
def models():
    return {"default": _model(), "odd": _model(**ODD)}


def _random_tree(seed: int, n: int, pad: int = 0) -> Tree:
    return random_tree(seed, n, VOCAB, pad)


def _paths(anc: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row).flatten().tolist() for row in anc]


# --- the rule alone ---------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 13), dk=st.sampled_from([3, 8, 13]), dv=st.sampled_from([5, 16]))
def test_tree_rule_equals_each_path_as_a_chain(seed, n, dk, dv):
    """WY form over the tree == the per-node snapshot form == hybrid.delta_rule_recurrent over each
    node's root path (the snapshot form is bitwise the chain's: the same ops in the same order)."""
    g = torch.Generator().manual_seed(seed)
    b, h = 2, 3
    q, k = torch.randn(b, h, n, dk, generator=g), torch.randn(b, h, n, dk, generator=g)
    v = torch.randn(b, h, n, dv, generator=g)
    decay = -torch.rand(b, h, n, generator=g) * 2
    beta = torch.rand(b, h, n, generator=g)
    s0 = torch.randn(b, h, dk, dv, generator=g)
    anc = ancestor_mask(_random_tree(seed, n))
    out, kn, w, cum_g = delta_rule_tree(q, k, v, decay, beta, s0, anc)
    snap, states = delta_rule_tree_recurrent(q, k, v, decay, beta, s0, parents_from_ancestors(anc))
    torch.testing.assert_close(out, snap, atol=2e-5, rtol=1e-5)
    for i, path in enumerate(_paths(anc)):
        chain, chain_states = delta_rule_recurrent(q[:, :, path], k[:, :, path], v[:, :, path], decay[:, :, path],
                                                   beta[:, :, path], s0)
        assert torch.equal(snap[:, :, i], chain[:, :, -1]) and torch.equal(states[i], chain_states[-1])
        # the commit of this path: the chain's state after it, from per-node vectors only
        idx = torch.tensor(path)
        committed = commit_state(s0, kn, w, cum_g, idx, torch.ones(len(path), dtype=torch.bool))
        torch.testing.assert_close(committed, chain_states[-1], atol=2e-5, rtol=1e-5)


def test_commit_ignores_the_padded_tail_of_a_path():
    """A graphed loop passes the path padded to its depth bound and the accepted count as a tensor."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, d, generator=g) for d in (4, 4, 5))
    decay, beta, s0 = -torch.rand(1, 2, 6, generator=g), torch.rand(1, 2, 6, generator=g), torch.randn(1, 2, 4, 5)
    anc = ancestor_mask(Tree.from_lists([-1, 0, 1, 2, 1, 4], [0, 1, 2, 3, 2, 3], [0] * 6))
    _, kn, w, cum_g = delta_rule_tree(q, k, v, decay, beta, s0, anc)
    path = torch.tensor([0, 1, 4, 5])
    short = commit_state(s0, kn, w, cum_g, path[:2], torch.ones(2, dtype=torch.bool))
    padded = commit_state(s0, kn, w, cum_g, path, torch.arange(4) <= torch.tensor(1))
    torch.testing.assert_close(padded, short, atol=0, rtol=0)


def test_conv_sources_follow_the_path_into_the_committed_inputs():
    # root 0, 1 under 0, 2 under 1, 3 under 0; kernel 4: three committed columns 0..2, nodes from 3
    anc = ancestor_mask(Tree.from_lists([-1, 0, 1, 0], [0, 1, 2, 1], [0] * 4))
    assert conv_sources(anc, 4).tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [1, 2, 3, 6]]


def test_memory_against_per_node_snapshots(models):
    """What a tree forward keeps until the commit (per-node vectors) against per-node snapshots of
    the state and conv inputs, at Qwen3-Next-80B's mixer widths and a 64-node tree."""
    cfg = {"v_heads": 32, "k_heads": 16, "dk": 128, "dv": 128, "kernel": 4, "linear_layers": 36}
    ours, snapshots = tree_state_bytes(nodes=65, **cfg)
    assert snapshots / ours > 30  # 1.2 GiB a request for snapshots, tens of MiB here
    model = models["default"]
    cache = model.new_cache(1, 40)
    tree = _random_tree(5, 9)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache)
        model(tree.token[None], cache, mask=ancestor_mask(tree), positions=(3 + tree.depth)[None])
    c = model.cfg
    ours, _ = tree_state_bytes(nodes=9, v_heads=c.linear_num_value_heads, k_heads=c.linear_num_key_heads,
                               dk=c.linear_key_head_dim, dv=c.linear_value_head_dim, kernel=c.linear_conv_kernel_dim,
                               linear_layers=len(c.linear_layers))
    assert cache.pending_bytes() == ours


# --- the model --------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["default", "odd"])
@pytest.mark.parametrize("prefix,n,pad", [(1, 1, 0), (2, 9, 2), (11, 17, 0), (6, 23, 3)])
def test_tree_forward_equals_each_root_path_as_its_own_chain(models, which, prefix, n, pad):
    model = models[which]
    tree = _random_tree(prefix * 100 + n, n, pad)
    anc = ancestor_mask(tree)
    ids = torch.randint(0, VOCAB, (1, prefix), generator=torch.Generator().manual_seed(n))
    with torch.inference_mode():
        cache = model.new_cache(1, prefix + tree.size)
        model(ids, cache)
        state = [s.clone() for s in cache.state] + [c.clone() for c in cache.conv]
        out = model(tree.token[None], cache, mask=anc, positions=(prefix + tree.depth)[None], hidden_layers=(0,))
        # the committed state is untouched by the verify
        assert all(torch.equal(a, b) for a, b in zip(state, list(cache.state) + list(cache.conv)))
        for i, path in enumerate(_paths(anc)):
            chain = model.new_cache(1, prefix + tree.size)
            model(ids, chain)
            ref = model(tree.token[path][None], chain, hidden_layers=(0,))
            torch.testing.assert_close(out.logits[0, i], ref.logits[0, -1], atol=ATOL, rtol=0)
            torch.testing.assert_close(out.hidden[0, i], ref.hidden[0, -1], atol=ATOL, rtol=ATOL)


def _state(cache: HybridCache) -> list[torch.Tensor]:
    n = cache.length
    return (list(cache.state) + list(cache.conv) + [k[:, :, :n] for k in cache.kv.k] + [v[:, :, :n] for v in cache.kv.v])


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 1000), which=st.sampled_from(["default", "odd"]))
def test_repeated_accept_and_reject_leave_exactly_the_accepted_state(models, seed, which):
    """The stale-state class of bug: steps of random trees, each keeping a random root path (the
    root alone = every draft rejected) or dropped whole (rollback to its start), leave the caches a
    chain over the kept tokens would, and the next forward's logits agree."""
    model = models[which]
    g = torch.Generator().manual_seed(seed)
    kept = torch.randint(0, VOCAB, (5,), generator=g).tolist()
    with torch.inference_mode():
        cache = model.new_cache(1, 200)
        model(torch.tensor([kept]), cache)
        for step in range(6):
            n = int(torch.randint(1, 12, (1,), generator=g))
            tree = _random_tree(seed * 7 + step, n, pad=step % 2)
            anc = ancestor_mask(tree)
            start = cache.length
            model(tree.token[None], cache, mask=anc, positions=(start + tree.depth)[None])
            if step == 3:
                cache.rollback(start)  # drop the whole tree: nothing of it stays
                continue
            node = int(torch.randint(0, n, (1,), generator=g))  # padding is never accepted
            path = torch.nonzero(anc[node]).flatten()
            path = path[tree.depth[path].argsort()].tolist()
            cache.commit_path(start, path)
            kept += tree.token[path].tolist()
        fresh = model.new_cache(1, 200)
        model(torch.tensor([kept[:5]]), fresh)
        for i in range(5, len(kept), 4):  # chain forwards of a few tokens
            model(torch.tensor([kept[i : i + 4]]), fresh)
        assert cache.length == fresh.length == len(kept)
        for a, b in zip(_state(cache), _state(fresh)):  # fp32: the fresh chain itself moves by 5.4e-5 with
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-3)  # how it is cut into forwards; 1.9e-4 seen
        nxt = torch.tensor([[7, 8, 9]])
        torch.testing.assert_close(model(nxt, cache).logits, model(nxt, fresh).logits, atol=ATOL, rtol=0)


def test_a_tree_forward_commits_by_path_only(models):
    model = models["default"]
    tree = _random_tree(1, 5)
    with torch.inference_mode():
        cache = model.new_cache(1, 20)
        model(torch.tensor([[1, 2]]), cache)
        model(tree.token[None], cache, mask=ancestor_mask(tree), positions=(2 + tree.depth)[None])
        with pytest.raises(ValueError, match="after a tree forward"):
            cache.rollback(4)
        with pytest.raises(ValueError, match="began at 2"):
            cache.commit_path(3, [0])
        cache.commit_path(2, [0])
        assert cache.length == 3
        with pytest.raises(ValueError, match="was not a tree"):
            cache.commit_path(3, [0])


# --- decoding ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    dirs = build_tiny_hybrid(tmp_path_factory.mktemp("hybrid-tree"))
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
    return (target, load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu"),
            load_drafter(dirs["pard"], target, cfg, dtype=torch.float32, device="cpu"))


@pytest.mark.parametrize("prompt", [b"def f(x):", bytes(range(40, 71))])
def test_tree_loops_equal_ar(loaded, prompt):
    target, dflash, pard = loaded
    prompt = list(prompt)
    common = dict(max_new_tokens=20, eos_token_id=None, mask_token_id=MASK_TOKEN_ID)
    ar = generate_ar(target, prompt, max_new_tokens=20, eos_token_id=None)
    for budget, topk in [(6, 2), (13, 3)]:
        got = generate_dflash_tree(target, dflash, prompt, block_size=4, budget=budget, topk=topk, **common)
        assert got.tokens == ar.tokens
        got = generate_pard_tree(target, pard, prompt, k=4, budget=budget, topk=topk, **common)
        assert got.tokens == ar.tokens


class SecondChoiceDFlash(torch.nn.Module):
    """Proposes the AR continuation with the true token at rank 2 (rank 1 a wrong one) every
    `every` positions: only a tree's second branch accepts it, the first branch must be rejected."""

    def __init__(self, reference: list[int], layers: tuple[int, ...], every: int) -> None:
        super().__init__()
        self.reference, self.target_layer_ids, self.every = reference, layers, every

    def new_cache(self, batch: int, max_len: int):
        from specpilot.runtime.cache import KVCache

        return KVCache([], [], max_len)

    def add_context(self, hidden: torch.Tensor, cache) -> None:
        cache.advance(hidden.shape[1])

    def forward(self, block: torch.Tensor, hidden: torch.Tensor, cache) -> torch.Tensor:
        self.add_context(hidden, cache)
        anchor = cache.length
        logits = torch.full((1, block.shape[1] - 1, VOCAB), -5.0)
        for j in range(1, block.shape[1]):
            p = anchor + j
            token = self.reference[p] if p < len(self.reference) else 0
            second = p % self.every == 0
            logits[0, j - 1, token] = 1.0 if second else 3.0
            logits[0, j - 1, (token + 1) % VOCAB] = 2.0
        return logits


def test_second_choices_are_accepted_through_rejected_first_branches(loaded):
    target, dflash, _ = loaded
    prompt = list(b"x = [")
    reference = prompt + generate_ar(target, prompt, max_new_tokens=40, eos_token_id=None).tokens
    ar = generate_ar(target, prompt, max_new_tokens=24, eos_token_id=None)
    drafter = SecondChoiceDFlash(reference, dflash.target_layer_ids, every=3)
    tree = generate_dflash_tree(target, drafter, prompt, block_size=6, budget=12, topk=2,
                                mask_token_id=MASK_TOKEN_ID, max_new_tokens=24, eos_token_id=None)
    chain = generate_dflash(target, drafter, prompt, block_size=6, mask_token_id=MASK_TOKEN_ID, max_new_tokens=24,
                            eos_token_id=None)
    assert tree.tokens == ar.tokens == chain.tokens
    assert max(chain.accepted) <= 2 < min(tree.accepted[:-1])  # only the tree gets past a second choice


# --- pass and compiler -------------------------------------------------------------------------


def test_tree_verify_applies_to_hybrid_programs(loaded, tmp_path):
    dirs = build_tiny_hybrid(tmp_path / "h")
    cfgs = [json.loads((dirs[k] / "config.json").read_text()) for k in ("target", "dflash")]
    program = lower(*cfgs)
    assert TreeVerify.schedule_space(program)
    tree, [rec] = run_passes(program, [TreeVerify(budget=16, topk=4)])
    assert rec.changed and tree.step.one("verify")[1]["mode"] == "tree"


@pytest.mark.parametrize("passes", ["tree-verify{budget=16, topk=4}", "tree-verify{budget=16, topk=4},cuda-graphs"])
def test_compile_zoo_hybrid_with_tree_verify_passes_token_forcing(tmp_path, passes):
    spec = tmp_path / "pipeline.yaml"
    spec.write_text("name: t\ntarget: code-qwen3-next\ndrafter:\n  kind: dflash\ngpu: h200\ndtype: float32\n"
                    "serving:\n  max_new_tokens: 16\nbenchmark:\n  prompts: code-smoke\n  num_prompts: 2\n")
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["compile", str(spec), "--passes", passes, "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["outputs_equal_ar"] == "2/2" and report["tokens_checked"] == 32
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] and validation["hard_failures"] == 0
    assert ("graphs=true" in (out / "ir.txt").read_text()) == ("cuda-graphs" in passes)


# --- the Triton kernel in the model ------------------------------------------------------------


@pytest.mark.interpreter
def test_tree_forward_on_the_kernel_equals_the_reference(models, device):
    """The kernel installed in every Gated DeltaNet layer (interpreter on CPU, native on a GPU): the
    same tree logits as the runtime's torch form, and the same committed state."""
    from specpilot.backends.kernel_hooks import install_gdn_tree

    model = _model(**ODD).to(device)
    assert install_gdn_tree(model, "triton") == 2
    ref = models["odd"].to(device)
    tree = _random_tree(11, 10, pad=1).to(device)
    anc = ancestor_mask(tree)
    ids = torch.tensor([[3, 1, 4, 1, 5]], device=device)
    out = {}
    with torch.inference_mode():
        for name, m in (("kernel", model), ("torch", ref)):
            cache = m.new_cache(1, 30)
            m(ids, cache)
            logits = m(tree.token[None], cache, mask=anc, positions=(5 + tree.depth)[None]).logits
            cache.commit_path(5, [0] + [int(j) for j in torch.nonzero(anc[9]).flatten()[1:]])
            out[name] = (logits, list(cache.state))
    torch.testing.assert_close(out["kernel"][0], out["torch"][0], atol=ATOL, rtol=0)
    for a, b in zip(out["kernel"][1], out["torch"][1]):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16, 33, 65])
def test_kernel_at_8b_widths_on_the_gpu(n):
    """Qwen3-Next / 8B-class mixer widths (32 value heads, dk = dv = 128), trees of 16-65 nodes."""
    from specpilot.kernels import KERNELS
    from specpilot.kernels.gdn_tree import gdn_tree, gdn_tree_reference

    inputs = KERNELS["gdn_tree"].make_inputs(dict(B=1, H=32, n=n, dk=128, dv=128), "cuda", n)
    for a, b in zip(gdn_tree(*inputs), gdn_tree_reference(*inputs)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --- graphed loops: device-side lengths ----------------------------------------------------------


def test_device_length_cache_commits_and_rolls_back_as_the_host_one(models):
    """The same verifies with the length, the rollback target, the path and its accepted count as
    device tensors (the path padded past n, as graphed steps pass it): the same caches."""
    model = models["odd"]
    g = torch.Generator().manual_seed(8)
    with torch.inference_mode():
        host, dev = model.new_cache(1, 120), model.new_cache(1, 120, device_length=True)
        prompt = torch.randint(0, VOCAB, (1, 7), generator=g)
        for cache in (host, dev):
            model(prompt, cache)
        for step in range(5):
            tree = _random_tree(step, 9, pad=2)
            anc = ancestor_mask(tree)
            node = int(torch.randint(0, 9, (1,), generator=g))
            path = torch.nonzero(anc[node]).flatten()
            path = path[tree.depth[path].argsort()]
            padded = torch.cat([path, torch.zeros(12 - len(path), dtype=torch.long)])
            for cache in (host, dev):
                start = cache.length if cache is host else cache.length.clone()
                model(tree.token[None], cache, mask=anc, positions=(start + tree.depth)[None])
                if cache is host:
                    cache.commit_path(start, path.tolist())
                else:
                    cache.commit_path(start, padded, torch.tensor(len(path) - 1))
            chain = torch.randint(0, VOCAB, (1, 5), generator=g)  # a chain verify, then a partial rollback
            keep = int(torch.randint(0, 6, (1,), generator=g))
            for cache in (host, dev):
                start = cache.length if cache is host else cache.length.clone()
                model(chain, cache)
                cache.rollback(start + keep)
        assert int(dev.length) == host.length
        for a, b in zip(list(host.state) + list(host.conv), list(dev.state) + list(dev.conv), strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
        for a, b in zip(host.kv.k, dev.kv.k):
            torch.testing.assert_close(b[:, :, : host.length], a[:, :, : host.length], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("prompt", [b"def f(x):", bytes(range(40, 71))])
def test_graphed_loops_equal_ar(loaded, prompt):
    """graph_decode's loops on the hybrid target (on a CPU the step runs uncaptured)."""
    from specpilot.runtime import graph_decode

    target, dflash, pard = loaded
    prompt = list(prompt)
    common = dict(max_new_tokens=20, eos_token_id=None)
    ar = generate_ar(target, prompt, **common)
    assert graph_decode.generate_ar_graphed(target, prompt, **common).tokens == ar.tokens
    spec = dict(mask_token_id=MASK_TOKEN_ID, **common)
    assert graph_decode.generate_dflash_graphed(target, dflash, prompt, block_size=4, **spec).tokens == ar.tokens
    assert graph_decode.generate_pard_graphed(target, pard, prompt, k=4, **spec).tokens == ar.tokens
    tree = dict(budget=9, topk=3, **spec)
    assert graph_decode.generate_dflash_tree_graphed(target, dflash, prompt, block_size=4, **tree).tokens == ar.tokens
    assert graph_decode.generate_pard_tree_graphed(target, pard, prompt, k=4, **tree).tokens == ar.tokens


@pytest.mark.gpu
def test_graphed_hybrid_tree_loop_captures_on_the_gpu(tmp_path):
    """The hybrid pair's tree step captured in one CUDA graph (the gdn_tree kernel inside): AR's tokens."""
    from specpilot.backends.kernel_hooks import install_gdn_tree, tree_builder
    from specpilot.runtime import graph_decode

    dirs = build_tiny_hybrid(tmp_path / "h")
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cuda")
    dflash = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cuda")
    install_gdn_tree(target, "triton")
    prompt = list(b"def f(x):")
    ar = generate_ar(target, prompt, max_new_tokens=24, eos_token_id=None)
    out = graph_decode.generate_dflash_tree_graphed(target, dflash, prompt, block_size=4, budget=9, topk=3,
                                                    mask_token_id=MASK_TOKEN_ID, max_new_tokens=24, eos_token_id=None,
                                                    build=tree_builder(torch.device("cuda")))
    assert out.tokens == ar.tokens
