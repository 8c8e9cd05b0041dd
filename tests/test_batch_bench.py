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
        (who, v, c) for who in ("dflash-qwen3-8b", "code-qwen3/dflash") for v in ("all", "none") for c in (1, 3)} | {
        ("dflash-qwen3-8b", "tree", c) for c in (1, 3)}
    assert all(r["passed"] for r in rows if r["variant"] in ("all", "tree"))
    assert all(r["spec"]["tokens"] > 0 and r["ar"]["tokens"] == r["spec"]["tokens"] for r in rows)


def test_decode_throughput_leaves_the_prefills_out(tiny_models, torch_single_thread):
    """serve() takes its share of the engine's prefill time and first tokens, and the decode rate (the
    one speedups use) leaves both out: one prompt admitted a step, so each run pays a prefill per request."""
    from specpilot.bench.batch import BatchRun, serve
    from specpilot.runtime.batch import BatchConfig, BatchEngine

    models = tiny_models["qwen3"]
    eng = BatchEngine(models.target, None, eos_token_id=None, config=BatchConfig(max_batch=2, capacity=48))
    prompts = [[5, 6, 7, 8, 9], [100, 200, 30]]
    serve(eng, prompts, concurrency=2, requests=2, max_new_tokens=4)  # the engine's running sums are not this run's
    run = serve(eng, prompts, concurrency=2, requests=3, max_new_tokens=6)
    assert run.prefill_tokens == 3 and run.tokens == 18 and 0 < run.prefill_s < run.seconds
    assert run.decode_tokens_per_s == pytest.approx(15 / (run.seconds - run.prefill_s))
    assert BatchRun(1, seconds=2.0, tokens=10, steps=10, latencies_s=[2.0], prefill_s=1.0,
                    prefill_tokens=2).decode_tokens_per_s == 8.0
