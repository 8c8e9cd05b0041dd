"""τ and ms/token of chain vs tree verification, on a pipeline.yaml's pair and prompts (CPU or GPU).

For each pipeline: the spec's own pass pipeline is the chain baseline; then `tree-verify{budget=N,
topk=K}` on top of it for every budget. Each configuration runs through the torch backend's
Engine.generate with the AR baseline beside it (specpilot.bench.harness.measure: greedy, prefill
excluded, warm-up first); ms/token and the speedup are the median over --repeats runs, τ counts
the bonus token. Outputs are compared with AR greedy (`outputs_equal_ar`). Writes
bench/results/tree_tau_<gpu|cpu>[_<tag>].json through the harness.

    python -m bench.e2e.tree_tau [PIPELINE.yaml ...] [--budgets 16,32,64,128] [--topk 4] [--repeats 3]
                                 [--graphs] [--fused] [--out FILE|DIR] [--tag TAG]

Default pipeline: examples/pipeline.yaml. On the tiny random pairs τ ≈ 1 whatever the tree
(random drafters rarely hit the target's argmax): those rows check the machinery and show the
verify cost of larger trees, not the tree's gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

from specpilot.backends.torch_backend import build_engine, default_dtype, pick_device
from specpilot.bench import harness
from specpilot.bench.harness import measure
from specpilot.bench.prompts import load_prompts
from specpilot.compiler import lower_spec, resolve_models, resolve_passes
from specpilot.passes import pipeline_string, run_passes
from specpilot.passes.attention_split_kv import AttentionSplitKV
from specpilot.passes.cuda_graphs import CudaGraphs
from specpilot.passes.fused_decoder import FusedDecoder
from specpilot.passes.tree_verify import TreeVerify
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.spec import load_spec

ROOT = harness.ROOT


def bench_pipeline(path: Path, budgets: list[int], topk: int, repeats: int, device: torch.device,
                   max_new_tokens: int | None, num_prompts: int | None, graphs: bool = False,
                   fused: bool = False) -> list[dict]:
    spec = load_spec(path)
    dirs = resolve_models(spec)
    dtype = default_dtype(device) if spec.dtype == "auto" else spec.dtype
    passes = (resolve_passes(spec, None) + ([AttentionSplitKV(), FusedDecoder()] if fused else [])
              + ([CudaGraphs()] if graphs else []))
    base, _ = run_passes(lower_spec(spec, dirs, dtype), passes)
    if base.step.one("verify")[1]["mode"] != "chain":
        raise SystemExit(f"{path}: its pipeline already verifies a tree; the chain baseline needs a chain pipeline")
    engine = build_engine(base, dirs.target, dirs.drafter, device)
    tokenizer = load_tokenizer(dirs.target)
    texts = load_prompts(spec.benchmark.prompts, num_prompts or spec.benchmark.num_prompts, source=str(path))
    prompts = [tokenizer.encode(t).ids for t in texts]
    n_new = max_new_tokens or spec.serving.max_new_tokens
    draft = base.step.one("draft")[1]

    configs = [(pipeline_string(passes), None, base)]
    for budget in budgets:
        tree = TreeVerify(budget=budget, topk=topk)
        configs.append((pipeline_string([*passes, tree]), tree, tree.apply(base).program))
    rows = []
    for pipeline, tree, program in configs:
        eng = dataclasses.replace(engine, program=program)
        runs = [measure(eng, eng, prompts, n_new) for _ in range(repeats)]  # tree-verify leaves the target stock
        m = runs[0]
        ar_ms = statistics.median(r.ar_ms_per_token for r in runs)
        spec_ms = statistics.median(r.spec_ms_per_token for r in runs)
        rows.append({
            "pipeline_file": str(path), "pipeline": pipeline, "target": spec.target,
            "drafter": {"kind": draft["kind"], "block_size": draft["block_size"]},
            "verify": "tree" if tree else "chain", "budget": tree.budget if tree else None,
            "topk": tree.topk if tree else None, "verify_q": program.step.one("verify")[1]["q"],
            "prompts": len(prompts), "max_new_tokens": n_new, "steps": len(m.accepted),
            "tau": round(m.tau, 4), "acceptance_histogram": m.acceptance_histogram(draft["block_size"]),
            "ar_ms_per_token": round(ar_ms, 4), "ms_per_token": round(spec_ms, 4),
            "speedup_over_ar": round(ar_ms / spec_ms, 4) if spec_ms else 0.0,
            "outputs_equal_ar": f"{m.matches_ar}/{len(prompts)}",
        })
        print(f"{path.name:>14} {pipeline:<60} τ={m.tau:6.3f}  {spec_ms:8.3f} ms/token  "
              f"AR {ar_ms:8.3f}  ×{rows[-1]['speedup_over_ar']:.3f}  equal AR {rows[-1]['outputs_equal_ar']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipelines", nargs="*", type=Path, default=[ROOT / "examples" / "pipeline.yaml"])
    parser.add_argument("--budgets", default="16,32,64,128", help="tree budgets, comma-separated")
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (tiny models: 1 is fastest)")
    parser.add_argument("--max-new-tokens", type=int, help="override the spec's serving.max_new_tokens")
    parser.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    parser.add_argument("--graphs", action="store_true",
                        help="add the cuda-graphs pass: chain and tree steps as graph replays (the GPU fast path)")
    parser.add_argument("--fused", action="store_true",
                        help="add the attention-split-kv and fused-decoder passes (Triton kernels: a GPU, or "
                             "TRITON_INTERPRET=1); with --graphs, the fastest stack there is")
    args = harness.add_results_args(parser, smoke=False).parse_args(argv)

    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    rows = []
    for path in args.pipelines:
        rows += bench_pipeline(path, budgets, args.topk, args.repeats, device, args.max_new_tokens,
                               args.num_prompts, args.graphs, args.fused)
    out = harness.write_run(
        args, "tree_tau", device, rows,
        what="τ and ms/token, chain vs tree-verify{budget, topk}, torch backend, greedy, prefill excluded",
        timing=f"runtime clocks (device synchronised), median of {args.repeats} runs over all prompts; "
               "AR = the runtime's static-cache greedy loop, measured beside each configuration",
        threads=torch.get_num_threads() if device.type == "cpu" else None)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
