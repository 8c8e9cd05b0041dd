"""One launch of each Llama-3.1-8B layer linear, for Nsight Compute to read the hardware counters of.

    ncu --clock-control none --nvtx --nvtx-include measure/ \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section LaunchStats --section Occupancy python -m bench.kernels.linear_ncu [--ms 1,16] [--u12] [--layout tiles]

For each M in --ms: fused_linear (its TUNED config) on qkv (with the norm prologue, its sums of
squares from RowSquares at more than one row, as the runtime hands them on), o (residual
epilogue), gate_up (norm, SiLU·mul) and down (residual), then cuBLAS on the same four weights;
with --u12 also the u12 kernels the fused stacks run on those weights packed (runtime/fused.py: at
one row u12_fused_linear with the SiLU·mul and residual epilogues and the norms apart, at more
u12_linear's TUNED kernel).
Random N(0, 0.02) bf16 weights, x ~ N(0, 1). Each call runs once after a warm-up (compiles), and
ncu replays and times each kernel on its own, caches flushed (its default), so the counters
describe one cold launch. bench/run_gpu.sh's `ncu` group runs this under ncu and keeps the report
(no results file of its own: ncu writes the report).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.kernels.fused_linear import SHAPES  # name -> (N, K, norm, gated, residual)
from specpilot.bench import harness


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--u12", action="store_true", help="also the u12 kernels on the packed weights")
    ap.add_argument("--layout", choices=("rows", "tiles"), default="rows",
                    help="the packed weights' U12Tensor.layout (tiles: TUNED_TILES' configs at more than one row)")
    args = ap.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.linear_ncu (launches CUDA kernels for ncu)", smoke=False):
        print(reason, file=sys.stderr)
        return 2
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.fused_linear import RowSquares, fused_linear
    from specpilot.kernels.u12 import u12_fused_linear, u12_linear

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {name: (torch.randn(n, k, device=dev, generator=g) * 0.02).to(dt) for name, (n, k, *_) in SHAPES.items()}
    hidden = SHAPES["o"][0]
    norm_w = 1 + 0.1 * torch.randn(hidden, device=dev, generator=g).to(dt)
    packed = {name: pack_u12(w, layout=args.layout) for name, w in weights.items()} if args.u12 else {}
    for m in (int(v) for v in args.ms.split(",")):
        calls = []
        for name, (n, k, norm, gated, residual) in SHAPES.items():
            x = torch.randn(m, k, device=dev, generator=g).to(dt)
            n_out = n // 2 if gated else n
            res = torch.randn(m, n_out, device=dev, generator=g).to(dt) if residual else None
            squares = None
            if norm and m > 1:
                squares = RowSquares.of(x, 64)  # o's and down's epilogues leave hidden / 64 parts
            elif residual and m > 1:
                squares = RowSquares()

            def call(x=x, w=weights[name], norm=norm, gated=gated, res=res, squares=squares):
                fused_linear(x, w, norm_weight=norm_w if norm else None, gated=gated, residual=res, squares=squares)

            calls.append(call)
            calls.append(lambda x=x, w=weights[name]: torch.matmul(x, w.T))
            if name in packed and m == 1:
                calls.append(lambda x=x, t=packed[name], gated=gated, res=res:
                             u12_fused_linear(x, t, gated=gated, residual=res))
            elif name in packed:
                calls.append(lambda x=x, t=packed[name]: u12_linear(x, t))
        for call in calls:  # compile and warm up
            call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")  # what ncu --nvtx-include "measure/" profiles
        for call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"M = {m}: {len(calls)} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
