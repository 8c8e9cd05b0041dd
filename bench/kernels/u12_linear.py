"""u12_linear against cuBLAS bf16 (x @ W.T) at Llama-3.1-8B's linear shapes, on one GPU: the sweeps
that fill kernels/u12/dispatch.py's TUNED and TUNED_TILES.

Sweep: for each shape and M (default 1, 4, 16, 64), random N(0, 0.02) bf16 weights; the default
config first, then the sweeps `--kernels` names crossed with their splits: the tile kernel's
SWEEP_GEMV (M <= 4) or SWEEP_DOT (M >= 16) with SPLIT_KS, gemv2's SWEEP_GEMV2 (M <= 4, those
within 64 accumulator registers a thread), the mma kernel's SWEEP_MMA with SPLIT_KS_MMA (from
TENSOR_CORE_ROWS rows), the hmma kernel's SWEEP_HMMA with SPLIT_KS_HMMA (TENSOR_CORE_ROWS..16 rows;
past 16, its 32-row programs and TUNED_TILES' tile at half, once and twice its splits), "tuned":
TUNED_TILES' config from TENSOR_CORE_ROWS rows to the hmma kernel's 64. Each config is first
checked against the reference (bench/kernels/sweep.py's check_close), then timed with
triton.testing.do_bench (CUDA events, L2 flushed before each call, median), or with `--graph` as
the median replay of a CUDA graph of one call per distinct copy of the weight (about 2 GB of
copies: no host launch overhead, no L2 reuse). `--layouts rows,tiles` runs every config on the
weight in each layout (U12Tensor.layout), each layout's default first. A config that fails to
compile, run or match is recorded with its error; past the time budget the rest are skipped.

Whole step (M 1 and 16): the 32 layers' qkv, o, gate_up and down linears plus lm_head (distinct
random weights, 15 GB in bf16) back to back in one CUDA graph, cuBLAS against u12_linear at the
sweep's best config per shape: the linears' weight traffic of an AR step, nothing else.

Writes bench/results/u12_linear_<gpu>[_<tag>].json through the harness: records (the best config
per shape and M: what specpilot/cost and bench/readme_tables read), "tuned" (those configs as
TUNED's keys, for bench/steps/step_ab.py --u12-tuned), "sweep" (every row), "whole_step".

    python -m bench.kernels.u12_linear [--ms 1,4] [--kernels tile,gemv2,mma,hmma,tuned] [--graph]
        [--layouts rows,tiles] [--budget-s 150] [--no-step] [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time

import torch

from bench import shapes
from bench.kernels.sweep import check_close, print_sweep_summary
from specpilot.bench import harness
from specpilot.kernels.tuning import nearest_tuned
from specpilot.kernels.u12 import TENSOR_CORE_ROWS, TUNED_TILES, U12Config, default_config
from specpilot.kernels.u12.epilogue import block_m
from specpilot.kernels.u12.gemv2 import gemv2_acc_registers
from specpilot.kernels.u12.hmma import MAX_M
from specpilot.kernels.u12.tile import tile_config

SHAPES = shapes.layer_linears(shapes.LLAMA_8B)  # name: (N, K)
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")
LAYERS = shapes.config(shapes.LLAMA_8B)["num_hidden_layers"]
MS = (1, 4, 16, 64)
STEP_MS = (1, 16)
SIGMA = 0.02

# The tile kernel's sweep, crossed with SPLIT_KS; the GEMV tiles keep the [BM, BN, 4 BW] fp32
# accumulator within 64 registers a thread at BM = 4 (16 at BM = 1).
SWEEP_GEMV = [
    U12Config(8, 64, num_warps=4), U12Config(16, 32, num_warps=4), U12Config(16, 64, num_warps=8),
    U12Config(4, 128, num_warps=4), U12Config(32, 32, num_warps=8), U12Config(8, 64, num_warps=4, num_stages=3),
]
SWEEP_DOT = [
    U12Config(64, 16, num_warps=4), U12Config(64, 32, num_warps=4), U12Config(128, 16, num_warps=8),
    U12Config(128, 32, num_warps=8), U12Config(64, 32, num_warps=4, num_stages=3),
]
SPLIT_KS = (1, 2, 4, 8)
# gemv2 (M <= 4), kept within 64 accumulator registers a thread at the row's M (gemv2_acc_registers);
# grouped by the words a thread decodes a chunk
SWEEP_GEMV2 = [
    U12Config(bn, bw, num_warps=w, num_stages=1, kernel="gemv2") for bn, bw, w in (
        (8, 256, 2), (16, 256, 4), (16, 128, 2), (32, 128, 4), (32, 256, 8), (32, 64, 2),  # 32 words
        (4, 256, 2), (8, 256, 4), (8, 128, 2), (16, 128, 4), (16, 256, 8), (16, 64, 2),  # 16 words
        (32, 64, 4), (32, 128, 8),
        (4, 128, 2), (4, 256, 4), (8, 128, 4), (8, 256, 8), (16, 64, 4), (32, 32, 4),  # 8 words
        (4, 128, 4), (8, 64, 4),  # 4 words
        (4, 256, 1), (8, 128, 1), (4, 128, 1), (2, 256, 1),  # one warp a program: 32, 32, 16, 16 words
    )
] + [
    U12Config(16, 256, num_warps=4, num_stages=3, kernel="gemv2"),
    U12Config(8, 256, num_warps=4, num_stages=3, kernel="gemv2"),
]
# the mma kernel from TENSOR_CORE_ROWS rows, crossed with SPLIT_KS_MMA: block_n >= 64 (a warp group's
# wgmma), no loop spills at BLOCK_M 16, 32 or 64 (sm_90, Triton 3.6)
SWEEP_MMA = [
    U12Config(bn, bw, num_warps=w, num_stages=s, kernel="mma") for bn, bw, w, s in (
        (64, 16, 4, 3), (64, 16, 4, 4), (64, 32, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3),
        (128, 16, 4, 3), (128, 16, 4, 4), (128, 16, 8, 3), (128, 32, 4, 2), (128, 32, 4, 3), (128, 32, 8, 3),
        (128, 32, 8, 4), (128, 64, 8, 2), (128, 64, 8, 3),
        (256, 16, 4, 3), (256, 16, 8, 3), (256, 16, 8, 4), (256, 32, 8, 2), (256, 32, 8, 3),
    )
]
SPLIT_KS_MMA = (1, 2, 4)
# the hmma kernel at TENSOR_CORE_ROWS..16 rows, crossed with SPLIT_KS_HMMA: one or two m-tiles a warp,
# 1 to 4 warps, chunks of 16 to 64 words a row, register budgets
SWEEP_HMMA = [
    U12Config(bn, bw, num_warps=w, num_stages=1, kernel="hmma", maxnreg=r) for bn, bw, w, r in (
        (16, 16, 1, 0), (64, 16, 4, 0), (64, 32, 4, 0), (16, 64, 1, 0), (32, 64, 2, 0), (64, 64, 4, 0),  # 1 m-tile
        (16, 64, 1, 168), (32, 64, 2, 168), (64, 64, 4, 168), (64, 32, 4, 128),
        (64, 32, 4, 168),
        (32, 16, 1, 0), (64, 16, 2, 0), (32, 64, 1, 0), (64, 64, 2, 0), (32, 64, 1, 200), (64, 64, 2, 200),  # 2
        (64, 32, 2, 128), (128, 32, 4, 128), (128, 32, 4, 168),
        (64, 32, 4, 96), (64, 32, 4, 80),  # 5 and 6 programs an SM (sm_90 ptxas, triton 3.6: no spill at either)
    )
]
SPLIT_KS_HMMA = (1, 2, 4, 8)


def sweep_configs(m: int, n: int, k: int, kernels: tuple[str, ...] = ("tile", "gemv2"), layout: str = "rows") -> list:
    """The default config for a weight in `layout` first, then each sweep tile crossed with SPLIT_KS
    (splits that fit K), for M <= 4 the gemv2 configs whose accumulator fits 64 registers a thread,
    from TENSOR_CORE_ROWS (3) rows up the mma configs crossed with SPLIT_KS_MMA, and up to 16 rows the
    hmma configs crossed with SPLIT_KS_HMMA, then the tile kernel's default with the one-weight-per-op
    decode (what the pair decode saves). `kernels` picks the sweeps (the default config always runs);
    "tuned" adds TUNED_TILES' hmma config from TENSOR_CORE_ROWS rows to the hmma kernel's MAX_M, past
    TILES_MAX_ROWS too (32-row programs side by side)."""
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
        out += [cfg for cfg in SWEEP_GEMV2 if cfg not in out and gemv2_acc_registers(cfg, block_m(m)) <= 64]
    if m >= TENSOR_CORE_ROWS and "mma" in kernels:
        add_splits(SWEEP_MMA, SPLIT_KS_MMA)
    if TENSOR_CORE_ROWS <= m <= 16 and "hmma" in kernels:
        add_splits(SWEEP_HMMA, SPLIT_KS_HMMA)
    if 16 < m <= MAX_M and "hmma" in kernels:  # 32-row programs (a warp one m-tile) that
        # keep 128 registers (168 at 64 words a chunk) for the 4 n-tiles' accumulators, and TUNED_TILES'
        # tile at half, once and twice its splits
        add_splits([c for c in SWEEP_HMMA if c.block_n == 16 * c.num_warps and c.block_w >= 32
                    and c.maxnreg == (128 if c.block_w == 32 else 168)], SPLIT_KS_HMMA)
        if tuned is not None:
            add_splits([dataclasses.replace(tuned, split_k=1)], sorted({1, tuned.split_k // 2, tuned.split_k,
                                                                       2 * tuned.split_k} - {0}))
    tile_default = default if default.kernel == "tile" else tile_config(m, n, k, on_gpu=True)
    return out + ([dataclasses.replace(tile_default, decode="single")] if "tile" in kernels else [])


def whole_step(best: dict, gen: torch.Generator) -> list[dict]:
    """The 32 layers' linears + lm_head in one CUDA graph, cuBLAS bf16 vs u12 (best: (config, layout) by
    (shape, M); each M's weights in its best layouts)."""
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.u12 import u12_linear

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
        cublas_ms, u12_ms = harness.time_graph(bf16).median_ms, harness.time_graph(u12).median_ms
        out.append({
            "what": "32 layers' qkv/o/gate_up/down + lm_head linears of Llama-3.1-8B in one CUDA graph "
                    "(no attention, norms or activations): the whole-AR-step proxy",
            "M": m, "cublas_ms": cublas_ms, "u12_ms": u12_ms, "speedup": cublas_ms / u12_ms,
            "bf16_weight_gb": sum(w.numel() * 2 for _, w, _ in weights) / 1e9,
            "u12_weight_gb": sum(t.nbytes for _, _, t in weights) / 1e9,
        })
    return out


def graph_us(fns) -> float:
    """µs of one replay of a CUDA graph running fns in order (median of 20)."""
    return harness.time_graph(fns).median_ms * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(parser, smoke=False)
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
    args = parser.parse_args(argv)
    layouts = tuple(args.layouts.split(","))
    if not set(layouts) <= {"rows", "tiles"}:
        parser.error(f"--layouts: expected rows and/or tiles, got {args.layouts!r}")
    if reason := harness.refuse_device("bench.kernels.u12_linear", smoke=False):
        print(reason, file=sys.stderr)
        return 2

    from triton.testing import do_bench

    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.u12 import u12_linear, u12_linear_reference

    t0 = time.monotonic()
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
                t_cublas = graph_us([lambda x=x, w=wc: x @ w.T for wc, _ in copies]) / len(copies)
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
                        us = graph_us([lambda x=x, t=tc, c=cfg: u12_linear(x, t, c) for tc in wcopies]) / len(copies)
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

    tuned = [{"key": [block_m(m), SHAPES[name][0], SHAPES[name][1]], "shape": name, "M": m, "config": str(cfg),
              **dataclasses.asdict(cfg), "layout": layout} for (name, m), (cfg, _, _, layout) in best.items()]
    timing = ("median replay of a CUDA graph of one call per distinct copy of the weight (about 2 GB of bf16 "
              "copies, at least 2), divided by the copies" if args.graph else
              "triton.testing.do_bench, L2 flushed before each call, median; cuBLAS warmup 10 ms, rep 40 ms; "
              "u12 configs warmup 5 ms, rep 20 ms")
    out = harness.write_run(args, "u12_linear", "cuda", rows, timing=timing, sweep_seconds=sweep_s,
                            total_seconds=time.monotonic() - t0, tuned=tuned, whole_step=step, sweep=sweep)
    print_sweep_summary(harness.device_name("cuda"), out, sweep, sweep_s)
    for s in step:
        print(f"whole step M={s['M']}: cuBLAS {s['cublas_ms']:.2f} ms, u12 {s['u12_ms']:.2f} ms, {s['speedup']:.2f}x"
              if "M" in s else f"whole step: {s['error']}")
    print(f"{'shape':<8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} {'u12 us':>8} {'TB/s':>6} {'speedup':>8} {'default':>8}  best config")
    for r in rows:
        d = f"{r['cublas_us'] / r['default_us']:.2f}x" if r["default_us"] else "-"
        print(f"{r['name']:<8} {r['M']:>3} {r['cublas_us']:>10.1f} {r['cublas_tb_s']:>6.2f} {r['u12_us']:>8.1f} "
              f"{r['u12_tb_s']:>6.2f} {r['speedup']:>7.2f}x {d:>8}  {r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
