"""The cost model's batch terms (cost/batch.py): verification turns compute-bound as its rows grow,
batched AR gains throughput with the batch, and verify-budget never predicts below full blocks."""

from __future__ import annotations

import pytest

from specpilot.cost import AcceptanceModel
from specpilot.cost.batch import batch_rows, compare_cost_table, compute_share, verify_cost_table, verify_ms
from specpilot.cost.gpu import load_gpu
from specpilot.hf.known import dflash_config, model_config
from specpilot.ir import lower


@pytest.fixture(scope="module")
def program():
    return lower(model_config("qwen3-8b"), dflash_config("qwen3-8b"), dtype="bfloat16", batch=64)


def test_verify_turns_compute_bound_as_tokens_grow(program):
    gpu = load_gpu("h200")
    assert compute_share(program, gpu, 1, 16) < 0.5 < compute_share(program, gpu, 64, 1024)
    few, many = (verify_ms(program, gpu, b, t, cuda_graphs=True) for b, t in ((8, 16), (64, 1024)))
    assert many > 3 * few  # weight-bound at 16 rows, FLOP-bound at 1024: far from flat (launches left out)
    table = verify_cost_table(program, gpu, 32, [32, 64, 128, 256, 512])
    assert all(a < b for a, b in zip(table.values(), list(table.values())[1:]))


def test_batch_rows_price_each_concurrency(program):
    acc = AcceptanceModel.from_tau(6.5, 15)
    rows = batch_rows(program, "h200", [1, 8, 64], acc)
    assert [r["concurrency"] for r in rows] == [1, 8, 64]
    assert rows[0]["ar_tokens_per_s"] < rows[1]["ar_tokens_per_s"] < rows[2]["ar_tokens_per_s"]
    assert rows[0]["speedup_full"] > rows[2]["speedup_full"]  # speculation pays less at load
    assert all(r["speedup_budget"] >= r["speedup_full"] * 0.999 and r["speedup_budget"] >= 0.999 for r in rows)


def test_compare_cost_table_sets_measured_beside_predicted():
    rows = compare_cost_table({8: 2.0, 16: 4.0, 32: 5.0}, {16: 6.0, 8: 1.0})
    assert rows == [{"tokens": 8, "predicted_ms": 2.0, "measured_ms": 1.0, "measured_over_predicted": 0.5},
                    {"tokens": 16, "predicted_ms": 4.0, "measured_ms": 6.0, "measured_over_predicted": 1.5}]
