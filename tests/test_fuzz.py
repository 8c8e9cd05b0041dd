"""Hostile and broken input, fuzzed through the CLI.

Spec files (arbitrary bytes, arbitrary YAML documents, one field of a good spec set to anything),
model directories (truncated safetensors, a header length that lies, garbled headers, config.json
fields set to anything), every registered pass's parameters outside the deployment's limits, and
arbitrary pipeline strings. Each must end in exit status 2 with one line naming the file (and the
field), no traceback, and nothing written. Where a drawn input might be valid after all, the test
first runs the compile's front half (`compiler.prepare`: everything before anything is built) and
skips inputs it accepts, so that no example compiles a whole engine. Hypothesis runs derandomized
(conftest's profile): a run draws what every earlier run drew.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from specpilot.cli import main
from specpilot.compiler import prepare
from specpilot.dsl.rules import RulePass
from specpilot.errors import SpecpilotError
from specpilot.ir.text import format_literal
from specpilot.passes import REGISTRY
from specpilot.passes.two_level_verify import TwoLevelVerify
from specpilot.runtime.load import load_target
from specpilot.spec import load_spec

from conftest import tiny_spec

FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# any YAML/JSON value: what a careless or hostile file can hold where a field belongs
LEAVES = (st.none() | st.booleans() | st.integers() | st.integers(10**6, 10**30) | st.floats(allow_nan=False)
          | st.text(max_size=12) | st.text(max_size=3).map(lambda t: t + "\x00") | st.just("x" * 5000))
VALUES = st.recursive(LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=6)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder for the examples, and the built-in tiny pair built into a cache of its own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
        yield tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def pair(tiny_model_dirs) -> dict[str, Path]:
    return tiny_model_dirs["qwen3"]


def fresh(workdir: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=workdir))


def fails_in_one_line(args: list, out: Path) -> str:
    """Run the CLI; it must exit 2 with one 'error:' line, no traceback, and write nothing to `out`."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert not out.exists()
    return lines[0]


def compile_fails(spec: Path, *extra) -> str:
    out = spec.parent / "engine"
    return fails_in_one_line(["compile", spec, "-o", out, "--device", "cpu", *extra], out)


def accepted(spec: Path, passes: str | None = None) -> bool:
    """Whether the compile's front half takes this input (then the example is no hostile input)."""
    try:
        prepare(load_spec(spec), passes, "cpu")
    except SpecpilotError:
        return False
    return True


# -- spec files

@settings(max_examples=40, **FUZZ)
@given(data=st.binary(max_size=300))
@example(data=b"\xff\xfename: t\ntarget: tiny-qwen3\n")  # not UTF-8
@example(data=b"[" * 5000)  # nested past the parser's recursion limit
def test_any_bytes_as_a_spec(workdir, data):
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_bytes(data)
    assert compile_fails(spec).startswith(f"error: {spec}")


@settings(max_examples=60, **FUZZ)
@given(doc=VALUES)
def test_any_yaml_document_as_a_spec(workdir, doc):
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_text(yaml.safe_dump(doc))
    assert compile_fails(spec).startswith(f"error: {spec}")


FIELDS = (("name",), ("target",), ("drafter",), ("drafter", "kind"), ("drafter", "path"), ("drafter", "block_size"),
          ("gpu",), ("serving",), ("serving", "batch_sizes"), ("serving", "max_new_tokens"), ("serving", "greedy"),
          ("benchmark",), ("benchmark", "prompts"), ("benchmark", "num_prompts"), ("passes",), ("rules",), ("plugins",),
          ("dtype",), ("no_such_field",))


@settings(max_examples=60, **FUZZ)
@given(field=st.sampled_from(FIELDS), value=VALUES)
@example(field=("serving", "max_new_tokens"), value=10**12)  # caches of a trillion slots
@example(field=("drafter", "block_size"), value=10**6)
@example(field=("name",), value="../../elsewhere")
def test_one_field_of_a_good_spec_set_to_anything(workdir, field, value):
    doc = yaml.safe_load(tiny_spec("pard"))
    parent = doc
    for key in field[:-1]:
        parent = parent.setdefault(key, {})
    parent[field[-1]] = value
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_text(yaml.safe_dump(doc))
    assume(not accepted(spec))
    line = compile_fails(spec)
    assert line.startswith(f"error: {spec}") or "rules" in field, line


# -- model directories

def broken_pair(workdir: Path, pair: dict[str, Path]) -> tuple[Path, Path]:
    """A copy of the tiny target to break, and a spec that compiles it with the tiny PARD drafter."""
    root = fresh(workdir)
    target = root / "target"
    shutil.copytree(pair["target"], target)
    spec = root / "pipeline.yaml"
    spec.write_text(tiny_spec("pard").replace("target: tiny-qwen3", f"target: {target}")
                    .replace("  kind: pard", f"  kind: pard\n  path: {pair['pard']}"))
    return target, spec


def loads(target: Path, spec: Path) -> bool:
    """Whether the compile's front half takes the broken directory and the runtime then loads it
    (then it is not broken: a rounding digit of the header's metadata, say)."""
    if not accepted(spec):
        return False
    try:
        load_target(target, dtype=torch.float32, device="cpu")
    except SpecpilotError:
        return False
    return True


@settings(max_examples=40, **FUZZ)
@given(keep=st.floats(0.0, 1.0, exclude_max=True))
def test_a_truncated_safetensors_file(workdir, pair, keep):
    target, spec = broken_pair(workdir, pair)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: int(keep * len(data))])
    line = compile_fails(spec)
    assert f"{weights}: not a valid safetensors file" in line, line


@settings(max_examples=40, **FUZZ)
@given(length=st.integers(0, 2**64 - 1))
@example(length=2**64 - 1)
@example(length=10**8)  # within safetensors' own limit, past the file's end
def test_a_safetensors_header_that_lies_about_its_length(workdir, pair, length):
    target, spec = broken_pair(workdir, pair)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    assume(length != int.from_bytes(data[:8], "little"))
    weights.write_bytes(length.to_bytes(8, "little") + data[8:])
    line = compile_fails(spec)
    assert f"{weights}: not a valid safetensors file" in line, line


@settings(max_examples=60, **FUZZ)
@given(at=st.floats(0.0, 1.0, exclude_max=True), garbage=st.binary(min_size=1, max_size=32))
@example(at=0.0, garbage=b"not json")
def test_a_garbled_safetensors_header(workdir, pair, at, garbage):
    target, spec = broken_pair(workdir, pair)
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start = 8 + int(at * n)
    data[start:start + len(garbage)] = garbage[: max(0, 8 + n - start)]
    weights.write_bytes(bytes(data))
    assume(not loads(target, spec))
    line = compile_fails(spec)
    assert str(target) in line, line


@settings(max_examples=50, **FUZZ)
@given(key=st.sampled_from(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                            "rope_parameters", "rope_theta", "eos_token_id", "model_type", "tie_word_embeddings"]),
       value=VALUES)
@example(key="num_hidden_layers", value=10**7)  # a config claiming layers its weights lack: never lowered
@example(key="max_position_embeddings", value=20)
def test_a_config_field_set_to_anything(workdir, pair, key, value):
    target, spec = broken_pair(workdir, pair)
    config = json.loads((target / "config.json").read_text())
    config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    assume(not loads(target, spec))
    line = compile_fails(spec)
    assert any(str(path) in line for path in (target, spec, pair["pard"])), line  # the drafter's, where it no longer fits


# -- pass parameters against the deployment's limits

def limits_of(pair: dict[str, Path]) -> tuple[int, int, int]:
    """(positions, vocabulary, target layers) of the tiny PARD deployment, read from its config files here."""
    target, pard = (json.loads((pair[k] / "config.json").read_text()) for k in ("target", "pard"))
    return (min(target["max_position_embeddings"], pard["max_position_embeddings"]), target["vocab_size"],
            target["num_hidden_layers"])


def ranges(positions: int, vocab: int, layers: int) -> dict[tuple[str, str], tuple[int, int | None]]:
    """Each integer parameter's allowed range on a PARD deployment: a verify of k + 1 drafts or a
    tree of budget + 1 nodes after one prompt token within the positions; ranks and token subsets
    within the vocabulary; a drafter head's subset and u12's size threshold at least 1 (a subset
    of the whole vocabulary or more is no subset: the pass changes nothing). two-level-verify's
    other parameters at their defaults (budget 16 of draft-budget 64): its budget within the drafted
    nodes, the drafted nodes from the budget to the positions, its early exit inside the target."""
    two_level = TwoLevelVerify()
    return {("draft-block-size", "size"): (1, positions - 2), ("tree-verify", "budget"): (1, positions - 2),
            ("tree-verify", "topk"): (1, vocab), ("draft-vocab", "size"): (1, None),
            ("weights-u12", "min_numel"): (1, None),
            ("two-level-verify", "budget"): (1, two_level.draft_budget),
            ("two-level-verify", "draft_budget"): (two_level.budget, positions - 2),
            ("two-level-verify", "topk"): (1, vocab), ("two-level-verify", "exit_layer"): (1, layers - 1)}


def test_every_integer_parameter_of_every_pass_has_a_range(pair):
    params = {(name, f.name) for name, cls in REGISTRY.items() if not issubclass(cls, RulePass)
              for f in cls.params() if f.type in (int, "int")}
    assert params == set(ranges(*limits_of(pair)))


@settings(max_examples=80, **FUZZ)
@given(data=st.data())
def test_integer_pass_parameters_outside_the_limits(workdir, pair, data):
    table = ranges(*limits_of(pair))
    name, param = data.draw(st.sampled_from(sorted(table)))
    lo, hi = table[(name, param)]
    outside = st.integers(max_value=lo - 1) | st.integers(-(10**30), lo - 1)
    if hi is not None:
        outside = outside | st.integers(min_value=hi + 1) | st.integers(hi + 1, 10**30) | st.just(hi + 1)
    value = data.draw(outside)
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_text(tiny_spec("pard"))
    kebab = param.replace("_", "-")
    line = compile_fails(spec, "--passes", f"{name}{{{kebab}={value}}}")
    assert line.startswith("error: --passes") and kebab in line and str(value) in line, line


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


@settings(max_examples=50, **FUZZ)
@given(data=st.data())
def test_string_pass_parameters_outside_their_values(workdir, data):
    name, param = data.draw(st.sampled_from([("weights-u12", "kernel"), ("weights-u12", "layout"),
                                             ("draft-vocab", "corpus")]))
    value = data.draw(st.text(max_size=30).filter(lambda t: t not in ("triton-u12", "torch", "auto", "rows", "tiles",
                                                                        "stdlib", "")))
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_text(tiny_spec("pard"))
    assume(not any(_exists(p) for p in (Path(value), spec.parent / value)))  # a corpus that exists is a corpus
    size = "size=8, " if name == "draft-vocab" else ""  # a subset of the vocabulary: the corpus is read
    line = compile_fails(spec, "--passes", f"{name}{{{size}{param}={format_literal(value)}}}")
    assert line.startswith("error: --passes") or line.startswith("error: draft-vocab{corpus="), line
    assert param in line, line


@settings(max_examples=60, **FUZZ)
@given(text=st.text(max_size=40))
@example(text="draft-block-size{size=1e400}")
@example(text="tree-verify{budget=" + "9" * 400 + "}")
def test_any_pipeline_string(workdir, text):
    spec = fresh(workdir) / "pipeline.yaml"
    spec.write_text(tiny_spec("pard"))
    assume(not accepted(spec, text))
    assert compile_fails(spec, "--passes", text).startswith("error: --passes")
