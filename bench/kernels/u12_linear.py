"""u12_linear against cuBLAS bf16 (x @ W.T) at the Llama-3.1-8B linear shapes, on one GPU.

Sweep: for each shape and M in 1, 4, 16, 64, random N(0, 0.02) bf16 weights; every config of
kernels/u12_linear.py's SWEEP_GEMV (M <= 4) or SWEEP_DOT (M >= 16) crossed with SPLIT_KS, for M <= 4
the gemv2 kernel's SWEEP_GEMV2 (those within 64 accumulator registers a thread at that M), with
`--kernels mma` from 3 rows the mma kernel's SWEEP_MMA crossed with SPLIT_KS_MMA (not in the default
run: `--kernels mma --ms 16,64` is about 600 configs and 40 compiles, beyond the default budget), plus
the default config, is first checked against the reference (one bf16 step, see check_close) and then
timed with triton.testing.do_bench (CUDA events, L2 flushed before each call, median), or with
`--graph` as the median replay of a CUDA graph of one call per distinct copy of the weight (about
2 GB of copies): do_bench's single launches include the host's launch overhead wherever it exceeds
the kernel (cuBLAS's qkv at M = 16: 22.5 µs there, 15.2 in a graph). `--kernels hmma` adds
kernels/u12_hmma.py's SWEEP_HMMA for 3 <= M <= 16 and, past 16 rows to the kernel's 64, its 32-row programs
(one m-tile a warp; 128 registers at 32 words a chunk, 168 at 64) and TUNED_TILES' tile at half, once and twice its splits
(`--kernels mma` from 3 rows up too); `--kernels tuned`
TUNED_TILES' hmma config from 3 rows to the kernel's 64 (past u12_linear.TILES_MAX_ROWS too: what raising
it would run). `--layouts rows,tiles` sweeps each config on the weight in each layout (U12Tensor.layout;
rows' "layout" says which), each layout's default config first (default_config's `layout`). A config
that fails to compile, run or match is recorded with its error, not timed. A time budget skips the
rest of the sweep (rows marked "skipped") so the run stays within about four minutes on an H200.

Whole step: the issue's "whole AR step" proxy, measured once per M in 1, 16: the 32 layers'
qkv, o, gate_up and down linears plus lm_head of Llama-3.1-8B (distinct random weights per layer,
15 GB in bf16), issued back to back in one CUDA graph, cuBLAS bf16 against u12_linear with the
sweep's best config per shape. No attention, norms or activations: the linears' weight traffic only.

Writes bench/results/u12_linear_<gpu>.json: "rows" (the best config per shape and M, the keys
specpilot/cost and bench/readme_tables read), "sweep" (every row, for the next round), "tuned"
(the best configs as kernels/u12_linear.py's TUNED keys), "whole_step"; prints a short table last.

    python bench/u12_linear.py [--out FILE] [--budget-s 150] [--no-step] [--ms 1,4] [--kernels gemv2,mma,hmma,tuned] [--graph]
    [--layouts rows,tiles]
    (SPECPILOT_COMMIT=... names the commit where the tree has no .git)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")
LAYERS = 32
MS = (1, 4, 16, 64)
STEP_MS = (1, 16)
SIGMA = 0.02
ROOT = Path(__file__).resolve().parent.parent


U12_FILES = ("bench/u12_linear.py", "kernels/u12_linear.py", "kernels/u12_mma.py", "kernels/u12_hmma.py",
             "specpilot/formats/u12.py")


def git_commit(files: tuple[str, ...] = U12_FILES) -> str:
    """SPECPILOT_COMMIT (or GIT_COMMIT) where set, else HEAD, marked dirty when the files behind
    these numbers differ from it."""
    for var in ("SPECPILOT_COMMIT", "GIT_COMMIT"):
        if os.environ.get(var):
            return os.environ[var]
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = run("rev-parse", "HEAD") or "unknown"
    return commit + ("-dirty" if run("status", "--porcelain", "--", *files) else "")


def check_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """y and ref (bf16) may differ by one bf16 step (2^-7 relative) after fp32 sums of different
    order, whose error grows with K: allow 2^-16 of sum |x| |w| (``scale``; typical is sqrt(K) 2^-24 of it)."""
    bad = (y.float() - ref.float()).abs() > 2**-7 * ref.float().abs() + 2**-16 * scale
    if bad.any() or not torch.isfinite(y).all():
        raise AssertionError(f"differs from the reference at {int(bad.sum())} of {y.numel()} outputs")


def sweep_configs(m: int, n: int, k: int, kernels: tuple[str, ...] = ("tile", "gemv2"), layout: str = "rows") -> list:
    """The default config for a weight in `layout` first, then each sweep tile crossed with SPLIT_KS
    (splits that fit K), for M <= 4 the gemv2 configs whose accumulator fits 64 registers a thread,
    from TENSOR_CORE_ROWS (3) rows up the mma configs crossed with SPLIT_KS_MMA, and up to 16 rows the
    hmma configs crossed with SPLIT_KS_HMMA, then the tile kernel's default with the one-weight-per-op
    decode (what the pair decode saves). `kernels` picks the sweeps (the default config always runs);
    "tuned" adds TUNED_TILES' hmma config from TENSOR_CORE_ROWS rows to u12_hmma.MAX_M, past
    TILES_MAX_ROWS too (what raising it would run: 32-row programs side by side)."""
    from specpilot.kernels.u12_hmma import MAX_M
    from specpilot.kernels.u12_linear import (
        SPLIT_KS, SPLIT_KS_HMMA, SPLIT_KS_MMA, SWEEP_DOT, SWEEP_GEMV, SWEEP_GEMV2, SWEEP_HMMA,
        SWEEP_MMA, TENSOR_CORE_ROWS, TUNED_TILES, _block_m, _tile_config, default_config,
        gemv2_acc_registers, nearest_tuned,
    )

    default = default_config(m, n, k, layout=layout)
    out = [default]

    def add_splits(tiles, splits):  # each tile at each split that leaves at least two word blocks a split
        for tile in tiles:
            for split in splits:
                if split == 1 or k // (4 * tile.block_w) >= 2 * split:
                    cfg = dataclasses.replace(tile, split_k=split)
                    if cfg not in out:
                        out.append(cfg)

    add_splits(SWEEP_GEMV if m <= 4 else SWEEP_DOT, SPLIT_KS)
    tuned = nearest_tuned(TUNED_TILES, (16, n, k))
    if "tile" not in kernels:
        del out[1:]
    if "tuned" in kernels and tuned is not None and TENSOR_CORE_ROWS <= m <= MAX_M and tuned not in out:
        out.append(tuned)
    if m <= 4 and "gemv2" in kernels:
        out += [cfg for cfg in SWEEP_GEMV2 if cfg not in out and gemv2_acc_registers(cfg, _block_m(m)) <= 64]
    if m >= TENSOR_CORE_ROWS and "mma" in kernels:
        add_splits(SWEEP_MMA, SPLIT_KS_MMA)
    if TENSOR_CORE_ROWS <= m <= 16 and "hmma" in kernels:
        add_splits(SWEEP_HMMA, SPLIT_KS_HMMA)
    if 16 < m <= MAX_M and "hmma" in kernels:  # 32-row programs (u12_hmma.WIDE: a warp one m-tile) that
        # keep 128 registers (168 at 64 words a chunk) for the 4 n-tiles' accumulators, and TUNED_TILES'
        # tile at half, once and twice its splits
        add_splits([c for c in SWEEP_HMMA if c.block_n == 16 * c.num_warps and c.block_w >= 32
                    and c.maxnreg == (128 if c.block_w == 32 else 168)], SPLIT_KS_HMMA)
        if tuned is not None:
            add_splits([dataclasses.replace(tuned, split_k=1)], sorted({1, tuned.split_k // 2, tuned.split_k,
                                                                       2 * tuned.split_k} - {0}))
    tile_default = default if default.kernel == "tile" else _tile_config(m, n, k, on_gpu=True)
    return out + ([dataclasses.replace(tile_default, decode="single")] if "tile" in kernels else [])


def write_result(result: dict, out: Path | None, bench: str, gpu: str) -> Path:
    """Write `result` to `out`, by default bench/results/<bench>_<gpu slug>.json; returns the path."""
    out = out or ROOT / "bench" / "results" / f"{bench}_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def print_sweep_summary(gpu: str, out: Path, sweep: list[dict], sweep_s: float) -> None:
    """Versions, where the file went, the sweep's row, error and skip counts, its first errors."""
    import triton

    errors = [r for r in sweep if "error" in r]
    skipped = sum("skipped" in r for r in sweep)
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; wrote {out}")
    print(f"sweep: {len(sweep)} rows, {len(errors)} errors, {skipped} skipped, {sweep_s:.0f} s")
    for r in errors[:5]:
        print(f"  error {r['name']} M={r['M']} {r['config']}: {r['error'][:160]}")


def smoke_or_gpu(script: str, smoke: bool) -> str:
    """The device a bench script's run takes: "cpu" under --smoke (the kernels in Triton's
    interpreter), else "cuda"; exits naming what is missing where neither holds."""
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit(f"{script} --smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if not smoke and not torch.cuda.is_available():
        sys.exit(f"{script} times CUDA kernels: it needs a GPU.")
    return "cpu" if smoke else "cuda"


def time_list(fns, smoke: bool) -> float:
    """ms for fns run in order: a CUDA graph's median replay (time_graph); under --smoke one pass's
    wall clock (the interpreter: a check of the script, no measurement)."""
    if not smoke:
        return time_graph(fns)
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) * 1e3


def time_graph(fns, reps: int = 20) -> float:
    """Median ms of one replay of a CUDA graph running fns in order (each warmed up first)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del g
    return sorted(times)[len(times) // 2]


def whole_step(best: dict, gen: torch.Generator) -> list[dict]:
    """The 32 layers' linears + lm_head in one CUDA graph, cuBLAS bf16 vs u12 (best: (config, layout) by
    (shape, M); each M's weights in its best layouts)."""
    from specpilot.kernels.u12_linear import u12_linear
    from specpilot.formats.u12 import pack_u12

    weights = []  # (name, bf16 weight, u12 weight)
    for name in [s for _ in range(LAYERS) for s in LAYER_SHAPES] + ["lm_head"]:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=gen) * SIGMA).to(torch.bfloat16)
        weights.append((name, w, pack_u12(w)))
    out = []
    for m in STEP_MS:
        xs = {k: torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16) for k in (4096, 14336)}
        bf16 = [lambda x=xs[w.shape[1]], w=w: x @ w.T for _, w, _ in weights]
        cfg, layout = {}, {}
        for name, _, _ in weights:
            cfg[name], layout[name] = best.get((name, m), (None, "rows"))
        laid = [(name, t.with_layout(layout[name])) for name, _, t in weights]
        u12 = [lambda x=xs[t.shape[1]], t=t, c=cfg[name]: u12_linear(x, t, c) for name, t in laid]
        cublas_ms, u12_ms = time_graph(bf16), time_graph(u12)
        out.append({
            "what": "32 layers' qkv/o/gate_up/down + lm_head linears of Llama-3.1-8B in one CUDA graph "
                    "(no attention, norms or activations): the whole-AR-step proxy",
            "M": m, "cublas_ms": cublas_ms, "u12_ms": u12_ms, "speedup": cublas_ms / u12_ms,
            "bf16_weight_gb": sum(w.numel() * 2 for _, w, _ in weights) / 1e9,
            "u12_weight_gb": sum(t.nbytes for _, _, t in weights) / 1e9,
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result file (default bench/results/u12_linear_<gpu>.json)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="sweep time budget; later rows are skipped")
    parser.add_argument("--no-step", action="store_true", help="skip the whole-step CUDA graph")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x to sweep, comma-separated")
    parser.add_argument("--graph", action="store_true",
                        help="time each config in a CUDA graph over distinct copies of the weight (no host "
                             "overhead, no L2 reuse) instead of do_bench's single launches")
    parser.add_argument("--kernels", default="tile,gemv2",
                        help="kernels to sweep: tile, gemv2, mma, hmma, tuned (the default config always runs)")
    parser.add_argument("--layouts", default="rows",
                        help="the weight's layouts (U12Tensor.layout) to run every config on: rows, tiles")
    args = parser.parse_args()
    layouts = tuple(args.layouts.split(","))
    if not set(layouts) <= {"rows", "tiles"}:
        parser.error(f"--layouts: expected rows and/or tiles, got {args.layouts!r}")
    if not torch.cuda.is_available():
        sys.exit("bench/u12_linear.py times CUDA kernels and needs a CUDA GPU; none is visible here.")

    import triton
    from triton.testing import do_bench

    from specpilot.kernels.u12_linear import _block_m, u12_linear, u12_linear_reference
    from specpilot.formats.u12 import pack_u12

    t0 = time.monotonic()
    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    do_bench(lambda a=a: a @ a, warmup=200, rep=200)  # clocks up from idle before the first timing
    del a
    sweep, rows, best = [], [], {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * SIGMA).to(torch.bfloat16)
        t = pack_u12(w)
        copies = [(w, t)]  # --graph: distinct weights, about 2 GB in bf16, at least 2
        while args.graph and len(copies) < max(2, min(LAYERS, int(2e9 // (2 * n * k)))):
            wc = (torch.randn(n, k, device="cuda", generator=g) * SIGMA).to(torch.bfloat16)
            copies.append((wc, pack_u12(wc)))
        laid = {lay: (t.with_layout(lay), [tc.with_layout(lay) for _, tc in copies]) for lay in layouts}
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = u12_linear_reference(x, t)
            scale = x.abs().float() @ w.abs().float().T
            if args.graph:
                t_cublas = time_graph([lambda x=x, w=wc: x @ w.T for wc, _ in copies]) * 1e3 / len(copies)
            else:
                t_cublas = do_bench(lambda x=x, w=w: x @ w.T, warmup=10, rep=40, return_mode="median") * 1e3
            io = 2 * m * k + 2 * m * n  # x read, y written
            base = {"name": name, "N": n, "K": k, "M": m, "cublas_us": t_cublas}
            kernels = tuple(args.kernels.split(","))
            configs = {lay: sweep_configs(m, n, k, kernels, lay) for lay in layouts}  # each layout's default first
            # the layouts' lists interleaved, so that a budget cut leaves each layout its first configs
            pairs = [(c, lay) for row in itertools.zip_longest(*configs.values()) for c, lay in zip(row, configs)
                     if c is not None]
            for cfg, layout in pairs:
                row = {**base, "config": str(cfg), "layout": layout, "default": cfg == configs[layout][0]}
                wt, wcopies = laid[layout]  # the weight (and its copies) in this row's layout
                if time.monotonic() - t0 > args.budget_s:
                    sweep.append({**row, "skipped": "time budget"})
                    continue
                try:
                    y = u12_linear(x, wt, cfg)
                    check_close(y, ref, scale)
                    if args.graph:
                        us = time_graph([lambda x=x, t=tc, c=cfg: u12_linear(x, t, c) for tc in wcopies]) * 1e3 / len(copies)
                    else:
                        us = do_bench(lambda x=x, t=wt, cfg=cfg: u12_linear(x, t, cfg), warmup=5, rep=20,
                                      return_mode="median") * 1e3
                except Exception as e:  # a config that does not compile, run or match: recorded, not fatal
                    sweep.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                sweep.append({**row, "us": us, "speedup": t_cublas / us, "rel_err_vs_reference": err})
                if (name, m) not in best or us < best[(name, m)][1]:
                    best[(name, m)] = (cfg, us, err, layout)
            if (name, m) in best:
                cfg, us, err, layout = best[(name, m)]
                defaults = {r["layout"]: r for r in sweep if r["name"] == name and r["M"] == m and r["default"]}
                default = defaults.get(layouts[0], {})
                rows.append({
                    **base, "u12_us": us, "speedup": t_cublas / us,
                    "cublas_tb_s": (2 * n * k + io) / t_cublas / 1e6, "u12_tb_s": (t.nbytes + io) / us / 1e6,
                    "u12_bytes": t.nbytes, "bf16_bytes": 2 * n * k, "escapes": t.esc_idx.numel(),
                    "rel_err_vs_reference": err, "config": str(cfg), "layout": layout,
                    "default_config": default.get("config"), "default_us": default.get("us"),
                    "defaults": {lay: {"config": r.get("config"), "us": r.get("us")} for lay, r in defaults.items()},
                })
        del w, t, scale, copies, laid
        torch.cuda.empty_cache()
    sweep_s = time.monotonic() - t0

    step = []
    if not args.no_step:
        try:
            step = whole_step({key: (v[0], v[3]) for key, v in best.items()}, g)
        except Exception as e:  # e.g. out of memory on a smaller GPU: the sweep still counts
            step = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
        torch.cuda.empty_cache()

    tuned = [{"key": [_block_m(m), SHAPES[name][0], SHAPES[name][1]], "shape": name, "M": m, "config": str(cfg),
              **dataclasses.asdict(cfg), "layout": layout} for (name, m), (cfg, _, _, layout) in best.items()]
    result = {
        "what": "u12_linear vs cuBLAS bf16 x @ W.T, Llama-3.1-8B linear shapes, N(0, 0.02) weights",
        "timing": "median replay of a CUDA graph of one call per distinct copy of the weight (about 2 GB of bf16 "
                  "copies, at least 2), divided by the copies" if args.graph else
                  "triton.testing.do_bench, L2 flushed before each call, median; cuBLAS warmup 10 ms, rep 40 ms; "
                  "u12 configs warmup 5 ms, rep 20 ms",
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "sweep_seconds": sweep_s, "total_seconds": time.monotonic() - t0,
        "rows": rows, "tuned": tuned, "whole_step": step, "sweep": sweep,
    }
    out = write_result(result, args.out, "u12_linear", gpu)
    print_sweep_summary(gpu, out, sweep, sweep_s)
    for s in step:
        print(f"whole step M={s['M']}: cuBLAS {s['cublas_ms']:.2f} ms, u12 {s['u12_ms']:.2f} ms, {s['speedup']:.2f}x"
              if "M" in s else f"whole step: {s['error']}")
    print(f"{'shape':<8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} {'u12 us':>8} {'TB/s':>6} {'speedup':>8} {'default':>8}  best config")
    for r in rows:
        d = f"{r['cublas_us'] / r['default_us']:.2f}x" if r["default_us"] else "-"
        print(f"{r['name']:<8} {r['M']:>3} {r['cublas_us']:>10.1f} {r['cublas_tb_s']:>6.2f} {r['u12_us']:>8.1f} "
              f"{r['u12_tb_s']:>6.2f} {r['speedup']:>7.2f}x {d:>8}  {r['config']}")


if __name__ == "__main__":
    main()
