"""fused_linear against the unfused kernels it replaces, at the Llama-3.1-8B decoder shapes, on one GPU.

Rows: for M in 1, 4, 16 and each linear of a layer, random N(0, 0.02) bf16 weights, x ~ N(0, 1),
norm weights 1 + N(0, 0.1): qkv (6144 x 4096) with the norm prologue against the rmsnorm kernel +
cuBLAS; o (4096 x 4096) with the residual epilogue against cuBLAS + a torch add; gate_up
(28672 x 4096) with norm and SiLU·mul against rmsnorm + cuBLAS + the silu_mul kernel; down
(4096 x 14336) with the residual against cuBLAS + add. Every config (the default, then
SWEEP_GEMV below for M <= 4 within 64 accumulator registers a thread, or SWEEP_DOT x SPLIT_KS for
M >= 5) is first checked against fused_linear_reference (check_close) and
then timed by triton.testing.do_bench (L2 flushed before each call, median), or with --graph as
the median replay of a CUDA graph of one call per distinct copy of the weight (about 2 GB of
copies; do_bench's single launches include the host's launch overhead wherever it exceeds the
kernel, as at these shapes at one row). A config that fails
to compile, run or match is recorded with its error, not timed; past the time budget the rest of
the sweep but the default configs is marked skipped.

Layer: per M, the four fused calls for 32 layers' distinct weights (14 GB) back to back in one
CUDA graph, against the unfused sequence the runtime runs there (rmsnorm with the residual add,
cuBLAS qkv, cuBLAS o, rmsnorm with the residual add, cuBLAS gate_up, silu_mul, cuBLAS down), also
in one graph; no attention or RoPE (the same in both). The figure that decides whether the runtime
uses fused_linear. Fused calls use the sweep's best config per (shape, M).

Writes bench/results/fused_linear_<gpu>[_<tag>].json through the harness: records (the best config
per shape and M), "sweep" (every row), "tuned" (the best configs as kernels/fused_linear.py's TUNED
keys, for bench/steps/step_ab.py --bf16-tuned), "layer"; prints a short table last. --smoke runs the
same code on tiny shapes (the CPU under TRITON_INTERPRET=1, wall-clock timing, no graph) to check
the script itself; it writes only where --out says.

    python -m bench.kernels.fused_linear [--budget-s 150] [--ms 1,4,16] [--no-layer] [--graph] [--smoke]
        [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

from bench import shapes as model_shapes
from bench.kernels.sweep import print_sweep_summary
from specpilot.bench import harness
from specpilot.kernels.fused_linear import FusedLinearConfig

LAYER_CALLS = {"qkv": (True, False, False), "o": (False, False, True), "gate_up": (True, True, False),
               "down": (False, False, True)}  # each call's (norm prologue, gated, residual epilogue)
# name: (N weight rows, K, norm prologue, gated, residual epilogue), Llama-3.1-8B's
SHAPES = {name: (*model_shapes.layer_linears(model_shapes.LLAMA_8B)[name], *flags) for name, flags in LAYER_CALLS.items()}
SMOKE_SHAPES = {"qkv": (48, 32, True, False, False), "o": (32, 48, False, False, True),  # o's key apart from down's
                "gate_up": (64, 32, True, True, False), "down": (32, 32, False, False, True)}
MS = (1, 4, 16)
LAYERS = model_shapes.config(model_shapes.LLAMA_8B)["num_hidden_layers"]
SIGMA = 0.02
EPS = 1e-5

# The sweep: gemv tiles (kept within 64 accumulator registers a thread at the row's M), dot tiles
# crossed with SPLIT_KS.
SWEEP_GEMV = [
    FusedLinearConfig("gemv", bn, bk, num_warps=w, num_stages=s) for bn, bk, w, s in (
        (8, 512, 2, 1), (4, 1024, 2, 1), (16, 512, 4, 1), (8, 1024, 4, 1), (16, 256, 2, 1), (32, 256, 4, 1),
        (4, 512, 2, 1), (8, 256, 2, 1), (4, 256, 1, 1), (2, 1024, 2, 1), (8, 512, 4, 1), (16, 1024, 8, 1),
        (8, 512, 2, 3), (4, 1024, 2, 3),
    )
]
SWEEP_DOT = [
    FusedLinearConfig("dot", bn, bk, num_warps=w, num_stages=s) for bn, bk, w, s in (
        (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 6), (32, 128, 4, 4), (128, 128, 8, 3),
        (32, 64, 2, 4), (64, 64, 4, 3), (64, 256, 4, 2), (128, 64, 4, 4), (32, 256, 4, 3),
        # deep pipelines, as cuBLAS runs 16 rows (nvjet 128x24_64x11: 11 stages of 64-wide K chunks)
        (64, 64, 4, 8), (128, 64, 4, 6), (64, 128, 4, 5), (128, 64, 8, 6),
    )
]
SPLIT_KS = (1, 2, 4, 8)



def error_bound(x, w, nw, gated, residual_out):
    """Per-output bound on |fused - reference| from fp32 sums of another order: one bf16 step
    (2^-7 relative) of each rounded value plus 2^-16 of Σ|x'||w| (typical is sqrt(K) 2^-24 of it),
    carried through SiLU·mul to first order (|silu'| < 1.1) and the residual add."""
    from specpilot.kernels.rmsnorm import rmsnorm_reference

    h = (rmsnorm_reference(x, nw, EPS) if nw is not None else x).float()
    lin = h @ w.float().T
    scale = h.abs() @ w.float().abs().T
    err = 2**-7 * lin.abs() + 2**-16 * scale
    if gated:
        i = w.shape[0] // 2
        g, u, eg, eu = lin[:, :i], lin[:, i:], err[:, :i], err[:, i:]
        silu = torch.nn.functional.silu(g)
        lin, err = silu * u, 1.1 * eg * u.abs() + silu.abs() * eu + 2**-7 * (silu * u).abs()
    if residual_out is not None:
        err = err + 2**-7 * residual_out.float().abs()
    return err


def check_close(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    bad = (y.float() - ref.float()).abs() > bound
    if bad.any() or not torch.isfinite(y).all():
        raise AssertionError(f"differs from the reference at {int(bad.sum())} of {y.numel()} outputs")


def sweep_configs(m: int, n: int, k: int, gated: bool, smoke: bool) -> list:
    """The default config first; then for M <= 4 SWEEP_GEMV within 64 accumulator registers a
    thread, each also at 128 registers (maxnreg); for M >= 5, or K >= 8192, SWEEP_DOT x SPLIT_KS (at least two K tiles a split). --smoke: two."""
    from specpilot.kernels import fused_linear as fl

    default = fl.default_config(m, n, k, gated, on_gpu=torch.cuda.is_available() and not smoke)
    out = [default]
    if smoke:
        return out + [fl.FusedLinearConfig("dot", 16, 16, split_k=2) if m <= 4 else fl.FusedLinearConfig("gemv", 4, 16)]
    if m <= 4:
        gemv = [c for c in SWEEP_GEMV if fl.gemv_acc_registers(c, fl.m_bucket(m), gated) <= 64]
        out += [c for c in gemv if c not in out]
        out += [c for c in (dataclasses.replace(c, maxnreg=128) for c in gemv) if c not in out]  # TUNED's o and down budget
    # the dot tiles at every M: their split-K is the only one (the GEMV has none), which a long K
    # such as down's (14336) may need at M = 1 as well (cuBLAS splits it)
    if m >= 5 or k >= 8192:
        for tile in SWEEP_DOT:
            for split in SPLIT_KS:
                cfg = fl.FusedLinearConfig("dot", tile.block_n, tile.block_k, split_k=split,
                                           num_warps=tile.num_warps, num_stages=tile.num_stages)
                if (split == 1 or k // tile.block_k >= 2 * split) and cfg not in out:
                    out.append(cfg)
    return out


class Timer:
    """Median ms of fn: do_bench on a GPU; on the CPU (smoke runs only) the wall clock of one call."""

    def __init__(self, cuda: bool, warmup: int, rep: int) -> None:
        self.cuda, self.warmup, self.rep = cuda, warmup, rep

    def __call__(self, fn) -> float:
        if self.cuda:
            from triton.testing import do_bench

            return do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median")
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def unfused(name: str, x, w, nw, r):
    """The kernels fused_linear replaces for one shape (a callable, no arguments)."""
    from specpilot.kernels.rmsnorm import rmsnorm
    from specpilot.kernels.silu_mul import silu_mul

    if name == "qkv":
        return lambda: rmsnorm(x, nw, EPS) @ w.T
    if name == "gate_up":
        return lambda: silu_mul(rmsnorm(x, nw, EPS) @ w.T)
    return lambda: r.add_(x @ w.T)  # o, down: cuBLAS + a torch add


def time_graph(fns, cuda: bool) -> float:
    """Median ms of one replay of a CUDA graph running fns in order (warmed up first: compiles,
    split-K counters outside the capture); on the CPU, of running them once (smoke runs)."""
    return harness.time_graph(fns, repeats=20 if cuda else 1, warmup=3 if cuda else 0, cuda=cuda).median_ms


def layer_rows(shapes: dict, ms, best: dict, device: str, gen: torch.Generator, layers: int) -> list[dict]:
    """The four fused calls for `layers` layers' weights in one graph against the unfused sequence."""
    from specpilot.kernels.fused_linear import RowSquares, fused_linear
    from specpilot.kernels.rmsnorm import rmsnorm
    from specpilot.kernels.silu_mul import silu_mul

    hidden = shapes["o"][0]
    weights = []
    for _ in range(layers):
        ws = {name: (torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16)
              for name, (n, k, *_) in shapes.items()}
        ws["norm1"], ws["norm2"] = ((1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16)
                                    for _ in range(2))
        weights.append(ws)
    cuda = device == "cuda"
    out = []
    for m in ms:
        x_o = torch.randn(m, shapes["o"][1], device=device, generator=gen).to(torch.bfloat16)  # attention's output
        stream = torch.randn(m, hidden, device=device, generator=gen).to(torch.bfloat16)
        cfg = {name: best.get((name, m)) for name in shapes}

        def fused_layer(ws, x_o=x_o, stream=stream, cfg=cfg, sq=None):  # sq: RowSquares carried, as the runtime
            fused_linear(stream, ws["qkv"], norm_weight=ws["norm1"], eps=EPS, config=cfg["qkv"], squares=sq)
            fused_linear(x_o, ws["o"], residual=stream, config=cfg["o"], squares=sq)
            act = fused_linear(stream, ws["gate_up"], norm_weight=ws["norm2"], eps=EPS, gated=True,
                               config=cfg["gate_up"], squares=sq)
            fused_linear(act, ws["down"], residual=stream, config=cfg["down"], squares=sq)

        state = {"out": torch.zeros_like(stream), "residual": stream.clone()}

        def unfused_layer(ws, x_o=x_o, state=state):  # the runtime's unfused order (runtime/fused.py)
            h, res = rmsnorm(state["out"], ws["norm1"], EPS, residual=state["residual"])
            h @ ws["qkv"].T
            o = x_o @ ws["o"].T
            h, res = rmsnorm(o, ws["norm2"], EPS, residual=res)
            state["out"] = silu_mul(h @ ws["gate_up"].T) @ ws["down"].T
            state["residual"] = res

        sq = RowSquares()
        fused_ms = time_graph([lambda ws=ws: fused_layer(ws, sq=sq) for ws in weights], cuda)
        no_squares_ms = time_graph([lambda ws=ws: fused_layer(ws) for ws in weights], cuda)
        unfused_ms = time_graph([lambda ws=ws: unfused_layer(ws) for ws in weights], cuda)
        out.append({
            "what": f"{layers} layers' qkv (norm), o (+residual), gate_up (norm, SiLU·mul), down (+residual) in one "
                    "CUDA graph, fused_linear against rmsnorm(+add) / cuBLAS / silu_mul; no attention or RoPE; "
                    "fused: the norms' sums of squares carried from the residual epilogues (RowSquares, as "
                    "runtime/fused.py), fused_no_squares: each norm prologue reading x",
            "M": m, "layers": layers, "fused_ms": fused_ms, "fused_no_squares_ms": no_squares_ms,
            "unfused_ms": unfused_ms, "speedup": unfused_ms / fused_ms,
            "configs": {name: str(c) if c else "default" for name, c in cfg.items()},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(parser)
    parser.add_argument("--budget-s", type=float, default=150.0, help="sweep time budget; later rows are skipped")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x, comma-separated")
    parser.add_argument("--no-layer", action="store_true", help="skip the 32-layer CUDA graphs")
    parser.add_argument("--graph", action="store_true",
                        help="time each config in a CUDA graph over distinct copies of the weight (no host "
                             "launch overhead; about 2 GB of copies) instead of do_bench")
    args = parser.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.fused_linear", args.smoke):
        print(reason, file=sys.stderr)
        return 2
    cuda = not args.smoke

    from specpilot.kernels.fused_linear import RowSquares, fused_linear, fused_linear_reference, m_bucket

    t0 = time.monotonic()
    device = "cuda" if cuda else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    ms = [int(v) for v in args.ms.split(",")] if not args.smoke else [1, 5]
    gen = torch.Generator(device=device).manual_seed(0)
    timer = Timer(cuda, warmup=10, rep=40)
    config_timer = Timer(cuda, warmup=5, rep=20)
    if cuda:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        Timer(True, 200, 200)(lambda a=a: a @ a)  # clocks up from idle before the first timing
        del a

    sweep, rows, best = [], [], {}
    for name, (n, k, norm, gated, residual) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device=device, generator=gen)).to(torch.bfloat16) if norm else None
        n_out = n // 2 if gated else n
        copies = [w]  # --graph: distinct weights, about 2 GB, at least 2
        while args.graph and cuda and len(copies) < max(2, min(LAYERS, int(2e9 // (2 * n * k)))):
            copies.append((torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16))
        graph = len(copies) > 1

        def timed(make, timer=timer):  # make(w) -> a call on weight w: ms a call
            if graph:
                return time_graph([make(wc) for wc in copies], cuda) / len(copies)
            return timer(make(w))

        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            r = torch.randn(m, n_out, device=device, generator=gen).to(torch.bfloat16) if residual else None
            ref = fused_linear_reference(x, w, norm_weight=nw, eps=EPS, gated=gated,
                                         residual=None if r is None else r.clone())
            bound = error_bound(x, w, nw, gated, ref if residual else None)
            r_time = None if r is None else r.clone()  # accumulates while timed; never checked
            unfused_us = timed(lambda wc, x=x, r=r_time: unfused(name, x, wc, nw, r)) * 1e3
            cublas_us = timed(lambda wc, x=x: lambda: x @ wc.T) * 1e3
            # A norm row's dot configs read their sums of squares as the runtime's do (RowSquares from
            # the residual epilogue before them; here computed by torch, in K / 64 parts).
            sq = RowSquares.of(x, k // 64) if norm and k % 64 == 0 else None
            base = {"name": name, "N": n, "K": k, "M": m, "norm": norm, "gated": gated, "residual": residual,
                    "unfused_us": unfused_us, "cublas_us": cublas_us}
            for i, cfg in enumerate(sweep_configs(m, n, k, gated, args.smoke)):
                row = {**base, "config": str(cfg), "default": i == 0, "squares": sq is not None and cfg.kernel == "dot"}
                if i > 0 and time.monotonic() - t0 > args.budget_s:  # the default always runs: every row has one
                    sweep.append({**row, "skipped": "time budget"})
                    continue
                run = lambda rr, x=x, w=w, nw=nw, cfg=cfg: fused_linear(  # noqa: E731
                    x, w, norm_weight=nw, eps=EPS, gated=gated, residual=rr, config=cfg, squares=sq)
                try:
                    y = run(None if r is None else r.clone())
                    check_close(y, ref, bound)
                    us = timed(lambda wc, x=x, cfg=cfg: lambda: fused_linear(
                        x, wc, norm_weight=nw, eps=EPS, gated=gated, residual=r_time, config=cfg, squares=sq),
                        config_timer) * 1e3
                except Exception as e:  # a config that does not compile, run or match: recorded, not fatal
                    sweep.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                exact = float((y != ref).float().mean())
                sweep.append({**row, "us": us, "speedup_vs_unfused": unfused_us / us, "speedup_vs_cublas": cublas_us / us,
                              "fraction_differing_from_reference": exact})
                if (name, m) not in best or us < best[(name, m)][1]:
                    best[(name, m)] = (cfg, us)
            if (name, m) in best:
                cfg, us = best[(name, m)]
                default = next((s for s in sweep if s["name"] == name and s["M"] == m and s["default"]), {})
                rows.append({**base, "fused_us": us, "speedup_vs_unfused": unfused_us / us,
                             "speedup_vs_cublas": cublas_us / us, "weight_tb_s": 2 * n * k / us / 1e6,
                             "config": str(cfg), "default_config": default.get("config"), "default_us": default.get("us")})
        del w, copies
        if cuda:
            torch.cuda.empty_cache()
    sweep_s = time.monotonic() - t0

    layer = []
    if not args.no_layer:
        try:
            layer = layer_rows(shapes, ms, {key: v[0] for key, v in best.items()}, device, gen, 2 if args.smoke else LAYERS)
        except Exception as e:  # e.g. out of memory on a smaller GPU: the rows still count
            layer = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
        if cuda:
            torch.cuda.empty_cache()

    tuned = [{"key": [m_bucket(m), shapes[name][0], shapes[name][1], shapes[name][3]], "shape": name, "M": m,
              "config": str(cfg), **{f: getattr(cfg, f) for f in ("kernel", "block_n", "block_k", "block_m", "split_k",
                                                                  "num_warps", "num_stages", "maxnreg")}}
             for (name, m), (cfg, _) in best.items()]
    timing = ("median replay of a CUDA graph of one call per distinct copy of the weight (about 2 GB, at least 2), "
              "divided by the copies" if args.graph else
              "triton.testing.do_bench, L2 flushed before each call, median; baselines warmup 10 ms, rep 40 ms; "
              "fused configs warmup 5 ms, rep 20 ms") + "; layer: CUDA graph replays, median of 20"
    out = harness.write_run(args, "fused_linear", device, rows, timing=timing, sweep_seconds=sweep_s,
                            total_seconds=time.monotonic() - t0, tuned=tuned, layer=layer, sweep=sweep)
    print_sweep_summary(harness.device_name(device), out, sweep, sweep_s)
    for s in layer:
        print(f"layer x{s['layers']} M={s['M']}: unfused {s['unfused_ms']:.2f} ms, fused {s['fused_ms']:.2f} ms "
              f"({s['fused_no_squares_ms']:.2f} without squares), {s['speedup']:.2f}x" if "M" in s else f"layer: {s['error']}")
    print(f"{'shape':<8} {'M':>3} {'unfused us':>11} {'cuBLAS us':>10} {'fused us':>9} {'vs unfused':>11} {'default':>8}  best config")
    for s in rows:
        d = f"{s['unfused_us'] / s['default_us']:.2f}x" if s["default_us"] else "-"
        print(f"{s['name']:<8} {s['M']:>3} {s['unfused_us']:>11.1f} {s['cublas_us']:>10.1f} {s['fused_us']:>9.1f} "
              f"{s['speedup_vs_unfused']:>10.2f}x {d:>8}  {s['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
