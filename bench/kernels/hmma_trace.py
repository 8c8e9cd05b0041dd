"""The hmma kernel's phases at M = 16, from %globaltimer stamps in every program (kernels/u12/hmma.py's TRACE_SLOTS).

bench/kernels/hmma_parts.py has each split-K shape's tail (everything after the main loops) at 3.2-6.5 µs
of a 16-41 µs call. Here each TUNED_TILES config runs on tiled weights in a CUDA graph of one call
per distinct weight copy (about 2 GB, so every call reads HBM), each call with its own stamp
buffer: per program its entry, the end of its loop, the end of its split-K semaphore, and, in the
program that sums, the end of the sum and of the epilogue. Per shape, medians over the calls
(the first two left out), in µs:

  call         first entry to last epilogue stamp (the kernel as its programs see it)
  gap          the previous call's last stamp to this call's first entry (launch, drain, PDL wait)
  entries      first to last entry (programs placed as slots free)
  loop         a program's entry to its loop's end: median and max
  loops_end    the call's first entry to its last loop's end
  sem          in the summing programs, loop end to semaphore passed: median (the last to arrive
               passes at once; the partials' stores, release and acquire are in it)
  sum, finish  in the summing programs: the partials' sum, then the escape walk and epilogue
  tail         the last loop's end to the last epilogue stamp
  by_load      per number of the call's programs on one SM (%smid, slot 5): how many SMs held that
               many, and their programs' median loop and slowest loop end (from the call's first entry)

--pdl runs the calls in a PDL mode (kernels/overlap.py's Launch; the entry stamps come after the
wait); --w4 the layer shapes at 64-row programs of 4 warps, TUNED_TILES' configs before its 32-row ones.

Writes bench/results/hmma_trace_<gpu>[_<tag>].json through the harness and prints a line a shape.

    python -m bench.kernels.hmma_trace [--shapes o,down,qkv,gate_up] [--pdl 0|1|2] [--w4] [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from bench import shapes as model_shapes
from specpilot.bench import harness

SHAPES = model_shapes.layer_linears(model_shapes.LLAMA_8B)


def w4(cfg, n: int):
    """A TUNED_TILES config at 64-row programs of 4 warps (qkv's at 168 registers): the configs before
    the 32-row, 2-warp ones."""
    return dataclasses.replace(cfg, block_n=64, num_warps=4, maxnreg=168 if n == SHAPES["qkv"][0] else 128)


def phases(stamps: torch.Tensor, split_k: int) -> dict:
    """One call's phases (µs) from its stamps ([programs, slots] int64 ns; 0 where not stamped)."""
    s = stamps.double() / 1e3
    entry, loop_end = s[:, 0], s[:, 1]
    summed = s[:, 4] > 0  # the programs that ran the epilogue
    end = s[summed, 4].max()
    out = dict(begin=entry.min().item(), end=end.item(), call=(end - entry.min()).item(),
               entries=(entry.max() - entry.min()).item(),
               loop=(loop_end - entry).median().item(), loop_max=(loop_end - entry).max().item(),
               loops_end=(loop_end.max() - entry.min()).item(), tail=(end - loop_end.max()).item(),
               summing=int(summed.sum()))
    sm = stamps[:, 5]
    load = torch.bincount(sm)[sm]  # each program's SM's count of the call's programs
    loop = loop_end - entry
    out["by_load"] = {int(c): dict(sms=int((torch.bincount(sm) == c).sum()), loop=loop[load == c].median().item(),
                                   loops_end=(loop_end[load == c].max() - entry.min()).item())
                      for c in load.unique().tolist()}
    if split_k > 1:
        out.update(sem=(s[summed, 2] - s[summed, 1]).median().item(),
                   sum=(s[summed, 3] - s[summed, 2]).median().item(),
                   finish=(s[summed, 4] - s[summed, 3]).median().item())
    else:
        out.update(finish=(s[summed, 4] - s[summed, 1]).median().item())
    return out


def summarize(calls: list[dict]) -> dict:
    """Medians over the calls after the first two, with each call's gap to the one before."""
    for before, this in zip(calls, calls[1:]):
        this["gap"] = this["begin"] - before["end"]
    kept = calls[2:]
    keys = [k for k in kept[0] if k not in ("begin", "end", "by_load")]
    out = {k: statistics.median(c[k] for c in kept) for k in keys}
    loads = sorted({c for call in kept for c in call["by_load"]})
    out["by_load"] = {c: {k: statistics.median(call["by_load"][c][k] for call in kept if c in call["by_load"])
                          for k in ("sms", "loop", "loops_end")} for c in loads}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap, smoke=False)
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    ap.add_argument("--pdl", type=int, choices=(0, 1, 2), default=0, help="the calls' PDL mode (kernels/overlap.py)")
    ap.add_argument("--w4", action="store_true", help="the configs at 64-row programs of 4 warps (the ones before)")
    args = ap.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.hmma_trace (reads %globaltimer)", smoke=False):
        print(reason, file=sys.stderr)
        return 2
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.overlap import Launch
    from specpilot.kernels.u12 import TUNED_TILES, hmma

    launch = Launch(pdl=args.pdl)
    names = [s for s in args.shapes.split(",") if s]
    for s in names:
        if s not in SHAPES or s == "lm_head":
            sys.exit(f"--shapes: {s!r} is not one of qkv, o, gate_up, down")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in names:
        n, k = SHAPES[name]
        cfg = TUNED_TILES[(16, n, k)]
        if args.w4:
            cfg = w4(cfg, n)
        copies = max(4, min(48, int(2e9 // (n * k * 2))))
        packed = [pack_u12((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16), layout="tiles")
                  for _ in range(copies)]
        x = torch.randn(16, k, device="cuda", generator=gen).to(torch.bfloat16)
        programs = (n // cfg.block_n) * cfg.split_k
        traces = [torch.zeros(programs, hmma.TRACE_SLOTS, dtype=torch.int64, device="cuda") for _ in packed]
        ys = [torch.empty(16, n, dtype=torch.bfloat16, device="cuda") for _ in packed]
        traced = [lambda t=t, y=y, b=b: hmma.launch_hmma(x, t, y, cfg, trace=b, launch=launch)
                  for t, y, b in zip(packed, ys, traces)]
        plain = [lambda t=t, y=y: hmma.launch_hmma(x, t, y, cfg, launch=launch) for t, y in zip(packed, ys)]
        us_plain = harness.time_graph(plain).median_ms * 1e3 / copies
        us_traced = harness.time_graph(traced).median_ms * 1e3 / copies  # the stamps' own cost: traced against plain
        for b in traces:
            b.zero_()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in traced:
                f()
        g.replay()
        torch.cuda.synchronize()
        calls = [phases(b.cpu(), cfg.split_k) for b in traces]
        row = dict(name=name, N=n, K=k, M=16, config=str(cfg), programs=programs, copies=copies,
                   us_plain=us_plain, us_traced=us_traced, phases=summarize(calls))
        row.update(pdl=args.pdl, w4=args.w4)
        rows.append(row)
        p = row["phases"]
        print(f"{name:8} plain {us_plain:6.2f} traced {us_traced:6.2f} | " + " ".join(
            f"{key} {v:.2f}" for key, v in p.items() if key not in ("summing", "by_load")), flush=True)
        print("         by programs an SM: " + ", ".join(f"{c}: {v['sms']:.0f} SMs loop {v['loop']:.2f} end {v['loops_end']:.2f}"
                                                     for c, v in p["by_load"].items()), flush=True)
        del packed, traces, ys, g
        torch.cuda.empty_cache()
    out = harness.write_run(
        args, "hmma_trace", "cuda", rows,
        timing="µs: %globaltimer stamps of one CUDA graph replay, medians over the calls after the first two; "
               "us_plain and us_traced: median replay of the same graph without and with stamps, a call")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
