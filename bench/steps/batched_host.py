"""The batched engine's host share: batched AR steps over a Qwen3 model of many layers at tiny
widths (hidden 64), where the arithmetic is negligible and a step's time is Python and op dispatch.

    OMP_NUM_THREADS=1 python -m bench.steps.batched_host            # -> bench/results/batched_host_<gpu|cpu>.json
    OMP_NUM_THREADS=1 python -m bench.steps.batched_host --spec --concurrency 1,16,64 --tag spec

Each row: the layer count, the concurrency, and the median ms of a batched AR step (the backend's
`batched_ar`, decode steps only: prefill left out), over --steps new tokens. At Qwen3-8B's depth (36
layers) this is what an eager batched step costs before any weight is read.

--spec: the batched speculative engine instead, at the tiny shape (2 target layers) with a replay
DFlash drafter following DFlash's HumanEval profile (runtime/batch_replay.py), its mechanisms
(--pipeline, default all three) priced by the H100's measured verify table (SPEC_COST, from
batched_h100_graphs.json); each row: ms a decode step, the engine's own counts (verify rows a step,
τ, AR steps), and a profiled run's ms a step in each part of the step (PARTS: spec control, verify
budget, drafting, the verify's forward and its host side), so a change to the host's bookkeeping
shows as ms in its own part. The tiny model's forwards and the CPU reference attention stand in for
what the GPU replays.
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


SPEC_COST = ({1: 11.0915, 2: 11.1965, 4: 11.1835, 8: 11.2184, 16: 11.6352, 64: 12.8055, 128: 13.7423, 256: 16.2216,
              512: 21.9541, 1024: 37.0789}, {1: 2.0, 64: 3.0})  # H100 verify ms by rows (c1 and c64 tables); drafting assumed
PARTS = {"spec_control": ("batch_control.py", "lengths"), "verify_budget": ("batch_control.py", "choose_verify_budget"),
         "draft": ("batch.py", "_draft"), "verify": ("batch.py", "_verify"), "target_forward": ("batch.py", "target_forward"),
         "attention_reference": ("batch.py", "ragged_attention_reference")}


def spec_rows(concurrency: list[int], pipeline: str, max_new_tokens: int, repeats: int) -> list[dict]:
    """The batched speculative engine's decode steps at each concurrency (see --spec)."""
    import cProfile
    import pstats

    from specpilot.backends.torch_backend import ReplaySetup, ShapeModels
    from specpilot.bench.batch import serve
    from specpilot.bench.prompts import load_prompts
    from specpilot.dsl import parse_pipeline
    from specpilot.hf.known import dflash_config, model_config
    from specpilot.passes import run_passes
    from specpilot.runtime.batch_control import StepCost
    from specpilot.runtime.batch_replay import BatchReplay

    models = ShapeModels(model_config("tiny"), dflash_config("tiny"), ReplaySetup("dflash-qwen3-8b", "humaneval", 0),
                         seed=0)
    stock = lower(models.target_cfg, models.drafter_cfg, dtype="float32", batch=max(concurrency))
    engine = build_engine(stock, None, None, torch.device("cpu"), shape=models)
    engine = engine.with_program(run_passes(stock, parse_pipeline(pipeline, source="--pipeline"))[0]) if pipeline else engine
    tokenizer = models.tokenizer()
    prompts = [tokenizer.encode(t).ids for t in load_prompts("code-heldout", 8, source="bench.steps.batched_host")]
    capacity = max(map(len, prompts)) + max_new_tokens + engine.block_size + 2
    guesses = generate_batched(engine.batched_ar(max_batch=len(prompts), capacity=capacity), prompts, max_new_tokens)
    cost = StepCost.from_table(*SPEC_COST)
    rows = []
    for c in concurrency:
        def run(profile: cProfile.Profile | None = None):
            hook = BatchReplay(engine.replay.distribution, slots=c + 1, size=capacity + engine.block_size + 1,
                               device="cpu", seed=0)
            for p, g in zip(prompts, guesses):
                hook.suggest(p, g)
            eng = engine.batched(max_batch=c, capacity=capacity, cost=cost, draft_hook=hook)
            with torch.inference_mode():
                if profile is not None:
                    profile.enable()
                got = serve(eng, prompts, concurrency=c, requests=max(2 * c, len(prompts)), max_new_tokens=max_new_tokens)
                if profile is not None:
                    profile.disable()
            return eng.stats, got
        run()  # warm-up
        samples = []
        for _ in range(repeats):
            stats, got = run()
            samples.append((got.seconds - stats.prefill_s) * 1e3 / max(1, stats.steps))
        profile = cProfile.Profile()
        stats, got = run(profile)
        table = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
        parts = {part: round(sum(v[3] for k, v in table.items() if k[0].endswith("/" + f) and k[2] == fn) * 1e3
                             / max(1, stats.steps), 3) for part, (f, fn) in PARTS.items()}
        rows.append({"concurrency": c, "pipeline": pipeline, "ms_per_decode_step": round(statistics.median(samples), 3),
                     "steps": stats.steps, "verify_rows_per_step": round(stats.verify_rows / max(1, stats.steps), 2),
                     "tau": round(stats.tau, 3), "ar_steps": stats.ar_steps, "profiled_ms_per_step": parts,
                     "threads": torch.get_num_threads()})
        print(f"c{c:<3d} {rows[-1]['ms_per_decode_step']:8.2f} ms a decode step  rows {rows[-1]['verify_rows_per_step']}"
              f"  τ {rows[-1]['tau']}  AR steps {stats.ar_steps}  {parts}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,36", help="layer counts, comma-separated (36: Qwen3-8B's depth)")
    ap.add_argument("--concurrency", default="1,8", help="requests in flight, comma-separated")
    ap.add_argument("--steps", type=int, default=100, help="new tokens a request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--spec", action="store_true", help="the speculative engine with a replay drafter (see above)")
    ap.add_argument("--pipeline", default="verify-budget,ragged-verify,spec-control", help="--spec: its passes")
    args = harness.add_results_args(ap).parse_args(argv)
    if args.smoke:
        args.layers, args.concurrency, args.steps, args.repeats = "1,2", "1,2", 6, 1
    device = torch.device(args.device)
    if args.spec:
        rows = spec_rows([int(n) for n in args.concurrency.split(",")], args.pipeline, min(args.steps, 64), args.repeats)
        out = None if args.smoke else harness.write_run(
            args, "batched_host", device, rows, load_average=[round(x, 2) for x in os.getloadavg()],
            what="batched speculative decode steps at tiny widths with a replay drafter: ms a step and its parts")
        print(f"wrote {out}" if out else "smoke run: nothing written")
        return 0
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
