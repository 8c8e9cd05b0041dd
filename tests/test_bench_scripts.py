"""The bench/ scripts of the e2e and steps subjects and the harness they write through: CPU smoke runs
of the GPU scripts (each main() in-process on tiny shapes into a temporary results file: the records
are there and every specpilot path, and in fp32 every HF peer, gives AR's greedy tokens), the
results files' schema and names, the tables rendered from them, and bench/run_gpu.sh's groups."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench import readme_tables
from bench.e2e import zoo_e2e
from bench.steps import hf_peers
from bench.steps import step_times as st
from specpilot.bench import harness

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {"kernels": 3, "gpu_us": 12.0, "top": [{"name": "_gemv_kernel", "count": 2, "us": 10.0}]}
SCHEMA_KEYS = ("bench", "schema", "commit", "date", "device", "gpu", "versions", "args", "records")


@pytest.mark.usefixtures("torch_single_thread")
def test_hf_peers_smoke(tmp_path: Path) -> None:
    assert hf_peers.main(["--smoke", "--out", str(tmp_path)]) == 0
    (out,) = tmp_path.iterdir()
    assert out.name == "hf_peers_cpu.json"  # the harness's name, <bench>_<gpu>.json, in the folder --out gave
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["records"]}
    assert set(rows) == {*hf_peers.AR_IMPLS, "hf-eager-generate", "hf-eager-forward", "hf-static-compile"}
    assert result["gpu"] == "cpu" and result["versions"]["transformers"] and result["commit"]
    assert result["args"]["smoke"] is True and result["floor_ms_per_token"] > 0
    for row in rows.values():
        assert "error" not in row, row
        assert row["new_tokens"] == result["max_new_tokens"]
        assert row["tokens_equal"] and row["agree_prefix"] == row["new_tokens"], row  # fp32: no near-ties
        assert row["ms_per_token"] > 0 and row["prefill_ms"] > 0
    assert rows["hf-static-compile"]["compiled"] is False  # HF compiles only on a GPU


@pytest.mark.usefixtures("torch_single_thread")
def test_zoo_e2e_smoke(tmp_path: Path, tiny_model_dirs: dict[str, dict[str, Path]]) -> None:
    """The zoo end-to-end group's script (bench/run_gpu.sh e2e), on the CPU over a tiny pair."""
    dirs = tiny_model_dirs["qwen3"]
    out = tmp_path / "zoo_e2e.json"
    args = ["--smoke", "--prompts", "code-smoke", "--out", str(out),
            "--target", str(dirs["target"]), "--dflash", str(dirs["dflash"]), "--pard", str(dirs["pard"])]
    assert zoo_e2e.main(args) == 0
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["records"]}
    assert set(rows) == {*zoo_e2e.IMPLS, "hf-ar-static", "hf-dflash"}
    assert [p["peer"] for p in result["peers_skipped"]] == ["hf-pard"]
    assert result["num_prompts"] == 2 and result["max_new_tokens"] == 16
    for name, row in rows.items():
        assert "error" not in row, row
        assert row["equal_to_ar"] == 2, row  # fp32: every path is AR greedy
        assert row["tokens_per_s"] > 0 and row["speedup_vs_ar"] > 0
        if name.startswith(("pard", "dflash", "hf-dflash")):
            steps, hist = row["steps"], row["acceptance_histogram"]
            assert sum(hist) == steps and len(hist) == row["block"] + 1
            # every decode token comes from a step: tau * steps == decode tokens
            assert row["tau"] * steps == pytest.approx(row["decode_tokens"])
    assert rows["pard"]["block"] == result["drafters"]["pard"]["k"]
    assert rows["hf-dflash"]["acceptance_histogram"] == rows["dflash"]["acceptance_histogram"]  # same drafter, fp32


@pytest.mark.slow  # ~14 s here with the tiny pair's build (shared with other tests in a full run)
def test_zoo_tau_compiles_each_variant_on_a_chat_set(tmp_path: Path, tmp_path_factory, monkeypatch) -> None:
    """What smollm2bench runs, on a tiny pair: each --variant compiled on the chat set, a row each with
    its pipeline, τ and histogram, every output token forced."""
    from bench.e2e import zoo_tau

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    out = tmp_path / "tau.json"
    assert zoo_tau.main(["--pair", "tiny-qwen3", "--drafters", "dflash", "--prompt-sets", "ifeval", "--num-prompts", "1", "--max-new-tokens",
                         "4", "--device", "cpu", "--variant", "chain=", "--variant",
                         "tree=tree-verify{budget=4,topk=2}", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["records"]
    assert [(r["variant"], r["prompts"], r["pipeline"]) for r in rows] == [
        ("chain", "ifeval", ""), ("tree", "ifeval", "tree-verify{budget=4, topk=2}")]
    for r in rows:
        assert r["token_forcing"].startswith("token forcing PASS") and r["tau"] >= 1 and r["speedup_over_ar"] > 0
    with pytest.raises(SystemExit, match="expected NAME=PASSES"):
        zoo_tau.main(["--variant", "cuda-graphs"])


def test_zoo_e2e_defaults_name_the_zoo_pair() -> None:
    for kind in ("target", "dflash", "pard"):
        assert (zoo_e2e.zoo_part(kind) / "config.json").is_file()
        assert zoo_e2e.shown(zoo_e2e.zoo_part(kind)) == f"code-qwen3/{kind}"  # not the cache's digest


def test_step_times_writes_its_shapes_rows_through_the_harness(tmp_path: Path, monkeypatch) -> None:
    """The step-time group's file: named by the shapes' families, the rows and profiles of every shape,
    the read bandwidth and the flags inside. (The steps themselves: `TRITON_INTERPRET=1 python -m
    bench.steps.step_times --smoke --out DIR`, about three minutes of interpreted kernels.)"""
    for name in ("DEVICE", "CACHE_LEN", "CAPACITY", "TREE_BUDGETS", "VERIFY_Q"):
        monkeypatch.setattr(st, name, getattr(st, name))  # main() sets them for --smoke: restored after
    calls = []

    def bench_shape(name, bw, repeats, with_u12):
        calls.append((name, repeats, with_u12))
        return [dict(shape=name, path="fused", what="ar", q=1, ms=1.0, floor_ms=0.5)], {"ar": PROFILE}

    monkeypatch.setattr(st, "bench_shape", bench_shape)
    assert st.main(["--smoke", "--no-u12", "--out", str(tmp_path)]) == 0
    assert calls == [("tiny", 1, False)] and st.DEVICE == "cpu"
    (out,) = tmp_path.iterdir()
    assert out.name == "step_times_cpu_tiny.json"
    result = json.loads(out.read_text())
    assert result["records"] == [dict(shape="tiny", path="fused", what="ar", q=1, ms=1.0, floor_ms=0.5)]
    assert result["profiles_fused"] == {"tiny": {"ar": PROFILE}} and result["read_bandwidth_Bps"] > 0
    assert result["args"]["no_u12"] is True and result["args"]["tag"] == "tiny"
    assert st.main(["--smoke"]) == 0 and list(tmp_path.iterdir()) == [out]  # a smoke run without --out writes nothing


def test_write_results_names_its_file_and_carries_the_schema(tmp_path: Path) -> None:
    path = harness.write_results("demo", "cpu", [{"ms": 1.5}], args={"q": 16}, out=tmp_path, tag="verify16", note="x")
    assert path == tmp_path / "demo_cpu_verify16.json"
    doc = json.loads(path.read_text())
    assert list(doc)[:8] == list(SCHEMA_KEYS[:8]) and doc["records"] == [{"ms": 1.5}] and doc["note"] == "x"
    assert doc["schema"] == harness.SCHEMA and doc["args"] == {"q": 16} and doc["versions"]["torch"]
    priced = harness.write_results("demo", "cpu", [], out=tmp_path, gpu="h200")  # a card priced on a CPU
    assert priced.name == "demo_h200.json" and json.loads(priced.read_text())["gpu"] == "h200"
    assert harness.results_path("demo", "cpu", "t") == harness.RESULTS / "demo_cpu_t.json"


def _results_files() -> list[Path]:
    return sorted((ROOT / "bench" / "results").glob("*.json")) + sorted((ROOT / "docs/experiments/tried").glob("*.json"))


def test_results_files_carry_the_schema_and_are_named_by_it() -> None:
    """Every results file, live or tried: the harness schema's keys, and the name the harness would
    give it, <bench>_<gpu>[_<tag>].json with the tag hyphenated."""
    files = _results_files()
    assert len(files) > 100
    for path in files:
        doc = json.loads(path.read_text())
        assert all(k in doc for k in SCHEMA_KEYS), (path.name, set(SCHEMA_KEYS) - set(doc))
        assert doc["schema"] == harness.SCHEMA and isinstance(doc["records"], list) and doc["commit"], path.name
        assert isinstance(doc["versions"], dict) and isinstance(doc["args"], dict), path.name
        tag = path.stem.removeprefix(f"{doc['bench']}_{doc['gpu']}").removeprefix("_")
        assert path.name == harness.results_name(doc["bench"], doc["gpu"], tag) and "_" not in tag, path.name


def test_documents_equal_their_rendering_from_the_results_files() -> None:
    """README.md's headline and the experiment pages' tables are what `python -m bench.readme_tables`
    renders from bench/results now: a results file changed without regenerating them, or a table
    typed by hand, fails here. Each renderer's table is in exactly one document."""
    seen: dict[str, list[str]] = {}
    for path in readme_tables.documents():
        text = path.read_text()
        assert readme_tables.render(text) == text, f"{path.relative_to(ROOT)}: run python -m bench.readme_tables"
        for name in readme_tables.regions(text):
            seen.setdefault(name, []).append(path.name)
    assert seen == {name: seen.get(name) for name in readme_tables.RENDERERS} and all(len(v) == 1 for v in seen.values()), seen
    assert seen["headline"] == ["README.md"]


class _Parsed(Exception):
    """Raised by ArgumentParser.parse_args in the run_gpu test: the flags parsed, nothing ran."""


def _run_gpu(tmp_path: Path, *groups: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRINT_ONLY": "1", "OUT": str(tmp_path)}
    return subprocess.run(["bash", str(ROOT / "bench" / "run_gpu.sh"), *groups], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_run_gpu_groups_run_modules_that_take_their_flags(tmp_path: Path, monkeypatch) -> None:
    """bench/run_gpu.sh runs only on a GPU machine, where a misspelt module, flag or test path costs a
    device run. Every group its header lists dispatches (PRINT_ONLY prints each run's command); each
    `python -m bench...` command imports and its parser takes the flags given it, each pytest path
    exists, the step-time and zoo groups write their files into $OUT through the harness."""
    header = (ROOT / "bench" / "run_gpu.sh").read_text().split("\nset -u")[0]
    groups = re.findall(r"^#   ([a-z0-9]+)\s", header, re.M)
    assert {"steps", "qwen", "e2e", "tau", "zoo", "refresh", "calib", "peers"} <= set(groups)
    done = _run_gpu(tmp_path, *groups)
    assert done.returncode == 0, done.stderr
    assert _run_gpu(tmp_path, "no-such-group").returncode == 2
    commands = [shlex.split(line.split(": ", 1)[1]) for line in done.stdout.splitlines() if re.match(r"^\w+: ", line)]
    assert len(commands) >= 30

    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):  # a bad flag exits 2 here, as on the GPU machine
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    modules = set()
    for cmd in commands:
        if cmd[:1] != ["python"]:
            continue  # a wrapper (ncu) or a message
        assert cmd[1] == "-m", f"{cmd}: scripts run as python -m bench.<subject>.<name>"
        module, args = cmd[2], cmd[3:]
        if module == "pytest":
            for path in (a.split("::")[0] for a in args if a.startswith("tests/")):
                assert (ROOT / path).is_file(), path
            continue
        assert importlib.util.find_spec(module) is not None, module
        if not module.startswith("bench."):
            continue
        modules.add(module)
        main = importlib.import_module(module).main
        monkeypatch.setattr(sys, "argv", [module, *args])
        with pytest.raises(_Parsed):
            main(args) if inspect.signature(main).parameters else main()
    assert {"bench.steps.step_times", "bench.e2e.zoo_e2e", "bench.e2e.zoo_tau", "bench.steps.step_ab",
            "bench.kernels.u12_linear"} <= modules
    steps = [c for c in commands if c[2:3] == ["bench.steps.step_times"]]
    assert all(c[c.index("--out") + 1] == str(tmp_path) for c in steps)  # the folder: the harness names the file


def test_time_interleaved_rotates_the_variants_each_round() -> None:
    order: list[str] = []
    variants = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    per_round = harness.time_interleaved(variants, rounds=3, repeats=2, warmup=1, cuda=False)
    assert {n: len(v) for n, v in per_round.items()} == {"a": 3, "b": 3, "c": 3}
    timed = order[3:]  # after one warm-up call each
    assert timed == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]


def test_batched_host_smoke_times_each_layer_count_and_concurrency(capsys) -> None:
    from bench.steps import batched_host

    assert batched_host.main(["--smoke"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "a batched AR step" in line]
    assert [line.split()[:3] for line in lines] == [["1", "layers", "c1"], ["1", "layers", "c2"],
                                                   ["2", "layers", "c1"], ["2", "layers", "c2"]]


def test_offline_tau_smoke_measures_the_loop_and_the_training_forward(capsys) -> None:
    from bench.e2e import offline_tau

    assert offline_tau.main(["--smoke"]) == 0
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("loop τ")]
    assert len(summary) == 1 and "offline estimate" in summary[0]


@pytest.mark.usefixtures("torch_single_thread")
def test_cpu_spec_step_smoke_splits_both_steps_into_terms_that_add_up(tmp_path: Path, tmp_path_factory,
                                                                      monkeypatch) -> None:
    from bench.steps import cpu_spec_step

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))
    out = tmp_path / "steps.json"
    assert cpu_spec_step.main(["--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    by = {(r["loop"], r["term"]): r["mean_ms"] for r in doc["records"]}
    for loop, terms in (("ar", cpu_spec_step.AR_TERMS), ("chain", cpu_spec_step.CHAIN_TERMS)):
        assert all(by[loop, t] >= 0 for t in terms) and by[loop, "step"] > 0
        assert sum(by[loop, t] for t in (*terms, "host")) == pytest.approx(by[loop, "step"], abs=0.01)
    assert doc["tau"] >= 1 and doc["speedup_over_ar"] > 0 and doc["pipeline"] == "draft-block-size{size=4}"
