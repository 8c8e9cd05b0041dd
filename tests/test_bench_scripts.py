"""CPU smoke runs of the GPU benchmark scripts bench/hf_peers.py and bench/zoo_e2e.py: each main() runs
in-process on tiny shapes into a temporary results file; the rows are there and every specpilot path
(and, in fp32, every HF peer) gives AR's greedy tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import hf_peers  # noqa: E402
import zoo_e2e  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

def test_hf_peers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "hf_peers.json"
    assert hf_peers.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {*hf_peers.AR_IMPLS, "hf-eager-generate", "hf-eager-forward", "hf-static-compile"}
    assert result["gpu"] == "cpu" and result["torch"] and result["transformers"] and result["commit"]
    assert result["floor_ms_per_token"] > 0
    for row in rows.values():
        assert "error" not in row, row
        assert row["new_tokens"] == result["max_new_tokens"]
        assert row["tokens_equal"] and row["agree_prefix"] == row["new_tokens"], row  # fp32: no near-ties
        assert row["ms_per_token"] > 0 and row["prefill_ms"] > 0
    assert rows["hf-static-compile"]["compiled"] is False  # HF compiles only on a GPU


def test_zoo_e2e_smoke(tmp_path: Path, tiny_model_dirs: dict[str, dict[str, Path]]) -> None:
    dirs = tiny_model_dirs["qwen3"]
    out = tmp_path / "zoo_e2e.json"
    args = ["--smoke", "--prompts", "code-smoke", "--out", str(out),
            "--target", str(dirs["target"]), "--dflash", str(dirs["dflash"]), "--pard", str(dirs["pard"])]
    assert zoo_e2e.main(args) == 0
    result = json.loads(out.read_text())
    rows = {r["impl"]: r for r in result["rows"]}
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


def test_zoo_e2e_defaults_name_the_zoo_pair() -> None:
    for kind in ("target", "dflash", "pard"):
        assert (zoo_e2e.ZOO / kind / "config.json").is_file()


def test_run_gpu_runs_every_group_it_documents() -> None:
    """bench/run_gpu.sh: each group its header lists is a case the script dispatches (a listed group
    missing there exits "unknown group" on the GPU machine, after the install), and no more."""
    import re

    text = (BENCH / "run_gpu.sh").read_text()
    header = text[:text.index("set -u")]
    listed = set(re.findall(r"^#   ([a-z0-9]+)\s", header, re.M))
    case = text[text.index('case "$group" in'):text.index("esac")]
    dispatched = {name for pattern in re.findall(r"^\s+([a-z0-9 |\\\n]+)\)", case, re.M)
                  for name in re.split(r"[\s|\\]+", pattern) if name}
    assert {"tests", "ncu", "refresh", "u12verify", "fewrows"} <= listed
    assert listed == dispatched


def test_run_gpu_commands_name_scripts_flags_and_tests_that_exist() -> None:
    """bench/run_gpu.sh runs only on the GPU machine, where a misspelt script, flag or test path
    costs a device run: each `python bench/X.py` it runs exists and takes every --flag given it,
    and each tests/ path it names exists."""
    import re

    root = BENCH.parent
    text = (BENCH / "run_gpu.sh").read_text().replace("\\\n", " ")
    commands = re.findall(r"python (bench/\w+\.py)([^;|\n]*)", text)
    assert len(commands) >= 20
    for script, args in commands:
        source = (root / script).read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args):
            assert f'"{flag}"' in source, f"{script} takes no {flag}"
    for path in set(re.findall(r"tests/\w+\.py", text)):
        assert (root / path).is_file(), path


def test_readme_tables_are_generated_from_the_results_files() -> None:
    """README.md's results sections are what bench/readme_tables.py renders from bench/results/ now:
    a results file changed without regenerating them (or a table typed by hand) fails here."""
    import readme_tables  # bench/readme_tables.py

    readme = (BENCH.parent / "README.md").read_text()
    assert "<!-- results:targets -->" in readme
    assert readme_tables.render(readme) == readme
