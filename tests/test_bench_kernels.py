"""The kernel benchmarks (bench.kernels.*, bench.steps.step_ab and layer16): CPU smoke runs of those
with a --smoke mode (main() in-process on tiny shapes under the interpreter, into a temporary
results file in the harness schema), unit tests of the pieces they compute with, and the GPU-only
ones refusing the CPU in one line."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest
import torch

from bench.kernels import fused_linear as fused_linear_bench
from bench.kernels import hmma_knobs, hmma_trace, read_bound
from bench.kernels import u12_fused_linear as u12_fused_bench
from bench.kernels import u12_linear as u12_linear_bench
from bench.steps import layer16, step_ab
from bench.steps import step_times as st
from conftest import ON_GPU
from specpilot.backends.kernel_hooks import fused_ops
from specpilot.kernels.fused_linear import FusedLinearConfig
from specpilot.kernels.overlap import Launch
from specpilot.kernels.u12 import TENSOR_CORE_ROWS, TUNED, TUNED_FUSED, TUNED_TILES, U12Config, default_config
from specpilot.kernels.u12.gemv2 import gemv2_acc_registers

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _schema(path: Path, bench: str) -> dict:
    """The results file at `path`, checked to carry the harness schema for `bench`."""
    doc = json.loads(path.read_text())
    assert doc["bench"] == bench and doc["schema"] == 1 and doc["commit"] and doc["versions"]["torch"]
    assert isinstance(doc["records"], list)
    return doc


@pytest.mark.interpreter
def test_fused_linear_bench_smoke(tmp_path: Path) -> None:
    """bench.kernels.fused_linear --smoke: each shape's best config at 1 and 5 rows, a "tuned" entry
    a record, the layer timed fused and not; step_ab --bf16-tuned reads the one-row configs back."""
    out = tmp_path / "fused_linear.json"
    assert fused_linear_bench.main(["--smoke", "--out", str(out)]) == 0
    result = _schema(out, "fused_linear")
    assert {(r["name"], r["M"]) for r in result["records"]} == {(n, m) for n in fused_linear_bench.SHAPES for m in (1, 5)}
    assert not [r for r in result["sweep"] if "error" in r], result["sweep"]
    assert len(result["tuned"]) == len(result["records"])
    assert [row["M"] for row in result["layer"]] == [1, 5]
    assert all(row["fused_ms"] > 0 and row["unfused_ms"] > 0 for row in result["layer"])
    tuned = step_ab.tuned_from_sweep(out, FusedLinearConfig)
    rows = {(r["name"], r["M"]): r for r in result["records"]}
    assert {key[1:] for key in tuned} == {(n, k, gated) for n, k, _, gated, _ in fused_linear_bench.SMOKE_SHAPES.values()}
    for key, cfg in tuned.items():
        assert isinstance(cfg, FusedLinearConfig) and key[0] == 1
        name = next(n for n, v in fused_linear_bench.SMOKE_SHAPES.items() if (v[0], v[1], v[3]) == key[1:])
        assert str(cfg) == rows[(name, 1)]["config"]


def test_step_ab_reads_u12_sweep_configs_back(tmp_path: Path) -> None:
    """step_ab --u12-tuned: a bench.kernels.u12_linear "tuned" list (its fields) back as TUNED's one-row entries."""
    fields = [f.name for f in dataclasses.fields(U12Config)]
    tuned = [{"key": list(key), "config": str(cfg), **{f: getattr(cfg, f) for f in fields}} for key, cfg in TUNED.items()]
    path = tmp_path / "u12.json"
    path.write_text(json.dumps({"tuned": tuned}))
    assert step_ab.tuned_from_sweep(path, U12Config) == {key: cfg for key, cfg in TUNED.items() if key[0] == 1}


@pytest.mark.interpreter
@pytest.mark.slow
def test_u12_fused_linear_sweep_smoke(tmp_path: Path) -> None:
    """bench.kernels.u12_fused_linear --smoke: every call of a layer (handoffs in and out, gated) at 1
    and 3 rows checked and timed at each config without an error, its best as TUNED_FUSED keys (rows
    bucket, N, K, gated) that step_ab --u12-fused-tuned reads back, and the chained layers timed."""
    out = tmp_path / "u12_fused_linear.json"
    assert u12_fused_bench.main(["--smoke", "--out", str(out)]) == 0
    result = _schema(out, "u12_fused_linear")
    assert not [r for r in result["sweep"] if "error" in r or "skipped" in r]
    assert {(r["name"], r["M"]) for r in result["records"]} == {(n, m) for n in u12_fused_bench.SMOKE_SHAPES for m in (1, 3)}
    assert [r["M"] for r in result["layer"]] == [1, 3] and all(r["best_ms"] > 0 for r in result["layer"])
    back = step_ab.tuned_from_sweep(out, U12Config, 1)
    assert set(back) == {(1, n, k, gated) for n, k, gated, _ in u12_fused_bench.SMOKE_SHAPES.values()}
    assert all(cfg.kernel == "gemv2" for cfg in back.values())
    assert set(step_ab.tuned_from_sweep(out, U12Config, 4)) == {(4, n, k, g) for n, k, g, _ in
                                                                u12_fused_bench.SMOKE_SHAPES.values()}


def test_u12_fused_linear_parts_split_the_rows_squares() -> None:
    stream = torch.randn(3, 10)
    parts = u12_fused_bench.parts_of(stream, 4)  # widths 3, 3, 3, 1
    assert parts.shape == (4, 3)
    torch.testing.assert_close(parts.sum(0), (stream ** 2).sum(1))
    torch.testing.assert_close(parts[3], stream[:, 9] ** 2)


@pytest.fixture
def smoke_step(monkeypatch):
    """step_times' module state as step_ab --smoke sets it (restored after the test)."""
    for name in ("DEVICE", "CACHE_LEN", "CAPACITY"):
        monkeypatch.setattr(st, name, getattr(st, name))


@pytest.mark.interpreter
@pytest.mark.slow
def test_step_ab_verify_smoke(tmp_path: Path, smoke_step) -> None:
    """step_ab --smoke at q = 4 (a tiny model): the verify variants captured (run once, under its own
    settings) and timed, the tiled weights and a sweep's configs for each layout (--u12-tuned)
    included, into one results file; the kernel tables restored after. At 4 rows (GEMV_ROWS) every
    u12 variant of the row planes takes the unfused u12 path (no variant's ops serve the u12 layers
    fused there: the same logits each), so one of them, the verify step's own, stands for the rest."""
    ops = fused_ops("triton")
    u12_variants = {**step_ab.U12_VARIANTS, **step_ab.U12_VERIFY_VARIANTS}
    assert all(not dataclasses.replace(ops, **fields).linear_serves(4, u12=True) for fields in u12_variants.values())
    sweep = tmp_path / "sweep.json"
    cfg = {"block_n": 64, "block_w": 32, "split_k": 8, "num_warps": 4, "num_stages": 1, "kernel": "hmma", "maxnreg": 128}
    sweep.write_text(json.dumps({"tuned": [{"key": [16, 4096, 4096], **cfg, "layout": "tiles"},
                                           {"key": [4, 4096, 4096], **cfg, "layout": "rows"}]}))
    tables = dict(TUNED), dict(TUNED_TILES)
    assert set(step_ab.tuned_from_sweep(sweep, U12Config, 16, "tiles")) == {(16, 4096, 4096)}
    assert set(step_ab.tuned_from_sweep(sweep, U12Config, 4)) == {(4, 4096, 4096)}
    out = tmp_path / "ab.json"
    only = ("bf16-cublas", "bf16-linear", *step_ab.U12_VERIFY_VARIANTS, "u12-sweep", "u12-tiles", "u12-tiles-sweep")
    assert step_ab.main(["--smoke", "--q", "4", "--only", ",".join(only), "--u12-tuned", str(sweep),
                         "--out", str(out)]) == 0
    result = _schema(out, "step_ab")
    rows = {r["variant"]: r for r in result["records"]}
    assert set(rows) == {"bf16", *only}
    assert result["step"] == "verify-4" and all(r["ms"] > 0 for r in rows.values())
    # each variant's logits checked against bf16's: the same weights, so close and finite
    assert all(r["finite"] and r["max_abs_diff_vs_bf16"] < 0.05 for r in rows.values()), rows
    assert rows["bf16"]["max_abs_diff_vs_bf16"] == 0 and rows["bf16"]["greedy_agree_vs_bf16"] == 1
    # each step ran as it was captured (step_ab.Ran): the bf16 ones on the bf16 weights, the u12 ones on
    # the u12 weights through the u12 kernels, whose rounding is not bf16's
    assert rows["bf16-cublas"]["max_abs_diff_vs_bf16"] == 0
    assert all(r["max_abs_diff_vs_bf16"] > 0 for n, r in rows.items() if n.startswith("u12")), rows
    assert (dict(TUNED), dict(TUNED_TILES)) == tables


@pytest.mark.interpreter
def test_step_ab_gpu_variants_capture_on_the_cpu(smoke_step) -> None:
    """The variants step_ab captures on a GPU only (launch settings, TUNED entries of the 8B shapes)
    run on the tiny model too, each under its own settings, and put the ops and tables back."""
    st.DEVICE, st.CACHE_LEN, st.CAPACITY = "cpu", 24, 96
    tiles = dict(TUNED_TILES)
    graphs, _ = step_ab.capture("tiny", variants=True, q=4, only=frozenset({"u12-tiles-pdl-off", "u12-tiles-w4"}))
    assert set(graphs) == {"bf16", "u12-tiles-pdl-off", "u12-tiles-w4"}
    assert all(torch.isfinite(g.logits()).all() for g in graphs.values())
    assert dict(TUNED_TILES) == tiles


def test_step_ab_variants_change_what_they_name() -> None:
    """step_ab's table variants: each changes entries of the 8B shapes' table it names (the layer
    shapes, never the lm_head's); the past-16 ones from 17 rows only; tuned() puts a table back
    even when a capture fails; the launches are the Launch modes."""
    assert set(step_ab.tiles_tuned_variants(16)) == set(step_ab.TILES_TUNED_VARIANTS)
    assert set(step_ab.tiles_tuned_variants(32)) == {*step_ab.TILES_TUNED_VARIANTS, *step_ab.TILES_PAST_16_VARIANTS}
    layer = {(16, *step_ab.LINEARS[name]) for name in step_ab.LAYER}
    for name, override in {**step_ab.TILES_TUNED_VARIANTS, **step_ab.TILES_PAST_16_VARIANTS}.items():
        assert set(override) == layer and all(override[key] != TUNED_TILES[key] for key in layer), name
    for name, (table, override) in step_ab.U12_TUNED_VARIANTS.items():
        assert table is TUNED_FUSED and all(key[0] == 1 for key in override), name
    key = step_ab.fused_key("gate_up")
    saved = dict(TUNED_FUSED)
    with pytest.raises(RuntimeError), step_ab.tuned(TUNED_FUSED, {key: None}):
        assert key not in TUNED_FUSED
        raise RuntimeError("a capture failing")
    assert TUNED_FUSED == saved
    assert {launch for _, _, launch in step_ab.LAUNCH_VARIANTS} == {Launch(), Launch(pdl=1), Launch(pdl=2)}


def test_step_ab_refuses_what_it_cannot_run(capsys) -> None:
    assert step_ab.main(["--q", "0"]) == 2
    assert "--q: expected a positive count" in capsys.readouterr().err


@pytest.mark.interpreter
def test_step_ab_only_the_variants_asked_for(tmp_path: Path, smoke_step) -> None:
    """step_ab --only (a short GPU run) captures and times the named variants and bf16 alone, and
    refuses a name it did not capture; --tiles-tuned (a hmma_knobs file's winners) is u12-tiles-sweep."""
    knobs = tmp_path / "knobs.json"
    cfg = {"block_n": 32, "block_w": 32, "split_k": 2, "num_warps": 2, "num_stages": 1, "kernel": "hmma", "maxnreg": 128}
    knobs.write_text(json.dumps({"tuned": [{"key": [16, 4096, 4096], **cfg, "layout": "tiles", "label": "w2-r128"}]}))
    (tuned,) = step_ab.tuned_from_sweep(knobs, U12Config, 16, "tiles").values()
    assert tuned == U12Config(**cfg)
    out = tmp_path / "ab.json"
    assert step_ab.main(["--smoke", "--q", "4", "--only", "bf16-cublas,u12-tiles-sweep", "--tiles-tuned", str(knobs),
                         "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in _schema(out, "step_ab")["records"]}
    assert set(rows) == {"bf16", "bf16-cublas", "u12-tiles-sweep"}
    assert all(r["finite"] and r["max_abs_diff_vs_bf16"] < 0.05 for r in rows.values()), rows
    typo = tmp_path / "typo.json"
    assert step_ab.main(["--smoke", "--q", "4", "--only", "bf16,u12-tile-sweep", "--out", str(typo)]) == 2
    assert not typo.exists()  # a misspelt variant: refused, nothing timed


def test_u12_linear_sweep_tables() -> None:
    """bench.kernels.u12_linear's sweep tables: gemv2's tiles fit 64 accumulator registers at one row
    (enough of them at 4), the mma tiles are wgmma's (64 rows a warp group), no tile twice."""
    assert all(cfg.kernel == "gemv2" for cfg in u12_linear_bench.SWEEP_GEMV2)
    assert len(set(u12_linear_bench.SWEEP_GEMV2)) == len(u12_linear_bench.SWEEP_GEMV2)
    assert all(gemv2_acc_registers(cfg, 1) <= 64 for cfg in u12_linear_bench.SWEEP_GEMV2)
    assert sum(gemv2_acc_registers(cfg, 4) <= 64 for cfg in u12_linear_bench.SWEEP_GEMV2) >= 12
    mma = u12_linear_bench.SWEEP_MMA
    assert all(cfg.kernel == "mma" and cfg.split_k == 1 for cfg in mma) and len(set(mma)) == len(mma)
    assert all(cfg.block_n >= 64 and cfg.block_w >= 16 for cfg in mma)
    assert all(cfg.kernel == "hmma" and cfg.split_k == 1 for cfg in u12_linear_bench.SWEEP_HMMA)


def test_u12_linear_sweep_configs_by_rows_and_kernel() -> None:
    """sweep_configs: the default config first, then each kernel's tiles at each split it sweeps,
    at the rows that kernel takes (mma from TENSOR_CORE_ROWS; hmma TENSOR_CORE_ROWS..64, 32-row
    programs past 16)."""
    sweep = u12_linear_bench.sweep_configs
    configs = sweep(16, 6144, 4096, ("mma",))
    assert configs[0] == default_config(16, 6144, 4096)
    mma = [cfg for cfg in configs if cfg.kernel == "mma"]
    assert {dataclasses.replace(cfg, split_k=1) for cfg in mma} == set(u12_linear_bench.SWEEP_MMA)
    assert {cfg.split_k for cfg in mma} == set(u12_linear_bench.SPLIT_KS_MMA)
    assert [cfg for cfg in sweep(TENSOR_CORE_ROWS, 6144, 4096, ("mma",)) if cfg.kernel == "mma"]
    assert not [cfg for cfg in sweep(TENSOR_CORE_ROWS - 1, 6144, 4096, ("mma",)) if cfg.kernel == "mma"]
    assert not [cfg for cfg in sweep(16, 6144, 4096)[1:] if cfg.kernel == "mma"]
    hmma = [cfg for cfg in sweep(16, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
    assert {dataclasses.replace(cfg, split_k=1) for cfg in hmma} == set(u12_linear_bench.SWEEP_HMMA)
    assert {cfg.split_k for cfg in hmma} == set(u12_linear_bench.SPLIT_KS_HMMA)
    for m in (2, 65):
        assert not [cfg for cfg in sweep(m, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
    for m in (17, 64):  # past 16 rows: 32-row programs, a warp one m-tile, and the tuned tile at its splits
        wide = [cfg for cfg in sweep(m, 4096, 4096, ("hmma",)) if cfg.kernel == "hmma"]
        assert wide and all(cfg.block_n == 16 * cfg.num_warps for cfg in wide)
        assert {cfg.split_k for cfg in wide if cfg.block_n == 32 and cfg.block_w == 32} == {1, 4, 8, 16}


def test_u12_linear_bench_times_each_layouts_default_and_the_tuned_hmma_config() -> None:
    """bench.kernels.u12_linear: each layout's sweep starts at default_config's choice for that layout
    (tiled weights: TUNED_TILES' hmma config up to TILES_MAX_ROWS rows, then the mma kernel), and
    `--kernels tuned` adds TUNED_TILES' hmma config wherever the kernel takes the rows (3..64)."""
    sweep = u12_linear_bench.sweep_configs
    tuned = TUNED_TILES[(16, 4096, 4096)]
    assert sweep(32, 4096, 4096, ("tuned",), "tiles") == [tuned]
    rows = sweep(32, 4096, 4096, ("tuned",), "rows")
    assert rows[0].kernel == "mma" and rows[1:] == [tuned]
    at64 = sweep(64, 4096, 4096, ("tuned",), "tiles")
    assert at64[0].kernel == "mma" and at64[1:] == [tuned]
    assert sweep(16, 4096, 4096, ("hmma",), "tiles")[0] == tuned
    for m in (1, 2, 65):
        assert tuned not in sweep(m, 4096, 4096, ("tuned",), "tiles")


@pytest.mark.interpreter
def test_layer16_smoke(tmp_path: Path) -> None:
    """bench.steps.layer16 --smoke (2 tiny layers): every call of both ways and both chains run and
    timed, a record each; a bad --layers is refused."""
    out = tmp_path / "layer16.json"
    assert layer16.main(["--smoke", "--out", str(out)]) == 0
    result = _schema(out, "layer16")
    groups: dict[str, list[str]] = {}
    for r in result["records"]:
        assert r["us"] > 0, r
        groups.setdefault(r["group"], []).append(r["call"])
    assert set(groups) == {"plain", "fused", "fused without handoff", "chains"}
    assert len(groups["plain"]) == 6 and len(groups["fused"]) == 4 and groups["chains"] == ["plain chain", "fused chain"]
    assert set(result["sums_us"]) == {"plain", "fused", "fused without handoff"}
    from specpilot.cost.model import parse_records  # bench/results/*.json calibrate the cost model: none here
    assert parse_records(json.loads(out.read_text()), str(out)) == []
    assert layer16.main(["--layers", "0"]) == 2


def test_hmma_knobs_table_and_labels() -> None:
    """bench.kernels.hmma_knobs: each shape's table starts at TUNED_TILES' config, every row an hmma
    config at the tuned splits (twice them where labelled -sk2x), labels unique; --labels picks
    rows in the table's order and a label or shape the table lacks exits before anything is timed."""
    for name in hmma_knobs.SPLIT:
        tuned = TUNED_TILES[(16, *hmma_knobs.SHAPES[name])]
        rows = hmma_knobs.configs(name, tuned)
        assert rows[0] == ("tuned", tuned) and len({label for label, _ in rows}) == len(rows)
        for label, cfg in rows:
            ways = 2 if "-sk2x" in label else 1
            assert cfg.kernel == "hmma" and cfg.split_k == ways * hmma_knobs.SPLIT[name], label
            if label.startswith("bw"):  # "bw<block_w>...-r<registers>"
                assert (cfg.block_w, cfg.maxnreg) == (int(label[2:4]), int(label.rsplit("-r", 1)[1])), label
    rows = hmma_knobs.configs("o", TUNED_TILES[(16, *hmma_knobs.SHAPES["o"])])
    assert hmma_knobs.pick(rows, None, "o") == rows
    assert [label for label, _ in hmma_knobs.pick(rows, "w2-r128,tuned", "o")] == ["tuned", "w2-r128"]
    with pytest.raises(SystemExit, match="w9 not in o's table.*tuned"):
        hmma_knobs.pick(rows, "tuned,w9", "o")
    with pytest.raises(SystemExit, match="--shapes: ov unknown"):
        hmma_knobs.main(["--shapes", "o,ov"])


@pytest.mark.interpreter
def test_hmma_knobs_smoke(tmp_path: Path) -> None:
    """bench.kernels.hmma_knobs --smoke (o at 32 x 256): rows of the table checked against x · Wᵀ and
    run, the file written with the shape's fastest config as a "tuned" entry that step_ab
    --tiles-tuned reads back as that config."""
    out = tmp_path / "knobs.json"
    labels = "tuned,bw16-sk2x-r64"
    assert hmma_knobs.main(["--smoke", "--labels", labels, "--out", str(out)]) == 0
    result = _schema(out, "hmma_knobs")
    (row,) = result["records"]
    assert list(row["configs"]) == labels.split(",")
    assert row["name"] == "o" and set(row["us"]) == {"cublas", *row["configs"]}
    assert all(err < 1e-2 for err in row["rel_err"].values())
    (win,) = result["tuned"]
    assert win["us"] == min(us for label, us in row["us"].items() if label != "cublas")
    (cfg,) = step_ab.tuned_from_sweep(out, U12Config, 16, "tiles").values()
    assert str(cfg) == row["configs"][win["label"]] == win["config"]


@pytest.mark.interpreter
@pytest.mark.parametrize("way", ["lsu", "cp", "tma"])
def test_read_bound_kernels_read_every_word_once(way: str) -> None:
    """bench.kernels.read_bound's read kernels: each config of its grid, at program counts that do not
    divide the chunks, sums every word of the buffer once (torch's sum mod 2^32); so a config's time
    is the time to read exactly the bytes it reports."""
    import triton

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
    """bench.kernels.hmma_trace's phases: from stamps in ns (entry, loop end, semaphore, sum, epilogue;
    0 where a program did not stamp), a split-K call's spans in µs, and the gap between calls."""
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


GPU_ONLY = ("bench.kernels.u12_linear", "bench.kernels.hmma_trace", "bench.kernels.hmma_parts",
            "bench.kernels.read_bound", "bench.kernels.linear_ncu", "bench.kernels.attention_variants",
            "bench.kernels.attention_split_kv", "bench.steps.step_ab", "bench.steps.layer16")


@pytest.mark.skipif(ON_GPU, reason="on a GPU these run the benchmark")
@pytest.mark.parametrize("module", GPU_ONLY)
def test_gpu_benchmarks_refuse_the_cpu_in_one_line(module: str, capsys) -> None:
    """Without --smoke a kernel benchmark needs a CUDA GPU: on the CPU it says so in one line and exits 2."""
    assert importlib.import_module(module).main([]) == 2
    err = capsys.readouterr().err.strip()
    assert "CUDA" in err and len(err.splitlines()) == 1, err
