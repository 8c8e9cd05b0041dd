"""The landscape a search walks: hand-picked pipelines of one deployment, timed interleaved.

    python -m bench.agent.landscape examples/pipeline.yaml --device cpu --rounds 5 \
        --pipelines "draft-block-size{size=16}" "draft-block-size{size=4}" "draft-vocab{size=1024}"

Every pipeline is built in one process and timed round-robin with the others (compiler.
run_trials_interleaved: each round runs every engine over every prompt, the order rotated by one each
round, the stock AR loop measured beside each), then token-forced. Per pipeline: engine ms/token,
engine/AR, τ, the per-round engine/AR figures (`rounds_relative`, from the round-by-round timings)
and the token-forcing verdict. Writes bench/results/agent_landscape_<gpu>[_<tag>].json. The first
pipeline is the reference: each row's `over_first` is its engine/AR over the first's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.agent import bench_spec
from specpilot.agent.trial import TrialJob
from specpilot.bench.harness import add_results_args, write_run
from specpilot.compiler import run_trials_interleaved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipeline", type=Path)
    ap.add_argument("--pipelines", nargs="+", required=True, help="pass pipelines; the first is the reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, help="serve at this batch (serving.batch_sizes = [N]): trials time the "
                    "batched engine against batched AR")
    ap.add_argument("--max-new-tokens", type=int, help="override the spec's serving.max_new_tokens")
    add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    spec = bench_spec(args.pipeline, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, batch=args.batch)
    jobs = [TrialJob(i + 1, spec, p, (), args.device) for i, p in enumerate(args.pipelines)]
    results = run_trials_interleaved(jobs, rounds=args.rounds)
    first = results[0].relative
    records = []
    for r in results:
        row = r.to_dict()
        row["over_first"] = (r.relative / first) if r.relative and first else None
        records.append(row)
        print(f"{r.pipeline or '(empty)':60s} {r.status:9s} engine {r.engine_ms or float('nan'):7.3f} ms/token, "
              f"AR {r.ar_ms or float('nan'):7.3f}, engine/AR {r.relative or float('nan'):.3f}, "
              f"over first {row['over_first'] or float('nan'):.3f}, tau {r.tau or float('nan'):.2f} {r.reason[:80]}",
              flush=True)
    path = write_run(args, "agent_landscape", args.device, records, reference=args.pipelines[0])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
