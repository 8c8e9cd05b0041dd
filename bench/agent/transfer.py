"""Memory transfer: does tuning a deployment after a similar one reach its final speed in fewer trials?

    python -m bench.agent.transfer examples/pipeline.yaml examples/pard.yaml --device cpu

Three searches of `compiler.tune_pipeline`, each its own fresh memory store except where said:
1. cold: the second deployment (PARD) from nothing;
2. the first deployment (DFlash) into memory store M;
3. warm: the second deployment with M (its first round seeded with the mechanisms validated on the
   first, fingerprint distance 2: drafter kind and shape differ).
The target speed is the cold search's best measured engine/AR ratio, with --tolerance slack (CPU
timings of a trial repeat within a few percent); each search's "trials to target" counts its
measured trials (the start and every round's control included) up to the first validated one at or
below it. Writes bench/results/agent_transfer_<gpu>[_<tag>].json with every trial of all three and
`warm_over_cold` = warm trials to target / cold trials to target (the aim: at most 0.5).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bench.agent import bench_spec
from specpilot.agent.search import TuneConfig
from specpilot.bench.harness import add_results_args, git_commit, write_run
from specpilot.compiler import tune_pipeline


def trials_to(result, target: float) -> int | None:
    n = 0
    for r in result.trials:
        if r.relative is None:
            continue
        n += 1
        if r.status == "validated" and r.relative <= target:
            return n
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, help="override each spec's benchmark.num_prompts")
    ap.add_argument("--max-new-tokens", type=int, help="override each spec's serving.max_new_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each trial a round")
    ap.add_argument("--patience", type=int, default=2)
    add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    config = TuneConfig(rounds=args.rounds, candidates=args.candidates, repeats=args.repeats, patience=args.patience,
                        commit=git_commit())
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def tune(name: str, path: Path, memory: Path):
            spec = bench_spec(path, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens)
            r = tune_pipeline(spec, out_dir=tmp / name, config=config, memory=memory, device=args.device,
                              progress=lambda t: print(f"{name} trial {t.trial}: {t.pipeline or '(empty)'} {t.status} "
                                                       f"{t.relative or float('nan'):.3f}", flush=True))
            runs[name] = r.search
            return r.search

        cold = tune("cold", args.second, tmp / "cold.db")
        tune("first", args.first, tmp / "shared.db")
        warm = tune("warm", args.second, tmp / "shared.db")
    target = cold.best_relative * (1 + args.tolerance)
    cold_n, warm_n = trials_to(cold, target), trials_to(warm, target)
    records = [{"search": name, **asdict(t)} for name, s in runs.items() for t in s.trials]
    summary = {name: {"start": s.start, "best": s.best, "best_relative": s.best_relative, "stopped": s.stopped,
                      "measured_trials": sum(t.relative is not None for t in s.trials)} for name, s in runs.items()}
    ratio = (warm_n / cold_n) if cold_n and warm_n else None
    path = write_run(args, "agent_transfer", args.device, records, searches=summary, target_relative=target,
                     cold_trials_to_target=cold_n, warm_trials_to_target=warm_n, warm_over_cold=ratio,
                     aim_met=ratio is not None and ratio <= 0.5)
    print(f"cold {cold_n} trials, warm {warm_n} trials to {target:.3f} of AR; warm/cold {ratio}; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
