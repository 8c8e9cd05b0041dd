"""Batch regimes: the same deployment tuned for batch 1 and for batch N chooses by what each measures.

    python -m bench.agent.batch_regimes examples/pipeline.yaml --device cpu --batches 1 32

For each batch b (serving.batch_sizes = [b]) in order, `compiler.tune_pipeline` with one shared
memory store: at batch 1 trials time the batch-1 loops beside the stock AR loop; above it, the
batched engine (runtime/batch.py, the schedule's mechanisms: verify-budget, ragged-verify,
spec-control) against the stock target's batched AR at b requests in flight (compiler.measure_trial).
The fingerprints differ in their batch regime, so each search records its own trials; a later
regime's first round is seeded with an earlier one's mechanisms, which must win their own
measurement. Then, at every batch, the pipelines the regimes chose are timed against each other
(compiler.run_trials_interleaved, --confirm-rounds repeats) and token-forced: `cross` says, per
batch, each chosen pipeline's engine/AR, and the paired ratio (with its 90% upper bound) of the
other regimes' choices over that batch's own. Writes bench/results/agent_batch_<gpu>[_<tag>].json.
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
from specpilot.compiler import run_trials_interleaved, tune_pipeline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipeline", type=Path)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--confirm-rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    ap.add_argument("--max-new-tokens", type=int, help="override the spec's serving.max_new_tokens")
    ap.add_argument("--threads", type=int, default=1)
    add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    specs = {b: bench_spec(args.pipeline, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, batch=b)
             for b in args.batches}
    config = TuneConfig(rounds=args.rounds, candidates=args.candidates, patience=args.patience, repeats=args.repeats,
                        commit=git_commit())
    searches = {}
    with tempfile.TemporaryDirectory() as tmp:
        for b, spec in specs.items():
            r = tune_pipeline(spec, out_dir=Path(tmp) / f"b{b}", config=config, memory=Path(tmp) / "memory.db",
                              device=args.device,
                              progress=lambda t, b=b: print(f"b{b} trial {t.trial}: {t.pipeline or '(empty)'} {t.status} "
                                                            f"{t.relative or float('nan'):.3f} {t.reason[:80]}", flush=True))
            searches[b] = r.search
    chosen = {b: s.best for b, s in searches.items()}
    cross = {}
    for b, spec in specs.items():
        pipelines = [chosen[b]] + [chosen[o] for o in args.batches if o != b and chosen[o] != chosen[b]]
        if len(pipelines) == 1:
            cross[b] = {"pipelines": pipelines, "note": "every regime chose the same pipeline"}
            continue
        got = run_trials_interleaved([TrialJob(i + 1, spec, p, (), args.device) for i, p in enumerate(pipelines)],
                                     rounds=args.confirm_rounds)
        own = got[0].extra.get("rounds_relative", [])
        cross[b] = {"pipelines": pipelines, "relative": [g.relative for g in got], "status": [g.status for g in got],
                    "forcing": [g.forcing for g in got],
                    "others_over_own": [paired_ratio(g.extra.get("rounds_relative", []), own) for g in got[1:]]}
        print(f"b{b}: {list(zip(pipelines, cross[b]['relative']))}; others/own {cross[b]['others_over_own']}", flush=True)
    records = [{"batch": b, **asdict(t)} for b, s in searches.items() for t in s.trials]
    summary = {f"b{b}": {"start": s.start, "chosen": s.best, "best_relative": s.best_relative,
                         "start_relative": s.start_relative, "stopped": s.stopped,
                         "measured_trials": sum(t.relative is not None for t in s.trials)} for b, s in searches.items()}
    # the regimes' choices differ where they do and each is at least as fast at its own batch (bound of
    # the others' over its own above 1: no other regime's choice is measurably faster there)
    own_best = all(all(o is None or o[1] >= 1.0 for o in c.get("others_over_own", [])) for c in cross.values())
    path = write_run(args, "agent_batch", args.device, records, searches=summary, chosen={f"b{b}": p for b, p in chosen.items()},
                     different=len(set(chosen.values())) > 1, cross={f"b{b}": c for b, c in cross.items()},
                     each_own_choice_not_beaten=own_best)
    print(f"chosen {chosen}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
