"""Where the hmma kernel's time goes at M = 16 beyond what reading its bytes takes, per Llama-3.1-8B shape.

Kernels that only read o's u12 bytes take 10.2 µs at their best grid on an H100 (11.6 at the tuned
kernel's 16 warps an SM: bench/results/read_bound_h100.json), where the hmma kernel takes 16.0. Per
shape, on tiled weights, TUNED_TILES' config, each timed as a CUDA graph of one call per distinct
weight copy of about 2 GB (median replay, min of two):

  tuned          the config as it is, on N(0, 0.02) weights (escapes about 1.5e-4 of them);
  tuned-noesc    the same on the same weights with every magnitude under 2^-17 raised to it: no
                 escapes (checked), so the difference is what the escape walk costs;
  twin           a split-K config's programs without the split: the shape (N · S, K / S) at split 1,
                 the same grid, tile and loop, no partials, semaphore or serial sum;
  twin-noesc     the twin without escapes: the loop, its decode and MMAs, and one store;
  read-grid      bench/kernels/read_bound.py's register-load kernel over the same bytes with the tuned
                 grid's programs and warps (one chunk of 16 bytes a thread in flight, and two);
  read-best      its fastest config (8 programs of 8 warps an SM).

So tuned - tuned-noesc is the escapes, tuned - twin the split-K sum, twin-noesc - read-grid the loop's
decode and MMAs beyond its loads. Writes bench/results/hmma_parts_<gpu>[_<tag>].json through the
harness, prints a line a shape.

    python -m bench.kernels.hmma_parts [--shapes o,down,qkv,gate_up] [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import torch

from bench import shapes as model_shapes
from bench.kernels import read_bound
from specpilot.bench import harness

SHAPES = model_shapes.layer_linears(model_shapes.LLAMA_8B)
FLOOR = 2.0**-17  # magnitudes below it raised to it: inside every base's 15-exponent window here


def without_escapes(w: torch.Tensor) -> torch.Tensor:
    """w with every magnitude under FLOOR (zeros included) raised to FLOOR, its sign kept."""
    sign = torch.where(w < 0, -1.0, 1.0)
    return torch.where(w.float().abs() < FLOOR, sign * FLOOR, w.float()).to(torch.bfloat16)


def graph_us(calls, copies: int) -> float:
    """µs a call: the min of two median replays of a CUDA graph of `calls` (one a weight copy)."""
    return min(harness.time_graph(calls).median_ms, harness.time_graph(calls).median_ms) * 1e3 / copies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap, smoke=False)
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    args = ap.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.hmma_parts", smoke=False):
        print(reason, file=sys.stderr)
        return 2
    from specpilot.formats.u12 import pack_u12, unpack_u12
    from specpilot.kernels.u12 import TUNED_TILES, u12_linear

    names = [s for s in args.shapes.split(",") if s]
    for s in names:
        if s not in SHAPES or s == "lm_head":
            sys.exit(f"--shapes: {s!r} is not one of qkv, o, gate_up, down")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def save():
        return harness.write_run(args, "hmma_parts", "cuda", rows,
                                 timing="us a call: median replay of a CUDA graph of one call per distinct copy "
                                        "(about 2 GB), min of two")

    for name in names:
        n, k = SHAPES[name]
        cfg = TUNED_TILES[(16, n, k)]
        s = cfg.split_k
        copies = max(2, int(2e9 // (n * k * 2)))
        x = torch.randn(16, k, device="cuda", generator=gen).to(torch.bfloat16)
        xt = x.view(16, s, k // s)[:, 0].contiguous()  # the twin's x: any K / S columns
        us, escapes = {}, {}
        cases = {"tuned": (n, k, cfg, False), "tuned-noesc": (n, k, cfg, True)}
        if s > 1:
            twin = dataclasses.replace(cfg, split_k=1)
            cases.update({"twin": (n * s, k // s, twin, False), "twin-noesc": (n * s, k // s, twin, True)})
        for label, (nn, kk, c, clean) in cases.items():
            packed = []
            for _ in range(copies):
                w = (torch.randn(nn, kk, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
                packed.append(pack_u12(without_escapes(w) if clean else w, layout="tiles"))
            escapes[label] = int(packed[0].esc_idx.numel())
            if clean and escapes[label]:
                sys.exit(f"{name} {label}: {escapes[label]} escapes left (expected none)")
            xx = x if kk == k else xt
            y = u12_linear(xx, packed[0], c)
            ref = xx.float() @ unpack_u12(packed[0]).float().T
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                sys.exit(f"{name} {label}: relative error {err:.3g} against x · Wᵀ")
            calls = [lambda t=t, c=c, xx=xx: u12_linear(xx, t, c) for t in packed]
            us[label] = graph_us(calls, copies)
            del packed
            torch.cuda.empty_cache()
        # the read kernel over the same bytes (the planes' 1.5 bytes a weight) at the tuned grid and its best
        nbytes = math.ceil(n * k * 1.5 / (16 * 1024)) * 16 * 1024
        grid = (n // cfg.block_n) * s
        bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda", generator=gen)
                for _ in range(copies)]
        reads = {"read-grid-u1": dict(programs=grid, warps=cfg.num_warps, unroll=1),
                 "read-grid-u2": dict(programs=grid, warps=cfg.num_warps, unroll=2),
                 "read-best": dict(programs=8 * sms, warps=8, unroll=2)}
        for label, rc in reads.items():
            outs = [torch.zeros(rc["programs"], dtype=torch.int32, device="cuda") for _ in bufs]
            calls = [read_bound.launcher("lsu", rc, b, o) for b, o in zip(bufs, outs)]
            us[label] = graph_us(calls, copies)
        del bufs
        torch.cuda.empty_cache()
        rows.append(dict(name=name, N=n, K=k, M=16, config=str(cfg), grid=grid, bytes=nbytes, escapes=escapes, us=us))
        print(f"{name:8}" + " ".join(f" {label} {t:.2f}" for label, t in us.items()), flush=True)
        save()
    print("wrote", save())
    return 0


if __name__ == "__main__":
    sys.exit(main())
