"""The bench/ scripts of the e2e and steps subjects, and the harness they write through: CPU smoke runs
of the GPU scripts (each main() in-process on tiny shapes into a temporary results file: the records
are there and every specpilot path, and in fp32 every HF peer, gives AR's greedy tokens), the results
files' schema and names, the tables rendered from them, and bench/run_gpu.sh's groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.e2e import zoo_e2e
from bench.steps import hf_peers

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_hf_peers_smoke(tmp_path: Path) -> None:
    assert hf_peers.main(["--smoke", "--out", str(tmp_path)]) == 0
    (out,) = tmp_path.iterdir()
    assert out.name == "hf_peers_cpu.json"  # the harness's name: <bench>_<gpu>.json
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


def test_zoo_e2e_smoke(tmp_path: Path, tiny_model_dirs: dict[str, dict[str, Path]]) -> None:
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


def test_zoo_e2e_defaults_name_the_zoo_pair() -> None:
    for kind in ("target", "dflash", "pard"):
        assert (zoo_e2e.ZOO / kind / "config.json").is_file()
