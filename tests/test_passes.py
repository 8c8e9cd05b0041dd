"""The pass base, registry and manager, the draft-block-size pass, pass parameters against the
deployment's limits, and that every choice a pass or rule can set is run by the backend."""

import pytest
import torch

from specpilot.backends.torch_backend import CastLinear, U12Linear, build_engine
from specpilot.errors import PipelineError
from specpilot.hf.checkpoint import read_config
from specpilot.ir import OPS, lower, print_program, verify_program
from specpilot.passes import REGISTRY, lookup, pipeline_string, run_passes
from specpilot.passes.attention_split_kv import AttentionSplitKV
from specpilot.passes.block_size import DraftBlockSize
from specpilot.passes.cuda_graphs import CudaGraphs
from specpilot.passes.draft_vocab import DraftVocab
from specpilot.passes.fused_decoder import FusedDecoder
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.weights_u12 import WeightsU12
from specpilot.passes.what_if import what_ifs
from specpilot.runtime import decode, graph_decode, tree_decode
from specpilot.runtime.draft_vocab import SubsetHead
from specpilot.runtime.model import attend_visible

from test_ir import DFLASH, PARD, TARGET


def test_block_size_changes_exactly_the_step_graph():
    p = lower(TARGET, DFLASH)
    q, [rec] = run_passes(p, [DraftBlockSize(size=4)])
    assert rec.changed and rec.before != rec.after and rec.lossless
    assert q.target == p.target and q.drafter == p.drafter
    assert q.step.one("draft")[1]["block_size"] == 4
    assert q.step.one("propose")[1]["budget"] == 3
    assert q.step.one("verify")[1]["q"] == 4
    before, after = print_program(p).splitlines(), print_program(q).splitlines()
    assert sum(a != b for a, b in zip(before, after)) == 3  # draft, propose, verify lines


def test_block_size_pard_counts_k_drafts():
    p = lower(TARGET, PARD)
    q, _ = run_passes(p, [DraftBlockSize(size=6)])
    assert q.step.one("verify")[1]["q"] == 7


def test_no_change_is_reported():
    p = lower(TARGET, DFLASH)
    q, [rec] = run_passes(p, [DraftBlockSize(size=8)])
    assert not rec.changed and q == p


def test_schedule_space_only_lists_changes():
    p = lower(TARGET, DFLASH)
    space = DraftBlockSize.schedule_space(p)
    assert space and all(s.size != 8 for s in space)
    for candidate in space:
        assert candidate.apply(p).changed


def test_spec_and_params():
    assert DraftBlockSize(size=4).spec() == "draft-block-size{size=4}"
    assert pipeline_string([DraftBlockSize(size=4), DraftBlockSize(size=2)]) == (
        "draft-block-size{size=4},draft-block-size{size=2}")
    assert lookup("draft-block-size").from_params({"size": 12}) == DraftBlockSize(size=12)
    with pytest.raises(PipelineError, match="no parameter 'sizes'"):
        DraftBlockSize.from_params({"sizes": 3})
    with pytest.raises(PipelineError, match="expects int, got \"x\""):
        DraftBlockSize.from_params({"size": "x"})
    with pytest.raises(PipelineError, match="size must be >= 1"):
        DraftBlockSize.from_params({"size": 0})
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        lookup("nope")
    assert "draft-block-size" in REGISTRY


# -- every choice a pass or rule can set is run by the backend, or refused by the verifier

def _program(dirs, kind, dtype="float32"):
    target, drafter = (read_config(dirs[k])[0] for k in ("target", kind))
    return lower(target, drafter, dtype=dtype)


def _set(program, level, op, **attrs):
    """Every `op` node of a graph with `attrs` (what a rule's `set` does)."""
    graph, _ = program.graph(level).map_nodes(lambda _, node: node.replace(**attrs) if node.op == op else None)
    return program.with_graph(level, graph)


class Spy:
    """Stands in for a decode loop: records the keyword arguments the backend chose."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return "spied"


def loop_called(monkeypatch, engine, module, name):
    spy = Spy()
    monkeypatch.setattr(module, name, spy)
    assert engine.generate([1, 2, 3], 4) == "spied"
    return spy.calls[0]


def _engine(dirs, program, kind):
    return build_engine(verify_program(program), dirs["target"], dirs[kind], torch.device("cpu"))


# (op, attribute) pairs each case below shows the backend running
HONOURED = {
    ("draft", "block_size"), ("propose", "shape"), ("propose", "budget"), ("propose", "topk"), ("verify", "mode"),
    ("verify", "q"), ("accept", "rule"), ("commit", "kv"), ("accept", "on"), ("schedule", "graphs"),
    ("linear", "format"), ("lm_head", "format"), ("linear", "kernel"), ("lm_head", "kernel"), ("linear", "layout"),
    ("lm_head", "layout"), ("lm_head", "vocab_subset"), ("lm_head", "vocab_corpus"), ("rmsnorm", "kernel"),
    ("rope", "kernel"), ("mlp", "kernel"), ("attention", "kernel"),
    # the batched engine's (Engine.batched): tests/test_batch_passes.py runs each
    ("schedule", "policy"), ("schedule", "batch"), ("schedule", "verify_budget"), ("schedule", "ragged"),
    ("schedule", "spec_control"), ("schedule", "spec_off_below"),
    ("verify", "first"), ("verify", "exit_layer"),  # tests/test_two_level.py: the first level reaches the loops
}
# (op, attribute) pairs with one value a backend runs: anything else is refused (test_ir.py)
ONE_VALUE: dict[tuple[str, str], object] = {}


def test_every_choice_in_the_schemas_is_honoured_or_has_one_value():
    """A choice added to node.OPS needs a case here (run by the backend) or a single allowed value."""
    choices = {(op, key) for op, schema in OPS.items() for key in schema.choices}
    assert choices == HONOURED | set(ONE_VALUE)
    assert OPS["schedule"].allowed("policy") == {"static", "continuous"}


def test_block_size_and_the_tree_reach_the_loops(tiny_model_dirs, monkeypatch):
    dirs = tiny_model_dirs["qwen3"]
    p = _program(dirs, "pard")
    chain = run_passes(p, [DraftBlockSize(size=3)])[0]
    assert loop_called(monkeypatch, _engine(dirs, chain, "pard"), decode, "generate_pard")["k"] == 3
    tree = run_passes(chain, [TreeVerify(budget=5, topk=2)])[0]
    kwargs = loop_called(monkeypatch, _engine(dirs, tree, "pard"), tree_decode, "generate_pard_tree")
    assert (kwargs["k"], kwargs["budget"], kwargs["topk"]) == (3, 5, 2)
    d = _program(dirs, "dflash")
    dchain = run_passes(d, [DraftBlockSize(size=5)])[0]
    assert loop_called(monkeypatch, _engine(dirs, dchain, "dflash"), decode, "generate_dflash")["block_size"] == 5


def test_device_acceptance_and_graphs_choose_the_graphed_loops(tiny_model_dirs, monkeypatch):
    dirs = tiny_model_dirs["qwen3"]
    graphed = run_passes(_program(dirs, "pard"), [CudaGraphs()])[0]
    loop_called(monkeypatch, _engine(dirs, graphed, "pard"), graph_decode, "generate_pard_graphed")
    tree = run_passes(graphed, [TreeVerify(budget=5, topk=2)])[0]
    assert loop_called(monkeypatch, _engine(dirs, tree, "pard"), graph_decode, "generate_pard_tree_graphed")["budget"] == 5


def test_weight_formats_kernels_and_layouts_choose_the_modules(tiny_model_dirs):
    dirs = tiny_model_dirs["qwen3"]
    p = _program(dirs, "pard")  # float32
    half = _engine(dirs, _set(_set(p, "target", "lm_head", format="bfloat16"), "target", "linear", format="float16"),
                   "pard")
    assert isinstance(half.target.lm_head, CastLinear) and half.target.lm_head.weight.dtype == torch.bfloat16
    assert half.target.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    b = _program(dirs, "pard", dtype="bfloat16")
    rows = run_passes(b, [WeightsU12(min_numel=1, kernel="torch", layout="rows")])[0]
    tiles = _set(rows, "target", "linear", kernel="triton-u12", layout="tiles")
    tiles = _set(tiles, "target", "lm_head", kernel="triton-u12")  # [300, 64] does not tile: it stays rows
    for program, kernel, layout in ((rows, "torch", "rows"), (tiles, "triton-u12", "tiles")):
        engine = _engine(dirs, program, "pard")
        q_proj = engine.target.model.layers[0].self_attn.q_proj
        assert isinstance(q_proj, U12Linear) and (q_proj.kernel, q_proj.packed.layout) == (kernel, layout)
        assert isinstance(engine.target.lm_head, U12Linear) and engine.target.lm_head.kernel == kernel


def test_a_drafter_head_subset_and_its_corpus_are_built(tiny_model_dirs, tmp_path):
    dirs = tiny_model_dirs["qwen3"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 20)
    p = run_passes(_program(dirs, "pard"), [DraftVocab(size=40, corpus=str(corpus))])[0]
    engine = _engine(dirs, p, "pard")
    assert engine.draft_vocab.ids.numel() == 40 and engine.draft_vocab.corpus == str(corpus)
    assert isinstance(engine.drafter.model.lm_head, SubsetHead)


def test_fused_stacks_and_split_kv_attention_are_installed(tiny_model_dirs):
    dirs = tiny_model_dirs["qwen3"]
    p = _program(dirs, "pard")
    plain = _engine(dirs, p, "pard")
    assert plain.target.fused is None and plain.target.model.layers[0].self_attn.attention is attend_visible
    fused = _engine(dirs, run_passes(p, [FusedDecoder()])[0], "pard")
    assert fused.target.fused is not None and fused.drafter.model.fused is not None
    split = _engine(dirs, run_passes(p, [AttentionSplitKV()])[0], "pard")
    assert all(layer.self_attn.attention is not attend_visible for layer in split.target.model.layers)


# -- pass parameters against the deployment's limits

@pytest.mark.parametrize("make, fragments", [
    (lambda: DraftBlockSize(size=5000), ["'draft-block-size'", "'size' = 5000", "expected 1..2046", "2048 positions"]),
    (lambda: TreeVerify(budget=2047, topk=2), ["'tree-verify'", "'budget' = 2047", "expected 1..2046"]),
    (lambda: TreeVerify(budget=8, topk=10**9), ["'topk' = 1000000000", "expected 1..300 (ranks"]),
])
def test_parameters_outside_the_deployment_are_refused_before_anything_runs(make, fragments):
    p = lower(dict(TARGET, max_position_embeddings=2048), PARD)  # the drafter holds 4096 (the default); vocabulary 300
    with pytest.raises(PipelineError) as e:
        run_passes(p, [make()], where="pipeline.yaml: field 'passes': ")
    assert str(e.value).startswith("pipeline.yaml: field 'passes': pass ")
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_a_dflash_block_needs_its_anchor_and_a_draft():
    with pytest.raises(PipelineError, match=r"'size' = 1 is out of range for this deployment: expected 2\.\.2047 "
                                            r"\(a DFlash block is the anchor and at least one draft"):
        run_passes(lower(dict(TARGET, max_position_embeddings=2048), DFLASH), [DraftBlockSize(size=1)])
    assert all(s.size >= 2 for s in DraftBlockSize.schedule_space(lower(TARGET, DFLASH)))


def test_the_what_ifs_offer_only_instances_that_fit(monkeypatch):
    p = lower(dict(TARGET, max_position_embeddings=20), PARD)  # a verify of at most 19 tokens
    offered = what_ifs(p)
    budgets = {w.instance.budget for w in offered if w.pass_name == "tree-verify"}
    assert budgets == {15, 16}  # of 15, 16, 31, 32, 64, 128
    assert max(w.instance.size for w in offered if w.pass_name == "draft-block-size") == 16
    assert all(w.closes for w in offered) and "draft-vocab" not in {w.pass_name for w in offered}
