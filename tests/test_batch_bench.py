"""bench.e2e.batched --smoke: the script runs end to end on the CPU (tiny replay shape and the zoo pair)
and writes rows the README renderer reads."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_batched_bench_smoke_writes_its_rows(tmp_path, monkeypatch):
    from bench.e2e import batched

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # SDPA per request: the kernel has its own tests
    assert batched.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "batched_cpu.json").read_text())
    rows = [r for r in doc["records"] if "speedup_over_batched_ar" in r]
    assert {(r.get("profile") or r["pair"], r["variant"], r["concurrency"]) for r in rows} == {
        (who, v, c) for who in ("dflash-qwen3-8b", "code-qwen3/dflash") for v in ("all", "none") for c in (1, 3)}
    assert all(r["passed"] for r in rows if r["variant"] == "all")
    assert all(r["spec"]["tokens"] > 0 and r["ar"]["tokens"] == r["spec"]["tokens"] for r in rows)
