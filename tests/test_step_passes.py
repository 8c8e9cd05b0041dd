"""The `fused-decoder` and `cuda-graphs` passes: what each changes, where each applies, and
losslessness through the CLI (token forcing on every output token)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specpilot.cli import main
from specpilot.ir import lower, print_program
from specpilot.ir.verify import program_problems
from specpilot.passes import lookup
from specpilot.passes.cuda_graphs import CudaGraphs
from specpilot.passes.fused_decoder import FusedDecoder, is_fused
from specpilot.passes.tree_verify import TreeVerify
from specpilot.runtime.tiny_hybrid import build_tiny_hybrid

from conftest import tiny_spec
from test_ir import DFLASH, PARD, TARGET


def program_for(kind):
    return lower(TARGET, DFLASH if kind == "dflash" else PARD)


def _diff(before, after):
    a, b = print_program(before).splitlines(), print_program(after).splitlines()
    return [(x, y) for x, y in zip(a, b) if x != y]


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_cuda_graphs_changes_accept_and_schedule_only(kind):
    p = program_for(kind)
    r = CudaGraphs().apply(p)
    assert r.changed and not program_problems(r.program)
    changed = _diff(p, r.program)
    assert len(changed) == 2
    assert all("accept" in x or "schedule" in x for x, _ in changed)
    assert r.program.step.one("accept")[1]["on"] == "device"
    assert not CudaGraphs().apply(r.program).changed  # idempotent
    assert CudaGraphs.schedule_space(r.program) == []


@pytest.mark.parametrize("order", ["graphs-then-tree", "tree-then-graphs"])
def test_graphed_trees_in_either_order(order):
    p = program_for("dflash")
    if order == "graphs-then-tree":
        t = TreeVerify(budget=16, topk=2).apply(CudaGraphs().apply(p).program).program
    else:
        t = CudaGraphs().apply(TreeVerify(budget=16, topk=2).apply(p).program).program
    assert not program_problems(t)
    accept = t.step.one("accept")[1]
    assert accept["on"] == "device" and accept["rule"] == "tree-path"
    assert t.step.node(t.step.find("schedule")[0]).get("graphs")


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_fused_decoder_marks_target_and_drafter_layers(kind):
    p = program_for(kind)
    r = FusedDecoder().apply(p)
    assert r.changed and is_fused(r.program.target) and is_fused(r.program.drafter)
    assert not program_problems(r.program)
    changed = _diff(p, r.program)
    assert changed and all(x.split()[0] == y.split()[0] for x, y in changed)  # the same nodes, other kernels
    assert all('kernel="triton-fused"' in y for _, y in changed)
    if kind == "dflash":  # the context projection's norm too: FusedDFlash.add_context runs it on the kernel
        assert r.program.drafter.node("context_norm").get("kernel") == "triton-fused"
    assert FusedDecoder.schedule_space(r.program) == []
    assert lookup("fused-decoder") is FusedDecoder and lookup("cuda-graphs") is CudaGraphs


def test_fused_decoder_leaves_a_hybrid_target_but_fuses_its_dflash_drafter(tmp_path):
    dirs = build_tiny_hybrid(tmp_path)
    target, dflash = (json.loads((dirs[k] / "config.json").read_text()) for k in ("target", "dflash"))
    r = FusedDecoder().apply(lower(target, dflash))
    assert r.changed and not is_fused(r.program.target) and is_fused(r.program.drafter)
    assert not program_problems(r.program)


@pytest.mark.parametrize("kind,family", [("dflash", "qwen3"), ("pard", "llama")])
def test_compile_fused_and_graphed_passes_token_forcing(kind, family, tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    # the kernels' references on the CPU: under the interpreter (set by the kernel tests) a whole
    # compile takes minutes; tests/test_fused_decoder.py runs the kernels themselves in a loop
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(tiny_spec(kind, family))
    out = tmp_path / "engine"
    passes = "fused-decoder,cuda-graphs" + (",tree-verify{budget=8, topk=2}" if kind == "pard" else "")
    r = CliRunner().invoke(main, ["compile", str(spec), "--passes", passes, "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"] == passes
    assert report["outputs_equal_ar"] == "2/2"
    assert json.loads((out / "validation.json").read_text())["passed"]
    ir = (out / "ir.txt").read_text()
    assert 'kernel="triton-fused"' in ir and "graphs=true" in ir
