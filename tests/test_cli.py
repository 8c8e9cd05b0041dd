"""The command line end to end: compile, run, verify, and clear errors for user mistakes."""

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specpilot.backends import torch_backend
from specpilot.cli import main
from specpilot.ir import node as ir_node
from specpilot.passes import REGISTRY, Pass, PassResult, register

from conftest import tiny_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))


def write_spec(tmp_path, kind="pard", extra="", text=None):
    path = tmp_path / "pipeline.yaml"
    path.write_text(text if text is not None else tiny_spec(kind, extra=extra))
    return path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    for f in fragments:
        assert f in result.output, result.output


@pytest.mark.parametrize("kind, gpu, resolved", [("pard", "a100", "a100-80gb"), ("dflash", "h200", "h200")])
def test_compile_run_verify(tmp_path, kind, gpu, resolved):
    out = tmp_path / "engine"
    r = invoke("compile", write_spec(tmp_path, kind=kind, extra='passes: "draft-block-size{size=3}"'),
               "--gpu", gpu, "-o", out, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "report.json").read_text())["gpu_target"] == resolved
    for name in ("engine.json", "spec.yaml", "pipeline.txt", "ir.txt", "validation.json", "report.json",
                 "report.md", "target/config.json", "drafter/config.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["pipeline"] == "draft-block-size{size=3}"
    assert report["drafter"] == {"kind": kind, "block_size": 3}
    assert report["outputs_equal_ar"] == "2/2"
    assert report["tokens_checked"] == 24  # 2 prompts x 12 tokens, every one checked
    assert report["tau"] >= 1.0
    validation = json.loads((out / "validation.json").read_text())
    assert validation["passed"] and validation["hard_failures"] == 0
    assert (out / "explain.png").read_bytes()[:4] == b"\x89PNG" and "gaps" in report["cost_model"]
    assert not list(tmp_path.glob(".engine.*"))  # no temporary folder left behind

    r = invoke("run", out, "--prompt", "def f(x):", "--max-new-tokens", "5", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("def f(x):")
    r = invoke("verify", out, "--device", "cpu")
    assert r.exit_code == 0 and "PASS" in r.output and "24 tokens checked" in r.output

    # tampering with a file is caught by the manifest's checksums
    (out / "ir.txt").write_text((out / "ir.txt").read_text() + "\n")
    assert_user_error(invoke("verify", out, "--device", "cpu"), "ir.txt does not match its checksum")


RULES = """\
pass accept-on-device-test (lossless) {
  rule device:
    on step
    match accept where on == "host"
    set on = "device"
}
pass graphed-steps-test (lossless) {
  rule device: match accept where on == "host" set on = "device"
  rule graphs: match schedule set graphs = true
}
"""


@pytest.fixture
def rules_file(tmp_path):
    (tmp_path / "mine.rules").write_text(RULES)
    yield "mine.rules"
    for name in ("accept-on-device-test", "graphed-steps-test"):
        REGISTRY.pop(name, None)


def test_rules_file_from_the_spec(tmp_path, rules_file):
    spec = write_spec(tmp_path, extra=f'rules: [{rules_file}]\npasses: "graphed-steps-test"')
    r = invoke("compile", spec, "-o", tmp_path / "e", "--device", "cpu")
    assert r.exit_code == 0, r.output
    ir = (tmp_path / "e" / "ir.txt").read_text()
    assert 'on="device"' in ir and "graphs=true" in ir


def test_a_rule_setting_what_no_backend_runs_is_refused(tmp_path, rules_file):
    """Accepting on the device runs only in graphed steps: a rule that moves acceptance alone would
    make the cost model price a host round trip saved that the loops still make."""
    spec = write_spec(tmp_path, extra=f'rules: [{rules_file}]\npasses: "accept-on-device-test"')
    r = invoke("compile", spec, "-o", tmp_path / "e", "--device", "cpu")
    assert_user_error(r, "invalid IR after accept-on-device-test", "step/accept: on='device' runs only in graphed steps")
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "e").exists()
    r = invoke("explain", spec, "--tau", "2")
    assert_user_error(r, "step/accept: on='device' runs only in graphed steps")


def test_bad_yaml_syntax(tmp_path):
    spec = write_spec(tmp_path, text="name: t\ntarget: [unclosed\n")
    r = invoke("compile", spec, "-o", tmp_path / "e")
    assert_user_error(r, "pipeline.yaml:3:1")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("extra, fragments", [
    ("serving:\n  max_new_tokens: -3\n", ["field 'serving.max_new_tokens'", "integer >= 1", "-3"]),
    ("typo: 1\n", ["unknown field 'typo'"]),
])
def test_bad_fields_name_the_field(tmp_path, extra, fragments):
    text = tiny_spec("pard").replace("serving:\n  max_new_tokens: 12\n", "") + extra
    r = invoke("compile", write_spec(tmp_path, text=text), "-o", tmp_path / "e")
    assert_user_error(r, "pipeline.yaml", *fragments)
    assert not (tmp_path / "e").exists()


def test_bad_drafter_kind(tmp_path):
    r = invoke("compile", write_spec(tmp_path, kind="medusa"), "-o", tmp_path / "e")
    assert_user_error(r, "field 'drafter.kind'", "one of dflash, pard", "'medusa'")


@pytest.mark.parametrize("passes, fragments", [
    ("no-such-pass", ["unknown pass 'no-such-pass'"]),
    ("draft-block-size{size=\"big\"}", ["parameter 'size' expects int"]),
    ("draft-block-size{size=4", ["--passes:1:"]),
    ("draft-vocab{size=0}", ["pass 'draft-vocab': size must be >= 1, got 0"]),
    ('draft-vocab{size=8, corpus="nowhere.txt"}', ["draft-vocab{corpus='nowhere.txt'}", "does not exist",
                                                   "expected 'stdlib'"]),
    ("tree-verify{budget=100000}", ["--passes: pass 'tree-verify': parameter 'budget' = 100000 is out of range for "
                                    "this deployment: expected 1..2046"]),
])
def test_bad_passes_exit_2_and_write_nothing(tmp_path, passes, fragments):
    r = invoke("compile", write_spec(tmp_path), "--passes", passes, "-o", tmp_path / "e")
    assert_user_error(r, *fragments)
    assert not (tmp_path / "e").exists()
    assert len(r.output.strip().splitlines()) == 1


def test_unknown_gpu(tmp_path):
    assert_user_error(invoke("compile", write_spec(tmp_path), "--gpu", "tpu9", "-o", tmp_path / "e"),
                      "--gpu: unknown GPU 'tpu9'", "a100 = a100-80gb")
    text = tiny_spec("pard").replace("gpu: h200", "gpu: tpu9")
    assert_user_error(invoke("compile", write_spec(tmp_path, text=text), "-o", tmp_path / "e"),
                      "pipeline.yaml: field 'gpu': unknown GPU 'tpu9'")
    assert not (tmp_path / "e").exists()


@pytest.mark.slow
def test_the_brief_command_compiles_for_an_a100(tmp_path):
    """`specpilot compile pipeline.yaml --gpu a100` (the project's brief): the shipped example on the
    CPU, one prompt of 8 tokens (about 20 s: the zoo pair); the alias names the a100-80gb.
    test_compile_run_verify[pard-a100] runs the same command on the tiny pair."""
    example = (EXAMPLES / "pipeline.yaml").read_text()
    text = example.replace("max_new_tokens: 64", "max_new_tokens: 8").replace("num_prompts: 8", "num_prompts: 1")
    assert text != example and "target: code-qwen3" in text
    out = tmp_path / "engine"
    r = invoke("compile", write_spec(tmp_path, text=text), "--gpu", "a100", "-o", out, "--device", "cpu")
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    assert report["gpu_target"] == "a100-80gb" and report["cost_model"]["gpu"] == "a100-80gb"
    assert report["outputs_equal_ar"] == "1/1"


@pytest.mark.parametrize("name, resolved", [("a100", "a100-80gb"), ("H100", "h100-sxm"),
                                            ("NVIDIA A100-SXM4-40GB", "a100-40gb")])
def test_gpu_aliases_resolve_in_the_spec_and_on_the_command_line(tmp_path, name, resolved):
    r = invoke("explain", EXAMPLES / "pipeline.yaml", "--gpu", name, "--tau", "3")
    assert r.exit_code == 0, r.output
    assert f"on {resolved}" in r.output
    r = invoke("explain", write_spec(tmp_path, text=tiny_spec("dflash").replace("gpu: h200", f"gpu: {name}")),
               "--tau", "3")
    assert r.exit_code == 0 and f"on {resolved}" in r.output, r.output


def test_missing_model_dir(tmp_path):
    text = tiny_spec("pard").replace("target: tiny-qwen3", "target: ./nowhere")
    text = text.replace("  kind: pard", "  kind: pard\n  path: ./nowhere-either")
    assert_user_error(invoke("compile", write_spec(tmp_path, text=text), "-o", tmp_path / "e"), "field 'target'")


class NegatedLinear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(-weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T


@pytest.fixture
def planted_pass():
    """A buggy pass claiming losslessness: it moves lm_head to a format that negates the weight."""

    @register
    @dataclass(frozen=True)
    class PlantedNegateHead(Pass):
        name = "planted-negate-head"
        lossless = True

        def apply(self, program):
            name, node = program.target.one("lm_head")
            g = program.target.with_node(name, node.replace(format="planted-negated"))
            return PassResult(program.with_graph("target", g), True)

    torch_backend.register_weight_format("planted-negated", lambda node, w, dtype: NegatedLinear(w))
    yield
    REGISTRY.pop("planted-negate-head")
    torch_backend.WEIGHT_FORMATS.pop("planted-negated")
    ir_node.WEIGHT_FORMATS.discard("planted-negated")


def test_token_forcing_rejects_a_pass_that_changes_a_weight(tmp_path, planted_pass):
    r = invoke("compile", write_spec(tmp_path), "--passes", "planted-negate-head", "-o", tmp_path / "e",
               "--device", "cpu")
    assert r.exit_code == 1, r.output
    assert "token forcing FAIL" in r.output and "engine rejected" in r.output
    assert not (tmp_path / "e").exists()


def test_u12_engine_stores_packed_weights(tmp_path):
    out = tmp_path / "e"
    spec = write_spec(tmp_path, extra='dtype: bfloat16\npasses: "weights-u12{min-numel=1000, kernel=torch}"')
    r = invoke("compile", spec, "-o", out, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert 'format="u12"' in (out / "ir.txt").read_text()
    assert (out / "target" / "u12.safetensors").is_file()
    r = invoke("verify", out, "--device", "cpu")
    assert r.exit_code == 0 and "PASS" in r.output


def test_explain_reads_no_results_file_gpus_yaml_does_not_list(tmp_path, monkeypatch):
    """`specpilot explain` used to glob ./bench/results: a file dropped there changed the model."""
    spec = write_spec(tmp_path, kind="dflash")
    monkeypatch.chdir(tmp_path)
    before = invoke("explain", spec, "--tau", "3")
    stray = tmp_path / "bench" / "results" / "step_bench_h200.json"
    stray.parent.mkdir(parents=True)
    stray.write_text(json.dumps({"gpu": "h200", "shape": "qwen3-3x64-v258", "records": [
        {"kind": "step", "what": "ar", "q": 1, "ms": 100.0}, {"kind": "step", "what": "verify", "q": 4, "ms": 100.0}]}))
    after = invoke("explain", spec, "--tau", "3")
    assert before.exit_code == after.exit_code == 0 and after.output == before.output
    assert "measured" not in after.output


def test_explain_prints_the_cost_table_and_chart(tmp_path):
    png = tmp_path / "gaps.png"
    r = invoke("explain", write_spec(tmp_path, kind="dflash"), "--gpu", "h100-sxm", "--tau", "3", "--png", png)
    assert r.exit_code == 0, r.output
    assert "AR step" in r.output and "predicted" in r.output and "gaps" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
