"""Hybrid (Gated DeltaNet) verify steps move no data between host and device, so CUDA graphs
capture them: the chain verify and its rollback on either cache, the tree verify, and the
device-length cache's commit, each run under `host_guard.no_host_traffic` (which raises where a
capture would refuse: a tensor made from host values, a device value read on the host)."""

from __future__ import annotations

import pytest
import torch

from host_guard import HostTraffic, host_traffic_allowed, no_host_traffic
from specpilot.hf.config import HybridConfig
from specpilot.runtime.hybrid import RECORD_LIMIT, HybridTransformer, unfuse_experts
from specpilot.runtime.hybrid_tree import chain_sources, conv_sources
from specpilot.runtime.tiny_hybrid import random_hybrid, tiny_hybrid_config
from specpilot.runtime.tree import Tree, ancestor_mask

pytestmark = pytest.mark.usefixtures("torch_single_thread")

VOCAB = 258
PREFIX = 7


@pytest.fixture(scope="module")
def model() -> HybridTransformer:
    config = tiny_hybrid_config(VOCAB, linear_conv_kernel_dim=3, linear_key_head_dim=12, linear_value_head_dim=20)
    hf = random_hybrid(config, seed=0, norm_std=0.2)
    ours = HybridTransformer(HybridConfig.from_hf(config.to_dict(), "config.json"))
    ours.load_state_dict(unfuse_experts(hf.state_dict()), strict=True)
    return ours.eval()


def _prefilled(model: HybridTransformer, device_length: bool):
    cache = model.new_cache(1, 160, device_length=device_length)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        model(torch.randint(0, VOCAB, (1, PREFIX), generator=g), cache)
    return cache


def _snapshot(cache) -> list[torch.Tensor]:
    return [x.clone() for x in (*cache.state, *cache.conv)]


def test_the_guard_refuses_host_traffic():
    x = torch.arange(4)
    for bad in (lambda: torch.as_tensor(3), lambda: torch.tensor([1, 2]), lambda: x.sum().item(),
                lambda: x.tolist(), lambda: bool(x[0] > 1), lambda: x[[0, 2]], lambda: torch.nonzero(x)):
        with pytest.raises(HostTraffic), no_host_traffic():
            bad()
    with no_host_traffic():  # device-side work passes
        y = torch.where(x > 1, x, torch.zeros_like(x)).index_select(0, x[:2]) + torch.full((), 2)
    assert y.tolist() == [2, 2]


@pytest.mark.parametrize("device_length", [False, True])
@pytest.mark.parametrize("t", [1, 2, 5, RECORD_LIMIT])
def test_chain_verify_and_its_rollback_stay_on_the_device(model, device_length, t):
    """A verify of t tokens then the rollback to its start (what a timed or graphed step repeats)
    touch no host value, and the rollback restores the state exactly."""
    cache = _prefilled(model, device_length)
    start = cache.length.clone() if device_length else cache.length
    before = _snapshot(cache)
    ids = torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(t))
    with torch.inference_mode(), no_host_traffic():
        first = model(ids, cache).logits
        cache.rollback(start)
        again = model(ids, cache).logits
        cache.rollback(start)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    for a, b in zip(_snapshot(cache), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_chain_rollback_inside_the_forward_on_the_device(model):
    """A device-length rollback to a position inside the chain equals the host cache's."""
    host, dev = _prefilled(model, False), _prefilled(model, True)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        model(ids, host)
        host.rollback(PREFIX + 4)
        with no_host_traffic():
            model(ids, dev)
            dev.rollback(dev.length - 2)
    assert int(dev.length) == host.length
    for a, b in zip(_snapshot(dev), _snapshot(host)):  # the attention masks differ in form: rounding only
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [None, 2])
def test_tree_verify_and_device_commit_stay_on_the_device(model, n):
    parent, depth = [-1, 0, 1, 1, 2, 4], [0, 1, 2, 2, 3, 4]
    tree = Tree.from_lists(parent, depth, [5, 6, 7, 8, 9, 10])
    anc = ancestor_mask(tree)
    path = torch.tensor([0, 1, 2, 4, 5]) if n is None else torch.tensor([0, 1, 3, 0, 0])
    count = None if n is None else torch.tensor(n)
    cache = _prefilled(model, True)
    chain = _prefilled(model, False)
    with torch.inference_mode():
        with no_host_traffic():
            start = cache.length.clone()
            model(tree.token[None], cache, mask=anc, positions=(start + tree.depth)[None])
            cache.commit_path(start, path, count)
        kept = path[: (len(path) if n is None else n + 1)]
        model(tree.token[kept][None], chain)  # the accepted path as a chain
    assert int(cache.length) == chain.length
    for a, b in zip(_snapshot(cache), _snapshot(chain)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,kernel", [(1, 4), (2, 2), (5, 3), (17, 4)])
def test_chain_sources_are_conv_sources_of_a_chain(t, kernel):
    chain = torch.ones(t, t, dtype=torch.bool).tril()
    assert torch.equal(chain_sources(t, kernel, "cpu"), conv_sources(chain, kernel))


def test_graphed_loops_steps_touch_no_host_value(tmp_path, monkeypatch):
    """Every step graph_decode replays for the hybrid pair (AR, chains, trees; on a CPU the step runs
    uncaptured) moves no data between host and device, and the loops still give AR's tokens."""
    from specpilot.runtime import graph_decode
    from specpilot.runtime.decode import generate_ar
    from specpilot.runtime.load import load_drafter, load_target
    from specpilot.runtime.tiny_hybrid import MASK_TOKEN_ID, build_tiny_hybrid
    from specpilot.runtime.tree import best_first_tree_padded

    def guarded(self) -> None:
        with no_host_traffic():
            self.fn()

    monkeypatch.setattr(graph_decode.GraphedStep, "__call__", guarded)
    dirs = build_tiny_hybrid(tmp_path / "h")
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
    dflash = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu")
    pard = load_drafter(dirs["pard"], target, cfg, dtype=torch.float32, device="cpu")
    prompt = list(b"def f(x):")
    common = dict(max_new_tokens=12, eos_token_id=None)
    ar = generate_ar(target, prompt, **common).tokens
    spec = dict(mask_token_id=MASK_TOKEN_ID, **common)
    def build(*args):  # the CPU's tree builder is a heap on the host by design (a GPU's is a kernel)
        with host_traffic_allowed():
            return best_first_tree_padded(*args)

    tree = dict(budget=9, topk=3, build=build, **spec)
    assert graph_decode.generate_ar_graphed(target, prompt, **common).tokens == ar
    assert graph_decode.generate_dflash_graphed(target, dflash, prompt, block_size=4, **spec).tokens == ar
    assert graph_decode.generate_pard_graphed(target, pard, prompt, k=4, **spec).tokens == ar
    assert graph_decode.generate_dflash_tree_graphed(target, dflash, prompt, block_size=4, **tree).tokens == ar
    assert graph_decode.generate_pard_tree_graphed(target, pard, prompt, k=4, **tree).tokens == ar


SMOKE = ["--smoke", "--budgets", "3,5", "--chains", "3", "--repeats", "2"]


def test_hybrid_steps_bench_smoke(tmp_path):
    """bench.steps.hybrid_tree_steps on the CPU: every row it plans, each timed (the commit alone is
    more than nothing), the file marked complete."""
    import json

    from bench.steps import hybrid_tree_steps

    assert hybrid_tree_steps.main([*SMOKE, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hybrid_tree_steps_cpu.json").read_text())
    rows = {r["what"]: r for r in result["records"]}
    assert list(rows) == ["ar", "chain-3-kernel", "chain-3-torch", "chain-3-tree", "tree-3-kernel", "tree-3-torch", "commit-3",
                          "tree-5-kernel", "tree-5-torch", "commit-5"]
    assert result["complete"] and result["rows_planned"] == len(rows)
    for row in rows.values():
        assert row["ms"] > 0 and row["p20_ms"] <= row["ms"] <= row["p80_ms"] and row["torch_ops"] > 0, row
    assert rows["commit-5"]["path_nodes"] == 6 and rows["commit-3"]["path_nodes"] == 4


def test_hybrid_steps_bench_keeps_the_rows_of_a_cut_run(tmp_path, monkeypatch):
    """A run stopped part way (here by an error in its fifth row; on a GPU by its time limit) has
    written the rows before it, marked incomplete."""
    import json

    from bench.steps import hybrid_tree_steps

    calls = []

    def install(model, kind):
        calls.append(kind)
        if len(calls) == 4:
            raise KeyboardInterrupt("cut")

    monkeypatch.setattr(hybrid_tree_steps, "install_gdn_tree", install)
    with pytest.raises(KeyboardInterrupt):
        hybrid_tree_steps.main([*SMOKE, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "hybrid_tree_steps_cpu.json").read_text())
    assert [r["what"] for r in result["records"]] == ["ar", "chain-3-kernel", "chain-3-torch", "chain-3-tree"]
    assert result["complete"] is False
