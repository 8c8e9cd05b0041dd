"""What `specpilot tune` finds for a deployment, confirmed head to head.

    python -m bench.agent.tune examples/pipeline.yaml --device cpu --rounds 3 --candidates 3
    python -m bench.agent.tune examples/replay-qwen3-8b.yaml --device cuda --rounds 4 --candidates 4 --tag replay8b

Runs the search (compiler.tune_pipeline: cost-model pruning, workers, token forcing, a fresh memory
store unless --memory), then confirms the result: the starting pipeline and the chosen one built in
one process and timed round-robin (compiler.run_trials_interleaved, --confirm-rounds rounds, the AR
baseline measured beside each), each token-forced. Writes bench/results/agent_<gpu>[_<tag>].json
(agent_cpu.json on a CPU): every trial (pipeline, proposer, status, reason, predicted and measured
engine/AR, τ, engine/AR of each interleaved repeat and, against the round's control, the geometric
mean and its 90% upper bound, the peak device memory while it ran: torch.cuda.max_memory_allocated,
None on a CPU) and the confirmation rows; `peak_memory_gib` is the most of them. `faster` is true
when the chosen pipeline is not the start, its token forcing passed, and in the confirmation the
one-sided 90% upper bound of its engine/AR over the start's, repeat by repeat (search.paired_ratio),
is below 1. --no-strict applies to the confirmation too: no fp32 copy of the target beside it.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bench.agent import bench_spec
from specpilot.agent.search import TuneConfig, paired_ratio
from specpilot.agent.trial import TrialJob
from specpilot.bench.harness import add_results_args, git_commit, write_run
from specpilot.compiler import run_trial, run_trials_interleaved, tune_pipeline
from specpilot.runtime.shared_weights import sharing_weights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipeline", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--workers", default="1")
    ap.add_argument("--memory", type=Path, help="memory store (default: a fresh one in a temporary folder)")
    ap.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    ap.add_argument("--confirm-rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each trial a round")
    ap.add_argument("--min-gain", type=float, default=0.02)
    ap.add_argument("--patience", type=int, default=2, help="rounds in a row without a gain before the search stops")
    ap.add_argument("--sequential", action="store_true",
                    help="on one GPU, a round's candidates one after another (8B engines do not fit side by side)")
    ap.add_argument("--no-strict", action="store_true",
                    help="token forcing only: no fp32 reference (an 8B target's fp32 copy is 32 GB more on the GPU)")
    ap.add_argument("--threads", type=int, default=4, help="torch threads on a CPU (the zoo's models are launch-bound)")
    add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    spec = bench_spec(args.pipeline, num_prompts=args.num_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        memory = args.memory or Path(tmp) / "memory.db"
        config = TuneConfig(rounds=args.rounds, candidates=args.candidates, min_gain=args.min_gain, patience=args.patience, commit=git_commit(),
                            strict_referee=not args.no_strict, repeats=args.repeats)
        result = tune_pipeline(spec, out_dir=Path(tmp) / "tune", config=config, workers=args.workers, memory=memory,
                               device=args.device, interleave=not args.sequential, progress=lambda r: print(f"trial {r.trial}: {r.pipeline or '(empty)'}"
                               f" {r.status} {r.relative or float('nan'):.3f} {r.reason[:100]}", flush=True))
    s = result.search
    # judged as the search judged (--no-strict: token forcing alone, no fp32 copy of the target)
    jobs = [TrialJob(1, spec, s.start, (), args.device, not args.no_strict),
            TrialJob(2, spec, s.best, (), args.device, not args.no_strict)]
    with sharing_weights():  # one copy of the target for both, one candidate at a time with --sequential
        confirm = ([run_trial(j) for j in jobs] if args.sequential else
                   run_trials_interleaved(jobs, rounds=args.confirm_rounds))
    start, best = confirm
    # the same pipeline measured twice is never "faster": the confirmation then only shows the timing noise
    paired = paired_ratio(best.extra.get("rounds_relative", []), start.extra.get("rounds_relative", []))
    faster = (s.best != s.start and best.status == "validated" and start.status == "validated"
              and paired is not None and paired[1] < 1.0)
    records = [{"kind": "trial", **asdict(r)} for r in s.trials]
    records += [{"kind": "confirm", "which": w, **r.to_dict()} for w, r in (("start", start), ("chosen", best))]
    path = write_run(args, "agent", args.device, records, start=s.start, chosen=s.best, stopped=s.stopped,
                     trials=len([r for r in s.trials if r.relative is not None]),
                     rejected=len([r for r in s.trials if r.status == "rejected"]),
                     start_ms_per_token=start.engine_ms, chosen_ms_per_token=best.engine_ms,
                     chosen_over_start=(best.engine_ms / start.engine_ms) if best.engine_ms and start.engine_ms else None,
                     kept_start=s.best == s.start,
                     chosen_over_start_relative=paired[0] if paired else None,
                     chosen_over_start_bound90=paired[1] if paired else None,
                     chosen_token_forcing=best.forcing, faster=faster,
                     peak_memory_gib=max((r.peak_memory_gib for r in [*s.trials, start, best]
                                          if r.peak_memory_gib is not None), default=None),
                     engine_report=result.engine.report if result.engine else None)
    print(f"start {s.start!r}: {start.relative:.3f} of AR; chosen {s.best!r}: {best.relative:.3f} of AR; "
          f"chosen/start {paired}; "
          f"{best.forcing}; faster={faster}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
