"""CPU smoke runs and unit tests of the kernel benchmarks (bench/step_ab.py, fused_linear.py,
u12_linear.py, u12_fused_linear.py, hmma_knobs.py, hmma_trace.py, layer16.py, read_bound.py):
each main() runs in-process on tiny shapes (the interpreter) into a temporary results file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_fused_linear_bench_smoke(tmp_path: Path) -> None:
    import fused_linear as fused_linear_bench  # bench/fused_linear.py
    import torch

    out = tmp_path / "fused_linear.json"
    assert fused_linear_bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert result["torch"] and result["triton"] and result["git_commit"]
    assert {(r["name"], r["M"]) for r in result["rows"]} == {(n, m) for n in fused_linear_bench.SHAPES for m in (1, 5)}
    assert not [r for r in result["sweep"] if "error" in r], result["sweep"]
    assert len(result["tuned"]) == len(result["rows"])
    assert [row["M"] for row in result["layer"]] == [1, 5]
    assert all(row["fused_ms"] > 0 and row["unfused_ms"] > 0 for row in result["layer"])
    # bench/step_ab.py --bf16-tuned reads the file's one-row configs back as TUNED entries
    import step_ab
    from specpilot.kernels.fused_linear import FusedLinearConfig

    tuned = step_ab.tuned_from_sweep(out, FusedLinearConfig)
    rows = {(r["name"], r["M"]): r for r in result["rows"]}
    assert {key[1:] for key in tuned} == {(n, k, gated) for n, k, _, gated, _ in fused_linear_bench.SMOKE_SHAPES.values()}
    for key, cfg in tuned.items():
        assert isinstance(cfg, FusedLinearConfig) and key[0] == 1
        name = next(n for n, v in fused_linear_bench.SMOKE_SHAPES.items() if (v[0], v[1], v[3]) == key[1:])
        assert str(cfg) == rows[(name, 1)]["config"]


def test_step_ab_reads_u12_sweep_configs_back(tmp_path: Path) -> None:
    """bench/step_ab.py --u12-tuned: a bench/u12_linear.py "tuned" list (its fields) back as TUNED's one-row entries."""
    import step_ab
    from specpilot.kernels.u12_linear import TUNED, U12Config

    fields = ("block_n", "block_w", "split_k", "num_warps", "num_stages", "decode", "kernel", "maxnreg")
    tuned = [{"key": list(key), "config": str(cfg), **{f: getattr(cfg, f) for f in fields}} for key, cfg in TUNED.items()]
    path = tmp_path / "u12.json"
    path.write_text(json.dumps({"tuned": tuned}))
    back = step_ab.tuned_from_sweep(path, U12Config)
    assert back == {key: cfg for key, cfg in TUNED.items() if key[0] == 1}


def test_u12_fused_linear_sweep_smoke(tmp_path: Path) -> None:
    """bench/u12_fused_linear.py --smoke: every call of a layer (handoffs in and out, gated) at 1 and
    3 rows checked and timed at each config without an error, its best as u12_fused_linear's TUNED
    keys (rows bucket, N, K, gated) that bench/step_ab.py --u12-fused-tuned reads back, and the
    chained layers at the default and the best configs."""
    import step_ab
    import u12_fused_linear as bench

    from specpilot.kernels.u12_linear import U12Config

    out = tmp_path / "u12_fused_linear.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not [r for r in result["sweep"] if "error" in r or "skipped" in r]
    assert {(r["name"], r["M"]) for r in result["rows"]} == {(n, m) for n in bench.SMOKE_SHAPES for m in (1, 3)}
    assert [r["M"] for r in result["layer"]] == [1, 3] and all(r["best_ms"] > 0 for r in result["layer"])
    back = step_ab.tuned_from_sweep(out, U12Config, 1)
    assert set(back) == {(1, n, k, gated) for n, k, gated, _ in bench.SMOKE_SHAPES.values()}
    assert all(cfg.kernel == "gemv2" for cfg in back.values())
    assert set(step_ab.tuned_from_sweep(out, U12Config, 4)) == {(4, n, k, g) for n, k, g, _ in bench.SMOKE_SHAPES.values()}


def test_u12_fused_linear_parts_split_the_rows_squares() -> None:
    import torch
    import u12_fused_linear as bench

    stream = torch.randn(3, 10)
    parts = bench.parts_of(stream, 4)  # widths 3, 3, 3, 1
    assert parts.shape == (4, 3)
    torch.testing.assert_close(parts.sum(0), (stream ** 2).sum(1))
    torch.testing.assert_close(parts[3], stream[:, 9] ** 2)


def test_step_ab_verify_smoke(tmp_path: Path, monkeypatch) -> None:
    """bench/step_ab.py --smoke at q = 4 (the interpreter, a tiny model): every verify variant is
    captured (run once, under its own settings) and timed, the knob variants, the tiled weights and a sweep's configs for each layout
    (--u12-tuned) included, into one results file; its settings are restored after."""
    import step_ab

    from specpilot.kernels import u12_hmma, u12_linear

    sweep = tmp_path / "sweep.json"
    cfg = {"block_n": 64, "block_w": 32, "split_k": 8, "num_warps": 4, "num_stages": 1, "kernel": "hmma",
           "maxnreg": 128}
    sweep.write_text(json.dumps({"tuned": [{"key": [16, 4096, 4096], **cfg, "layout": "tiles"},
                                           {"key": [4, 4096, 4096], **cfg, "layout": "rows"}]}))
    tuned, tuned_tiles = dict(u12_linear.TUNED), dict(u12_linear.TUNED_TILES)
    assert set(step_ab.tuned_from_sweep(sweep, u12_linear.U12Config, 16, "tiles")) == {(16, 4096, 4096)}
    assert set(step_ab.tuned_from_sweep(sweep, u12_linear.U12Config, 4)) == {(4, 4096, 4096)}
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--smoke", "--q", "4", "--u12-tuned", str(sweep), "--out", str(out)])
    assert step_ab.main() == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"bf16", "bf16-cublas", "bf16-linear", "u12-handoff", "u12-gemv-rows", "u12-hmma-wide", "u12-tiles",
            "u12-tiles-sweep", "u12-sweep", "u12-lanes-g16", "u12-tiles-ahead", "u12-tiles-esc-split",
            "u12-many-rows-off"} <= set(rows)
    assert all(r["ms"] > 0 for r in rows.values())
    # each variant's logits checked against bf16's: the same weights, so close and finite
    assert all(r["finite"] and r["max_abs_diff_vs_bf16"] < 0.05 for r in rows.values()), rows
    assert rows["bf16"]["max_abs_diff_vs_bf16"] == 0 and rows["bf16"]["greedy_agree_vs_bf16"] == 1
    # each step ran as it was captured (step_ab.Ran): the bf16 ones on the bf16 weights, the u12 ones on
    # the u12 weights through the u12 kernels, whose rounding is not bf16's (before Ran, every step ran
    # after the last capture, on the tiled u12 weights, and all matched bit for bit)
    assert rows["bf16-cublas"]["max_abs_diff_vs_bf16"] == 0
    assert all(r["max_abs_diff_vs_bf16"] > 0 for n, r in rows.items() if n.startswith("u12")), rows
    assert u12_linear.TUNED == tuned and u12_linear.TUNED_TILES == tuned_tiles
    assert u12_linear.TENSOR_CORE_ROWS == 3 and u12_hmma.NARROW
    assert not u12_hmma.AHEAD and not u12_hmma.ESC_SPLIT


def test_step_ab_only_the_variants_asked_for(tmp_path: Path, monkeypatch) -> None:
    """bench/step_ab.py --only (a short GPU run) captures and times the named variants and bf16 alone,
    and refuses a name it did not capture; --tiles-tuned (a bench/hmma_knobs.py file's winners, knobs among their fields) is u12-tiles-sweep."""
    import step_ab

    knobs = tmp_path / "knobs.json"
    cfg = {"block_n": 16, "block_w": 32, "split_k": 2, "num_warps": 4, "num_stages": 1, "kernel": "hmma",
           "maxnreg": 128, "warp_k": True, "ahead": True}
    knobs.write_text(json.dumps({"tuned": [{"key": [16, 4096, 4096], **cfg, "layout": "tiles", "label": "wk"}]}))
    (tuned,) = step_ab.tuned_from_sweep(knobs, step_ab.u12_linear.U12Config, 16, "tiles").values()
    assert tuned.warp_k and tuned.ahead
    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--smoke", "--q", "4", "--only", "u12-tiles,u12-tiles-sweep",
                                      "--tiles-tuned", str(knobs), "--out", str(out)])
    assert step_ab.main() == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"bf16", "u12-tiles", "u12-tiles-sweep"}
    assert all(r["finite"] and r["max_abs_diff_vs_bf16"] < 0.05 for r in rows.values()), rows
    monkeypatch.setattr(sys, "argv", ["step_ab.py", "--smoke", "--q", "4", "--only", "u12-tiles,u12-tile-sweep",
                                      "--out", str(tmp_path / "typo.json")])
    assert step_ab.main() == 2 and not (tmp_path / "typo.json").exists()  # a misspelt variant: refused, nothing timed


def test_step_ab_knob_variants_set_each_module_and_restore_it() -> None:
    """bench/step_ab.py's knob variants: the few-row ones only at their rows, each setting landing on
    its module (u12_linear by default, u12_hmma by prefix) while its step is captured, then undone."""
    import step_ab
    from specpilot.kernels import u12_hmma, u12_linear

    assert set(step_ab.knob_variants(1)) == set(step_ab.U12_KNOB_VARIANTS)
    assert {"u12-gemv-rows", "u12-hmma-wide"} <= set(step_ab.knob_variants(4))
    assert "u12-gemv-rows" not in step_ab.knob_variants(8) and "u12-hmma-wide" in step_ab.knob_variants(8)
    assert not {"u12-gemv-rows", "u12-hmma-wide"} & set(step_ab.knob_variants(16))
    rows, narrow = u12_linear.TENSOR_CORE_ROWS, u12_hmma.NARROW
    with step_ab.knobs_set({"TENSOR_CORE_ROWS": 5, "u12_hmma.NARROW": not narrow}):
        assert (u12_linear.TENSOR_CORE_ROWS, u12_hmma.NARROW) == (5, not narrow)
    assert (u12_linear.TENSOR_CORE_ROWS, u12_hmma.NARROW) == (rows, narrow)
    with pytest.raises(RuntimeError), step_ab.knobs_set({"LANE_GROUP": 16}):
        assert u12_linear.LANE_GROUP == 16
        raise RuntimeError("a capture failing")
    assert u12_linear.LANE_GROUP == 4
    for name, knobs in step_ab.TILES_CACHE_VARIANTS.items():  # each a W_CACHE mode the kernel takes, not the default
        with step_ab.knobs_set(knobs):
            assert u12_hmma.W_CACHE in u12_hmma.W_CACHE_MODES and u12_hmma.W_CACHE != "ef", name
    assert u12_hmma.W_CACHE == "ef"


def test_step_ab_past_16_and_32_variants_only_where_they_differ() -> None:
    """bench/step_ab.py's tiled-weight knob variants: the past-16 ones from 17 rows, the past-32 one
    (the hmma kernel up to 64 rows) only above u12_linear.TILES_MAX_ROWS, where its setting changes
    the kernel a layer runs (default_config's choice at those rows)."""
    import step_ab
    from specpilot.kernels import u12_linear

    assert set(step_ab.tiles_knob_variants(16)) == set(step_ab.TILES_KNOB_VARIANTS)
    assert set(step_ab.tiles_knob_variants(32)) == {*step_ab.TILES_KNOB_VARIANTS, *step_ab.TILES_PAST_16_VARIANTS}
    assert set(step_ab.tiles_knob_variants(64)) >= {"u12-tiles-mma-past-16", "u12-tiles-hmma-to-64"}
    n, k = 4096, 4096
    for m, want in ((32, "hmma"), (64, "mma")):
        assert u12_linear.default_config(m, n, k, layout="tiles").kernel == want
        with step_ab.knobs_set(step_ab.TILES_PAST_32_VARIANTS["u12-tiles-hmma-to-64"]):
            assert u12_linear.default_config(m, n, k, layout="tiles").kernel == "hmma"
    assert u12_linear.TILES_MAX_ROWS == 32


def test_u12_linear_bench_times_each_layouts_default_and_the_tuned_hmma_config() -> None:
    """bench/u12_linear.py: each layout's sweep starts at default_config's choice for that layout
    (tiled weights: TUNED_TILES' hmma config up to TILES_MAX_ROWS rows, then the mma kernel), and
    `--kernels tuned` adds TUNED_TILES' hmma config wherever the kernel takes the rows (3..64)."""
    import importlib.util

    from specpilot.kernels.u12_linear import TUNED_TILES

    spec = importlib.util.spec_from_file_location("bench_u12_linear_layouts", BENCH / "u12_linear.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tuned = TUNED_TILES[(16, 4096, 4096)]
    assert bench.sweep_configs(32, 4096, 4096, ("tuned",), "tiles") == [tuned]
    rows = bench.sweep_configs(32, 4096, 4096, ("tuned",), "rows")
    assert rows[0].kernel == "mma" and rows[1:] == [tuned]
    at64 = bench.sweep_configs(64, 4096, 4096, ("tuned",), "tiles")
    assert at64[0].kernel == "mma" and at64[1:] == [tuned]
    assert bench.sweep_configs(16, 4096, 4096, ("hmma",), "tiles")[0] == tuned
    for m in (1, 2, 65):
        assert tuned not in bench.sweep_configs(m, 4096, 4096, ("tuned",), "tiles")


def test_hmma_knobs_bench_times_each_knob_where_it_says_so():
    """bench/hmma_knobs.py: each label names its config's knobs ("-ahead", "-ahead-x", "-escsplit", "wk",
    "tuned-w<cache>" the weight loads' cache policy; the
    occupancy rows "bw<block_w>", "-sk2x" for twice the tuned splits, "-r<registers>");
    every config is one the hmma kernel takes (U12Config refuses AHEAD where it cannot run, so a row
    never times the one-stage loop under an "-ahead" label), "-escsplit" only on split-K launches,
    and TUNED_TILES holds each shape it times."""
    import hmma_knobs

    from specpilot.kernels import u12_hmma
    from specpilot.kernels.u12_linear import TUNED_TILES

    for name, (n, k) in {s: hmma_knobs.SHAPES[s] for s in hmma_knobs.SPLIT}.items():
        cfgs = hmma_knobs.configs(name, TUNED_TILES[(16, n, k)])
        assert len({label for label, _ in cfgs}) == len(cfgs)
        for label, cfg in cfgs:
            assert cfg.ahead == ("-ahead" in label), label
            assert cfg.ahead_x == label.endswith("-ahead-x"), label
            assert cfg.esc_split == ("-escsplit" in label), label
            assert cfg.warp_k == label.startswith("wk"), label
            assert cfg.w_cache == (label.removeprefix("tuned-w") if label.startswith("tuned-w") else ""), label
            assert not cfg.w_cache or cfg.w_cache in u12_hmma.W_CACHE_MODES, label
            ways = 2 if "-sk2x" in label else 1  # the occupancy rows: twice the tuned splits
            assert cfg.kernel == "hmma" and (cfg.warp_k or cfg.split_k == ways * hmma_knobs.SPLIT[name])
            assert cfg.warp_k or "-sk" not in label.replace("-sk2x", "")
            if label.startswith("bw"):  # "bw<block_w>...-r<registers>"
                assert (cfg.block_w, cfg.maxnreg) == (int(label[2:4]), int(label.rsplit("-r", 1)[1])), label
            assert not cfg.esc_split or cfg.split_k > 1, (name, label)
        assert any(cfg.esc_split for _, cfg in cfgs) == (hmma_knobs.SPLIT[name] > 1)


def test_layer16_smoke(tmp_path: Path) -> None:
    """bench/layer16.py --smoke (2 small layers, the interpreter): every call of both ways and both
    chains run and timed, the file written with each group's calls; a bad --layers is refused."""
    import layer16

    out = tmp_path / "layer16.json"
    assert layer16.main(["--smoke", "--out", str(out)]) == 0
    us = json.loads(out.read_text())["us"]
    assert set(us) == {"plain", "fused", "fused without handoff", "chains"}
    assert len(us["plain"]) == 6 and len(us["fused"]) == 4 and set(us["chains"]) == {"plain chain", "fused chain"}
    assert all(t > 0 for group in us.values() for t in group.values())
    from specpilot.cost.model import parse_records  # bench/results/*.json calibrate the cost model: none here
    assert parse_records(json.loads(out.read_text()), str(out)) == []
    with pytest.raises(SystemExit, match="--layers: expected a positive count, got 0"):
        layer16.main(["--layers", "0"])


def test_hmma_knobs_labels_pick_rows_and_refuse_typos():
    """bench/hmma_knobs.py --labels: the named rows in the table's order; a label or shape the table
    lacks exits before anything is timed, naming it and what it expected."""
    import hmma_knobs

    from specpilot.kernels.u12_linear import TUNED_TILES

    n, k = hmma_knobs.SHAPES["o"]
    rows = hmma_knobs.configs("o", TUNED_TILES[(16, n, k)])
    assert hmma_knobs.pick(rows, None, "o") == rows
    assert [label for label, _ in hmma_knobs.pick(rows, "wk4-bn16,tuned", "o")] == ["tuned", "wk4-bn16"]
    with pytest.raises(SystemExit, match="wk9 not in o's table.*tuned"):
        hmma_knobs.pick(rows, "tuned,wk9", "o")
    with pytest.raises(SystemExit, match="gate_up's table"):  # ESC_SPLIT's rows: split-K shapes only
        hmma_knobs.pick(hmma_knobs.configs("gate_up", TUNED_TILES[(16, *hmma_knobs.SHAPES["gate_up"])]),
                        "tuned-escsplit", "gate_up")
    with pytest.raises(SystemExit, match="--shapes: ov unknown"):
        hmma_knobs.main(["--shapes", "o,ov"])


def test_hmma_knobs_smoke(tmp_path: Path) -> None:
    """bench/hmma_knobs.py --smoke (o at 32 x 256, the interpreter): a config of each knob of the table
    checked against x · Wᵀ and run, the file written with the shape's fastest config as a "tuned"
    entry that bench/step_ab.py --tiles-tuned reads back as that config, the module switches left off."""
    import hmma_knobs

    from specpilot.kernels import u12_hmma

    out = tmp_path / "knobs.json"
    # a row of each knob (the interpreter takes 75 s for the whole table; the GPU run checks every row)
    labels = "tuned,tuned-ahead-x,w1-r168-ahead,wk4-bn16-ahead,wk2-bn16-sk4,wk8-bn16,tuned-escsplit-ahead"
    assert hmma_knobs.main(["--smoke", "--labels", labels, "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert list(row["configs"]) == labels.split(",")
    assert row["name"] == "o" and set(row["us"]) == {"cublas", *row["configs"]}
    assert all(err < 1e-2 for err in row["rel_err"].values())
    assert not (u12_hmma.AHEAD or u12_hmma.AHEAD_X or u12_hmma.ESC_SPLIT)
    (win,) = json.loads(out.read_text())["tuned"]
    assert win["us"] == min(us for label, us in row["us"].items() if label != "cublas")
    import step_ab
    from specpilot.kernels.u12_linear import U12Config

    (cfg,) = step_ab.tuned_from_sweep(out, U12Config, 16, "tiles").values()
    assert str(cfg) == row["configs"][win["label"]] == win["config"]


@pytest.mark.parametrize("way", ["lsu", "cp", "tma"])
def test_read_bound_kernels_read_every_word_once(way: str) -> None:
    """bench/read_bound.py's read kernels (the interpreter): each config of its grid, at program counts
    that do not divide the chunks, sums every word of the buffer once (torch's sum mod 2^32); so a
    config's time is the time to read exactly the bytes it reports."""
    import torch
    import triton

    import read_bound

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    buf = torch.randint(-2**31, 2**31 - 1, (3 * 16 * 1024 // 4,), dtype=torch.int32,
                        generator=torch.Generator().manual_seed(1))
    want = int(buf.sum(dtype=torch.int64)) & 0xFFFFFFFF
    cfgs = read_bound.configs(way, sms=5)
    assert len({read_bound.label(way, c) for c in cfgs}) == len(cfgs)
    for cfg in cfgs[:: max(1, len(cfgs) // 6)]:
        out = torch.zeros(cfg["programs"], dtype=torch.int32)
        read_bound.launcher(way, cfg, buf, out)()
        assert int(out.sum(dtype=torch.int64)) & 0xFFFFFFFF == want, (way, cfg)


def test_hmma_trace_phases_from_stamps() -> None:
    """bench/hmma_trace.py's phases: from stamps in ns (entry, loop end, semaphore, sum, epilogue; 0 where
    a program did not stamp), a split-K call's spans in µs, and the gap between calls in the summary."""
    import hmma_trace
    import torch

    ns = lambda *v, sm=0: [int(1000 * x) for x in v] + [sm, 0, 0]  # noqa: E731  (slot 5: the program's SM)
    call = torch.tensor([ns(10, 20, 21, 0, 0), ns(11, 22, 22.5, 23, 26), ns(12, 19, 20, 0, 0, sm=3)], dtype=torch.int64)
    p = hmma_trace.phases(call, split_k=2)
    # SM 0 held two programs (loops 10 and 11 µs, torch's median the lower; the last ended 12 µs in), SM 3 one
    assert p["by_load"] == {2: dict(sms=1, loop=pytest.approx(10), loops_end=pytest.approx(12)),
                            1: dict(sms=1, loop=pytest.approx(7), loops_end=pytest.approx(9))}
    assert p["summing"] == 1 and p["call"] == pytest.approx(16) and p["entries"] == pytest.approx(2)
    assert p["loops_end"] == pytest.approx(12) and p["tail"] == pytest.approx(4) and p["loop_max"] == pytest.approx(11)
    assert (p["sem"], p["sum"], p["finish"]) == pytest.approx((0.5, 0.5, 3))
    one = hmma_trace.phases(torch.tensor([ns(0, 5, 0, 0, 7)], dtype=torch.int64), split_k=1)
    assert one["finish"] == pytest.approx(2) and "sem" not in one
    calls = [dict(p, begin=p["begin"] + 30 * i, end=p["end"] + 30 * i) for i in range(4)]
    summary = hmma_trace.summarize(calls)
    assert summary["gap"] == pytest.approx(30 - 16) and summary["by_load"][2]["loop"] == pytest.approx(10)
