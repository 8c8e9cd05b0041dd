"""The batched engine's passes (verify-budget, ragged-verify, spec-control) and the schedule node:
what each changes, where each applies, what the verifier refuses, and losslessness of the engine
each program builds (every output token forced against the stock target)."""

from __future__ import annotations

import pytest
import torch

from specpilot.backends.torch_backend import build_engine
from specpilot.dsl import parse_pipeline
from specpilot.ir import lower, print_program
from specpilot.ir.verify import program_problems
from specpilot.passes import run_passes
from specpilot.passes.cuda_graphs import CudaGraphs
from specpilot.passes.ragged_verify import RaggedVerify
from specpilot.passes.spec_control import SpecControl
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.verify_budget import VerifyBudget
from specpilot.runtime.batch import generate_batched
from specpilot.runtime.batch_control import StepCost
from specpilot.validate.forcing import force_tokens

from test_ir import DFLASH, PARD, TARGET

PASSES = [(VerifyBudget(), {"verify_budget": True}), (RaggedVerify(), {"ragged": True}),
          (SpecControl(off_below=0.2), {"spec_control": True, "spec_off_below": 0.2})]


def schedule(program):
    return program.step.one("schedule")[1]


def test_lowering_honours_the_batch():
    assert schedule(lower(TARGET, DFLASH))["policy"] == "static"
    s = schedule(lower(TARGET, DFLASH, batch=8))
    assert (s["policy"], s["batch"]) == ("continuous", 8)


@pytest.mark.parametrize("kind", ["dflash", "pard"])
@pytest.mark.parametrize("pass_, attrs", PASSES, ids=[p.name for p, _ in PASSES])
def test_each_pass_changes_the_schedule_only(kind, pass_, attrs):
    p = lower(TARGET, DFLASH if kind == "dflash" else PARD, batch=4)
    assert type(pass_).schedule_space(p)
    r = pass_.apply(p)
    assert r.changed and not program_problems(r.program)
    before, after = print_program(p).splitlines(), print_program(r.program).splitlines()
    changed = [(x, y) for x, y in zip(before, after) if x != y]
    assert len(changed) == 1 and "schedule" in changed[0][0]
    assert {k: schedule(r.program).get(k) for k in attrs} == attrs
    assert not pass_.apply(r.program).changed  # idempotent
    assert pass_ not in type(pass_).schedule_space(r.program)


@pytest.mark.parametrize("pass_, _", PASSES, ids=[p.name for p, _ in PASSES])
def test_a_batch1_program_becomes_continuous(pass_, _):
    r = pass_.apply(lower(TARGET, DFLASH))
    assert schedule(r.program)["policy"] == "continuous" and schedule(r.program)["batch"] == 1


@pytest.mark.parametrize("pass_, _", PASSES, ids=[p.name for p, _ in PASSES])
@pytest.mark.parametrize("before", ["tree", "graphs"])
def test_passes_leave_what_the_batched_engine_cannot_run(pass_, _, before):
    if before == "tree" and isinstance(pass_, RaggedVerify):  # trees' nodes pack raggedly too
        r = pass_.apply(TreeVerify(budget=8, topk=2).apply(lower(TARGET, DFLASH)).program)
        assert r.changed and not program_problems(r.program)
        return
    p = (TreeVerify(budget=8, topk=2) if before == "tree" else CudaGraphs()).apply(lower(TARGET, DFLASH)).program
    r = pass_.apply(p)
    assert not r.changed and ("tree-verify" in r.summary or "graphs" in r.summary)
    assert type(pass_).schedule_space(p) == []


def test_verifier_refuses_batches_it_cannot_run():
    p = lower(TARGET, DFLASH, batch=4)
    name, node = p.step.one("schedule")
    static = p.with_graph("step", p.step.with_node(name, node.replace(policy="static")))
    assert any("batch=4" in e for e in program_problems(static))
    flag = lower(TARGET, DFLASH)
    n2, s2 = flag.step.one("schedule")
    flagged = flag.with_graph("step", flag.step.with_node(n2, s2.replace(ragged=True)))
    assert any("continuous" in e for e in program_problems(flagged))
    graphed = CudaGraphs().apply(p).program
    assert any("ungraphed" in e for e in program_problems(graphed))


def test_pipeline_strings_parse_to_the_passes():
    passes = parse_pipeline("verify-budget,ragged-verify,spec-control{off-below=0.3}", source="test")
    assert [p.spec() for p in passes] == ["verify-budget", "ragged-verify", "spec-control{off-below=0.3}"]


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_every_mechanism_is_lossless_under_token_forcing(tiny_model_dirs, torch_single_thread, monkeypatch, kind):
    """The engine the program builds serves prompts arriving over steps; every output token is
    forced against the stock target (the passes' lossless contract)."""
    from specpilot.hf.checkpoint import read_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # SDPA per request: the kernel has its own tests
    dirs = tiny_model_dirs["qwen3"]
    program = lower(read_config(dirs["target"])[0], read_config(dirs[kind])[0], block_size=4, batch=3)
    program, _ = run_passes(program, parse_pipeline("verify-budget,ragged-verify,spec-control", source="test"))
    engine = build_engine(program, dirs["target"], dirs[kind], torch.device("cpu"))
    cost = StepCost.from_table({1: 1.0, 8: 1.3, 32: 3.0}, {1: 0.2, 3: 0.3})
    batched = engine.batched(capacity=64, cost=cost)
    assert batched.policy.verify_budget and batched.policy.ragged and batched.policy.spec_control
    assert batched.max_batch == 3 and batched.policy.off_below == 0.1 and batched.block_size == 4
    prompts = [[5, 6, 7, 8], [100, 200], [42] * 9, [10, 20, 30], [7]]
    outs = generate_batched(batched, prompts, 8, arrivals=[0, 0, 1, 3, 3])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) > 0


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_batched_graphs_graph_the_drafting_and_the_verify(tiny_model_dirs, torch_single_thread, monkeypatch, kind):
    """`TorchEngine.batched(graphs=True)`: the drafter's forwards and the verify run over their graphs'
    static shapes (replays on a GPU), the step-cost table profiled on them too; every output token
    forced against the stock target (tree programs: tests/test_batch_tree_graphs.py)."""
    from specpilot.hf.checkpoint import read_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dirs = tiny_model_dirs["qwen3"]
    program = lower(read_config(dirs["target"])[0], read_config(dirs[kind])[0], block_size=4, batch=3)
    program, _ = run_passes(program, parse_pipeline("verify-budget,ragged-verify,spec-control", source="test"))
    engine = build_engine(program, dirs["target"], dirs[kind], torch.device("cpu"))
    batched = engine.batched(capacity=64, graphs=True)  # no cost: profiled on the graphed forwards
    profiled = dict(batched.graphed_draft.replays)
    assert batched.config.graphs and batched.graphed.steps and profiled[{"dflash": "block"}.get(kind, kind)] > 0
    prompts = [[5, 6, 7, 8], [100, 200], [42] * 9, [10, 20, 30], [7]]
    outs = generate_batched(batched, prompts, 8, arrivals=[0, 0, 1, 3, 3])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) > 0
    assert batched.graphed_draft.replays["eager"] == 0


def test_batched_trees_are_lossless_under_token_forcing(tiny_model_dirs, torch_single_thread, monkeypatch):
    """tree-verify at batch: each request's tree in one packed verify; every output token forced."""
    from specpilot.hf.checkpoint import read_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dirs = tiny_model_dirs["llama"]
    program = lower(read_config(dirs["target"])[0], read_config(dirs["pard"])[0], block_size=4, batch=3)
    program, _ = run_passes(program, parse_pipeline("tree-verify{budget=6, topk=2},ragged-verify", source="test"))
    engine = build_engine(program, dirs["target"], dirs["pard"], torch.device("cpu"))
    batched = engine.batched(capacity=64)
    assert batched.tree == (6, 2) and batched.policy.ragged
    prompts = [[5, 6, 7, 8], [100, 200], [42] * 9, [10, 20, 30]]
    outs = generate_batched(batched, prompts, 8, arrivals=[0, 0, 1, 3])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) > 0
    assert batched.stats.verify_rows > batched.stats.steps * 3  # trees of several nodes were verified


@pytest.mark.parametrize("first", ["first=drafter", "first=early-exit-split, exit-layer=1"])
def test_batched_two_level_is_lossless_under_token_forcing(tiny_model_dirs, torch_single_thread, monkeypatch, first):
    """two-level-verify with verify-budget at batch: the batch-wide first level keeps the nodes the
    cost table pays for out of every request's drafted tree (an early exit: the ones its scores rank
    best, the second level continued from its layer); every output token forced."""
    from specpilot.hf.checkpoint import read_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dirs = tiny_model_dirs["qwen3"]
    program = lower(read_config(dirs["target"])[0], read_config(dirs["dflash"])[0], block_size=4, batch=3)
    program, _ = run_passes(program, parse_pipeline(
        f"two-level-verify{{budget=3, draft-budget=9, topk=2, {first}}},verify-budget,ragged-verify", source="test"))
    assert program.step.one("schedule")[1]["verify_budget"]
    engine = build_engine(program, dirs["target"], dirs["dflash"], torch.device("cpu"))
    batched = engine.batched(capacity=64, cost=StepCost.from_table({1: 1.0, 8: 1.1, 64: 2.0}))
    assert batched.tree == (9, 2) and batched.keep == 3 and batched.policy.verify_budget
    assert (batched.first, batched.exit_layer) == (("drafter", 0) if "drafter" in first else ("early-exit-split", 1))
    prompts = [[5, 6, 7, 8], [100, 200], [42] * 9, [10, 20, 30]]
    outs = generate_batched(batched, prompts, 8, arrivals=[0, 0, 1, 3])
    report = force_tokens(engine.target, engine.target_cfg, prompts, outs, "float32")
    assert report.passed and report.tokens_checked == sum(map(len, outs)) > 0
    assert batched.stats.pruned_nodes > 0 and batched.stats.verify_rows > batched.stats.steps * 3


def test_compile_measures_each_listed_concurrency(tmp_path, tmp_path_factory, monkeypatch):
    """serving.batch_sizes honoured: a row per concurrency (tokens/s, latency, speedup over batched
    AR), every batched output token forced, the IR's schedule continuous at the largest batch."""
    import json

    from click.testing import CliRunner

    from specpilot.cli import main

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the engine's attention: SDPA per request on a CPU
    spec = tmp_path / "pipeline.yaml"
    spec.write_text("name: t\ntarget: tiny-qwen3\ndrafter:\n  kind: dflash\n  block_size: 4\ngpu: h200\n"
                    "serving:\n  batch_sizes: [1, 3]\n  max_new_tokens: 8\nbenchmark:\n  prompts: code-smoke\n"
                    "  num_prompts: 2\n")
    out = tmp_path / "engine"
    r = CliRunner().invoke(main, ["compile", str(spec), "--passes", "verify-budget,ragged-verify,spec-control",
                                  "-o", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    rows = report["batches"]["rows"]
    assert [row["concurrency"] for row in rows] == [1, 3]
    assert all(row["speedup_over_batched_ar"] > 0 and row["spec"]["tokens"] > 0 for row in rows)
    assert all(row["outputs_equal_batch1"] == row["requests"] for row in rows)
    predicted = report["batches"]["predicted"]
    assert [r["concurrency"] for r in predicted["rows"]] == [1, 3]
    assert set(predicted["verify_cost_check"]) == {"1", "3"}  # the profiled tables beside the roofline's
    assert json.loads((out / "validation.json").read_text())["passed"]
    assert "policy=\"continuous\"" in (out / "ir.txt").read_text() and "batch=3" in (out / "ir.txt").read_text()


def test_spec_refuses_bad_batch_sizes(tmp_path):
    from specpilot.errors import SpecError
    from specpilot.spec import load_spec

    path = tmp_path / "p.yaml"
    path.write_text("name: t\ntarget: tiny-qwen3\ndrafter:\n  kind: dflash\nserving:\n  batch_sizes: [8, 1]\n")
    with pytest.raises(SpecError, match="batch_sizes.*increasing"):
        load_spec(path)
