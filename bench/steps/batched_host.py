"""The batched engine's host share: batched AR steps over a Qwen3 model of many layers at tiny
widths (hidden 64), where the arithmetic is negligible and a step's time is Python and op dispatch.

    OMP_NUM_THREADS=1 python -m bench.steps.batched_host            # -> bench/results/batched_host_<gpu|cpu>.json

Each row: the layer count, the concurrency, and the median ms of a batched AR step (the backend's
`batched_ar`, decode steps only: prefill left out), over --steps new tokens. At Qwen3-8B's depth (36
layers) this is what an eager batched step costs before any weight is read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from specpilot.backends.torch_backend import build_engine
from specpilot.bench import harness
from specpilot.hf.checkpoint import read_config
from specpilot.ir import lower
from specpilot.runtime.batch import generate_batched
from specpilot.runtime.tiny import build_tiny_models


def step_ms(engine, concurrency: int, steps: int, repeats: int) -> tuple[float, int]:
    """Median ms of a decode step of batched AR at `concurrency` (its prefill left out), and the steps taken."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8 + i] for i in range(concurrency)]
    generate_batched(engine.batched_ar(max_batch=concurrency, capacity=steps + 16), prompts, 4)  # warm-up
    samples, taken = [], 0
    for _ in range(repeats):
        ar = engine.batched_ar(max_batch=concurrency, capacity=steps + 16)
        with torch.inference_mode():
            t = harness.time_events(lambda: generate_batched(ar, prompts, steps), repeats=1, warmup=0)
        taken = ar.stats.steps
        decode_ms = t.median_ms - ar.stats.prefill_s * 1e3
        samples.append(decode_ms / max(1, taken - 1))
    return statistics.median(samples), taken


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,36", help="layer counts, comma-separated (36: Qwen3-8B's depth)")
    ap.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated")
    ap.add_argument("--steps", type=int, default=100, help="new tokens a request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = harness.add_results_args(ap).parse_args(argv)
    if args.smoke:
        args.layers, args.concurrency, args.steps, args.repeats = "1,2", "1,2", 6, 1
    device = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (int(n) for n in args.layers.split(",")):
            dirs = build_tiny_models(Path(tmp) / f"l{layers}", "qwen3", num_layers=layers)
            program = lower(read_config(dirs["target"])[0], read_config(dirs["dflash"])[0], dtype="float32", batch=1)
            engine = build_engine(program, dirs["target"], dirs["dflash"], device)
            for c in (int(n) for n in args.concurrency.split(",")):
                ms, steps = step_ms(engine, c, args.steps, args.repeats)
                rows.append({"layers": layers, "hidden": 64, "concurrency": c, "ms_per_step": round(ms, 3),
                             "steps": steps, "threads": torch.get_num_threads()})
                print(f"{layers:3d} layers  c{c:<3d} {ms:8.2f} ms a batched AR step", flush=True)
    out = None if args.smoke else harness.write_run(
        args, "batched_host", device, rows, load_average=[round(x, 2) for x in os.getloadavg()],
        what="batched AR decode steps at tiny widths: the eager step's Python and dispatch by layer count")
    print(f"wrote {out}" if out else "smoke run: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
