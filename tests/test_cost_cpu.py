"""The cost model's CPU device (specpilot/cost/cpu.py): the host's record, its parsing and refusals,
the calibration that measures it once per host, the roofline it prices a CPU step with, and the
agent pricing its CPU trials with it rather than with the spec's GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specpilot.agent.predict import Predictor, rank_correlation
from specpilot.agent.proposals import Proposal, vet
from specpilot.compiler import cost_device, lower_spec, resolve_models, tune_setup
from specpilot.cost import CostModel
from specpilot.cost import cpu as cpu_cost
from specpilot.cost.cpu import (
    CPUCalibration, cpu_record, host_key, matmul_shapes, parse_cpu_record, record_path,
)
from specpilot.errors import SpecError, UnpricedError
from specpilot.passes.what_if import what_ifs
from specpilot.spec import load_spec

from conftest import tiny_spec

FIGURES = {"bandwidth": 2e10, "copy_bandwidth": 1.5e10, "op_overhead_s": 3e-6, "step_op_overhead_s": 7e-6,
           "host_sync_s": 5e-7, "fp32_rate": 4e9, "matmul_peak": 8e10}


def rate(m: int) -> float:
    """A CPU matmul rate that makes the tiny pair's matmuls weigh as the zoo's do on this host: few rows
    far below the peak (a GEMV reads its weight for little work)."""
    return min(4e8, 2.5e7 * m)  # saturating by 16 rows, as the zoo shapes measured here do


def record_dict(shapes, host=None, rows=(1, 4, 16, 64, 256), **changes) -> dict:
    key = host or host_key()
    d = {"kind": "cpu-device", "version": cpu_cost.RECORD_VERSION,
         "host": {"cpu": key.cpu, "cores": key.cores, "threads": key.threads, "torch": key.torch},
         "date": "2026-12-07T00:00:00+00:00", "load": [0.1, 0.1, 0.1], "figures": dict(FIGURES),
         "matmul": {"float32": [{"k": k, "n": n, "m": m, "flops_per_s": rate(m)} for k, n in sorted(shapes) for m in rows]}}
    d.update(changes)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cpu-cost") / "tiny.yaml"
    path.write_text(tiny_spec("dflash"))
    spec = load_spec(path)
    return spec, lower_spec(spec, resolve_models(spec), "float32")


@pytest.fixture
def cache(tmp_path, tiny, monkeypatch):
    """A cache holding this host's record at the tiny pair's shapes; measuring anything fails the test."""
    path = record_path(host_key(), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record_dict(matmul_shapes(tiny[1]))))

    def no_measuring(*a, **k):
        raise AssertionError("measured although the record had every figure")

    monkeypatch.setattr(cpu_cost, "measure_figures", no_measuring)
    monkeypatch.setattr(cpu_cost, "measure_matmuls", no_measuring)
    return tmp_path


# ---------------------------------------------------------------------------------------- the record

def test_a_record_becomes_a_device_that_prices_matmuls_at_their_shape():
    rec = parse_cpu_record(record_dict({(64, 64), (64, 1024)}), "host.json")
    dev = rec.device("float32")
    assert dev.name == "cpu" and not dev.runs_triton
    assert dev.kernel_latency_s == FIGURES["step_op_overhead_s"] and dev.launch_s == 0.0  # paid with or without graphs
    assert dev.bandwidth == FIGURES["bandwidth"] and dev.source_of("bandwidth") == "measured"
    assert dev.matmul_rate(16, 64, 64) == pytest.approx(rate(16))  # a measured point
    between = dev.matmul_rate(8, 64, 64)  # read linearly in log(rows) between 4 and 16
    assert rate(4) < between < rate(16) and between == pytest.approx((rate(4) + rate(16)) / 2)
    assert dev.matmul_rate(1000, 64, 64) == pytest.approx(rate(256))  # held outside the measured rows
    assert dev.matmul_rate(4, 70, 256) == pytest.approx(rate(4))  # the nearest k, n between measured widths
    with pytest.raises(UnpricedError, match="k=512"):
        dev.matmul_rate(1, 512, 64)
    assert parse_cpu_record(rec.to_dict(), "again").matmul == rec.matmul


def drop(d: dict, *path):
    d = json.loads(json.dumps(d))
    node = d
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return d


def put(d: dict, value, *path):
    d = json.loads(json.dumps(d))
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


GOOD = record_dict({(64, 64)})
BAD_RECORDS = {
    "a figure missing": (drop(GOOD, "figures", "bandwidth"), "figures.bandwidth is missing"),
    "the per-op overhead missing": (drop(GOOD, "figures", "step_op_overhead_s"), "figures.step_op_overhead_s is missing"),
    "a negative figure": (put(GOOD, -1.0, "figures", "fp32_rate"), "figures.fp32_rate: expected"),
    "a figure that is text": (put(GOOD, "fast", "figures", "matmul_peak"), "figures.matmul_peak: expected"),
    "no figures": (drop(GOOD, "figures"), "figures is missing"),
    "another kind": (put(GOOD, "gpu", "kind"), "kind/version"),
    "a host without threads": (drop(GOOD, "host", "threads"), "host.threads"),
    "a matmul without its rate": (drop(GOOD, "matmul", "float32", 0, "flops_per_s"), r"matmul.float32\[0\].flops_per_s"),
    "a matmul of an unknown dtype": (put(GOOD, [], "matmul", "int3"), "matmul.int3"),
    "not an object": ([1, 2], "expected a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_record_missing_or_misstating_a_figure_is_refused_naming_the_field(case):
    data, message = BAD_RECORDS[case]
    with pytest.raises(SpecError, match=message) as e:
        parse_cpu_record(data, "/cache/cost/cpu/host.json")
    assert "/cache/cost/cpu/host.json" in str(e.value)


def test_a_cached_record_of_another_host_or_unreadable_is_refused(tmp_path):
    key = host_key()
    path = record_path(key, tmp_path)
    path.parent.mkdir(parents=True)
    other = type(key)(key.cpu, key.cores, key.threads + 7, key.torch)
    path.write_text(json.dumps(record_dict({(64, 64)}, host=other)))
    with pytest.raises(SpecError, match=f"{key.threads + 7} torch threads.*this host is"):
        cpu_record({(64, 64)}, root=tmp_path)
    path.write_text("{not json")
    with pytest.raises(SpecError, match="cannot read the CPU record"):
        cpu_record({(64, 64)}, root=tmp_path)


def test_without_measuring_a_missing_record_or_shape_is_refused(tmp_path):
    with pytest.raises(SpecError, match="no record"):
        cpu_record({(64, 64)}, root=tmp_path, measure=False)
    path = record_path(host_key(), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record_dict({(64, 64)})))
    with pytest.raises(SpecError, match=r"no float32 matmul at \(k, n\) = \[\(32, 48\)\]"):
        cpu_record({(64, 64), (32, 48)}, root=tmp_path, measure=False)


def test_a_record_of_an_older_version_is_measured_again_or_refused(tmp_path, monkeypatch):
    path = record_path(host_key(), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(put(GOOD, cpu_cost.RECORD_VERSION - 1, "version")))
    with pytest.raises(SpecError, match="kind/version"):
        cpu_record({(64, 64)}, root=tmp_path, measure=False)
    monkeypatch.setattr(cpu_cost, "measure_figures", lambda c: dict(FIGURES))
    monkeypatch.setattr(cpu_cost, "measure_matmuls", lambda shapes, *a: {s: {1: 1e9} for s in shapes})
    rec = cpu_record({(64, 64)}, root=tmp_path)
    assert json.loads(path.read_text())["version"] == cpu_cost.RECORD_VERSION and rec.figures["bandwidth"] == 2e10


# ---------------------------------------------------------------------------------------- the calibration

QUICK = CPUCalibration(stream_bytes=1 << 20, pool_bytes=0, rows=(1, 8), min_time_s=1e-4, repeats=1)


def test_the_calibration_measures_the_host_once_and_then_only_new_shapes(tmp_path, monkeypatch):
    rec = cpu_record({(32, 48)}, root=tmp_path, config=QUICK)
    path = record_path(host_key(), tmp_path)
    assert path.is_file() and rec.host == host_key()
    assert all(rec.figures[f] > 0 for f in cpu_cost.FIGURES)
    assert set(rec.matmul["float32"]) == {(32, 48), cpu_cost.PEAK_SHAPE}
    assert set(rec.matmul["float32"][(32, 48)]) == {1, 8}
    asked = []
    monkeypatch.setattr(cpu_cost, "measure_figures", lambda c: pytest.fail("figures measured again"))
    real = cpu_cost.measure_matmuls
    monkeypatch.setattr(cpu_cost, "measure_matmuls", lambda shapes, *a: asked.append(set(shapes)) or real(shapes, *a))
    again = cpu_record({(32, 48)}, root=tmp_path, config=QUICK)
    assert asked == [] and again.figures == rec.figures  # the cache, nothing measured
    grown = cpu_record({(32, 48), (16, 40)}, root=tmp_path, config=QUICK)
    assert asked == [{(16, 40)}]  # only the shape the record lacked
    assert (16, 40) in parse_cpu_record(json.loads(path.read_text()), str(path)).matmul["float32"]
    assert grown.figures["bandwidth"] == rec.figures["bandwidth"]


# ---------------------------------------------------------------------------------------- the roofline

def relative(predictor: Predictor, stock, pipeline: str) -> float:
    c = vet(Proposal(pipeline, "test"), stock)
    return predictor.relative(c.program)[1]


def test_the_cpu_roofline_ranks_a_heavier_pipeline_above_a_lighter_one(tiny, cache):
    spec, stock = tiny
    cpu = Predictor(cost_device(spec, torch.device("cpu"), stock, cache=cache), what_ifs)
    start = vet(Proposal("", "start"), stock)
    cpu.learn_tau(start.program, 2.0)
    light, heavy = relative(cpu, stock, ""), relative(cpu, stock, "tree-verify{budget=128, topk=8}")
    assert heavy > 1.2 * light  # 129 verify rows a step against 4, for a larger τ
    vocab = stock.target.node(stock.target.find("lm_head")[0])["out_features"]
    assert relative(cpu, stock, f"draft-vocab{{size={vocab // 4}}}") < 0.95 * light  # a quarter of the head, same τ
    # every op of a step pays the measured per-op overhead, under the AR baseline's graphs too
    ar = CostModel(cpu.model.gpu).step(start.program, "ar")
    assert ar.kernels > 50 and ar.latency == pytest.approx(ar.kernels * FIGURES["step_op_overhead_s"])
    # nothing is captured on a CPU: the cuda-graphs pass saves no launches there, as it does on an H200
    assert relative(cpu, stock, "cuda-graphs") == pytest.approx(light, rel=1e-2)  # one host sync less
    h200 = Predictor("h200", what_ifs)
    h200.learn_tau(start.program, 2.0)
    assert relative(h200, stock, "cuda-graphs") < 0.8 * relative(h200, stock, "")


def test_the_predictor_prices_a_draft_length_at_the_alpha_measured_nearest_it(tiny, cache):
    spec, stock = tiny
    p = Predictor(cost_device(spec, torch.device("cpu"), stock, cache=cache), what_ifs)
    block = {b: vet(Proposal(f"draft-block-size{{size={b}}}", "t"), stock).program for b in (2, 4, 8)}
    p.learn_tau(block[4], 2.5)
    first = p.model.predict(block[2], p.workload(block[2])).tau.value
    p.learn_trial(block[2], 1.2)  # measured: this drafter accepts little at block 2
    assert p.model.predict(block[2], p.workload(block[2])).tau.value == pytest.approx(1.2)
    assert first > 1.2 + 0.1
    p.learn_trial(block[8], 3.0)
    lo, hi = p.alpha_at(1), p.alpha_at(7)
    assert lo < p.alpha_at(4) < hi  # between measured lengths: read linearly


def test_rank_correlation_is_spearmans_rho():
    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # ties at mean rank
    assert rank_correlation([1, 2], [1, 2]) is None and rank_correlation([1, 1, 1], [1, 2, 3]) is None


# ---------------------------------------------------------------------------------------- the agent

def test_the_agent_on_a_cpu_prices_with_this_hosts_record_not_a_gpu(tiny, cache, tmp_path):
    spec, stock = tiny
    assert spec.gpu == "h200"
    setup = tune_setup(spec, "cpu", cache=cache)
    dev = setup.predictor.model.gpu
    assert setup.gpu == "cpu" and dev.name == "cpu" and host_key().cpu in dev.full_name
    assert dev.kernel_latency_s == FIGURES["step_op_overhead_s"] and dev.bandwidth == FIGURES["bandwidth"]
    assert not math.isclose(dev.bandwidth, CostModel("h200").gpu.bandwidth)
    assert cost_device(spec, torch.device("cuda"), stock) == "h200"  # on a GPU: the spec's


def test_the_prediction_bench_never_calibrates_a_trial_by_itself(tiny, cache):
    """bench/agent/predict.py's calibrated predictions of a trial (from the trials before it, from
    every other) do not move when that trial's own measurement does; another trial's do."""
    from bench.agent.predict import predictions

    spec, stock = tiny
    device = cost_device(spec, torch.device("cpu"), stock, cache=cache)
    pipes = ["", "draft-block-size{size=2}", "draft-vocab{size=256}", "tree-verify{budget=15, topk=2}"]
    rows = [{"pipeline": p, "status": "validated", "relative": 1.0 + 0.1 * i, "tau": 1.5 + 0.2 * i}
            for i, p in enumerate(pipes)]
    base = predictions(stock, rows, device)
    moved = [dict(r) for r in rows]
    moved[2].update(relative=9.0, tau=1.05)
    again = predictions(stock, moved, device)
    assert again[2]["loo"] == pytest.approx(base[2]["loo"]) and again[2]["prior"] == pytest.approx(base[2]["prior"])
    assert again[3]["loo"] != pytest.approx(base[3]["loo"]) and again[3]["prior"] != pytest.approx(base[3]["prior"])
    assert again[1]["prior"] == pytest.approx(base[1]["prior"])  # before it: untouched
    assert base[0]["prior"] == pytest.approx(base[0]["relative"])  # nothing before the first


def test_explain_on_the_cpu_prices_with_this_hosts_record(tiny, cache, monkeypatch):
    """`specpilot explain --gpu cpu`: the fp32 program priced on this host's record (no GPU database
    entry named cpu), the table titled so; a GPU name still prices that GPU."""
    from click.testing import CliRunner

    from specpilot.cli import main

    spec, _ = tiny
    monkeypatch.setenv("SPECPILOT_CACHE", str(cache))
    runner = CliRunner()
    on_cpu = runner.invoke(main, ["explain", spec.source, "--gpu", "cpu", "--tau", "2"])
    assert on_cpu.exit_code == 0, on_cpu.output
    assert " on cpu: where a step's time goes" in on_cpu.output and "AR step" in on_cpu.output
    on_gpu = runner.invoke(main, ["explain", spec.source, "--gpu", "h200", "--tau", "2"])
    assert on_gpu.exit_code == 0 and " on h200" in on_gpu.output.lower()
    assert on_cpu.output.split("AR step")[1].split("\n")[0] != on_gpu.output.split("AR step")[1].split("\n")[0]
