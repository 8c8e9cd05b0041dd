"""Chain, one-level trees and two-level trees on a pipeline.yaml's pair: τ, ms/token and accepted
tokens per ms at each budget (CPU or GPU).

For each pipeline: its own pass pipeline is the chain; then for every budget N, `tree-verify{budget=N}`
and `two-level-verify{budget=N, draft-budget=F*N}` with each first level (the drafter's survival
products; the early exit over the target's first L layers for each L of --exit-layers). Every
configuration runs through the torch backend's Engine.generate on the same prompts; the AR baseline
runs once per repeat beside them (greedy, prefill excluded), and every configuration's outputs are
compared with it. τ counts the bonus token; tokens/ms = output tokens per millisecond of decode
(what two-level verification is to raise at the best one-level tree's τ); on a CPU also per ms of the
loop thread's CPU time (a shared machine's wall clock is noise). The summary sets each two-level row
against the best one-level tree at its budget (by tokens/ms; on a CPU by tokens per thread-CPU ms). Writes
bench/results/hybrid_tree_<gpu|cpu>[_<tag>].json through the harness.

    python -m bench.e2e.hybrid_tree [PIPELINE.yaml ...] [--budgets 16,32,64] [--topk 4] [--draft-factor 4]
                                    [--exit-layers 2] [--repeats 1] [--num-prompts 8] [--graphs] [--out F|DIR] [--tag T]

Default pipeline: examples/hybrid.yaml (the zoo's hybrid pair: Gated DeltaNet + attention, DFlash).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from specpilot.backends.torch_backend import build_engine, default_dtype, pick_device
from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.compiler import lower_spec, resolve_models, resolve_passes
from specpilot.passes import pipeline_string, run_passes
from specpilot.passes.cuda_graphs import CudaGraphs
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.two_level_verify import TwoLevelVerify
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.spec import load_spec

ROOT = harness.ROOT


def configurations(passes: list, budgets: list[int], topk: int, factor: int, exits: list[int],
                   graphs: bool = False) -> list[tuple]:
    """(label, pass list) of every configuration: chain, then per budget the tree and the two-levels;
    with `graphs`, the chain and the trees also as graphed steps (two-level steps run eagerly)."""
    out = [("chain", passes)] + ([("chain-graphed", [*passes, CudaGraphs()])] if graphs else [])
    for n in budgets:
        out.append((f"tree-{n}", [*passes, TreeVerify(budget=n, topk=topk)]))
        if graphs:
            out.append((f"tree-{n}-graphed", [*passes, TreeVerify(budget=n, topk=topk), CudaGraphs()]))
        out.append((f"two-level-{n}-drafter",
                    [*passes, TwoLevelVerify(budget=n, draft_budget=factor * n, topk=topk, first="drafter")]))
        for layer in exits:
            for first, tag in (("early-exit", "exit"), ("early-exit-drafter", "exit-drafter")):
                out.append((f"two-level-{n}-{tag}{layer}",
                            [*passes, TwoLevelVerify(budget=n, draft_budget=factor * n, topk=topk, first=first,
                                                     exit_layer=layer)]))
    return out


def bench_pipeline(path: Path, args, device: torch.device, configure=None) -> list[dict]:
    """Every configuration of the pair `path` names, interleaved within each repeat, beside AR. `configure`
    (passes, budgets, args) -> [(label, pass list)]: this script's `configurations` by default."""
    spec = load_spec(path)
    dirs = resolve_models(spec)
    dtype = default_dtype(device) if spec.dtype == "auto" else spec.dtype
    passes = resolve_passes(spec, None)
    lowered = lower_spec(spec, dirs, dtype)
    base, _ = run_passes(lowered, passes)
    engine = build_engine(base, dirs.target, dirs.drafter, device)
    tokenizer = load_tokenizer(dirs.target)
    texts = load_prompts(spec.benchmark.prompts, args.num_prompts or spec.benchmark.num_prompts, source=str(path))
    prompts = [tokenizer.encode(t).ids for t in texts]
    n_new = args.max_new_tokens or spec.serving.max_new_tokens
    budgets = [int(b) for b in args.budgets.split(",")]
    exits = [int(e) for e in args.exit_layers.split(",") if e]
    chosen = (configure(passes, budgets, args) if configure is not None else
              configurations(passes, budgets, args.topk, args.draft_factor, exits, args.graphs))
    configs = [(label, ps, run_passes(lowered, ps)[0]) for label, ps in chosen]
    engines = {label: engine.with_program(program) for label, _, program in configs}
    warm = prompts[0][:8] or [0]
    engine.generate_ar(warm, 4)
    for e in engines.values():
        e.generate(warm, 4)
    ar_tokens, ar_s = [], []
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in configs}
    ar_cpu = []
    for _ in range(args.repeats):  # configurations interleaved within a repeat
        t0 = time.thread_time()
        ar = [engine.generate_ar(p, n_new) for p in prompts]
        ar_cpu.append(time.thread_time() - t0)
        ar_tokens, ar_s = [g.tokens for g in ar], ar_s + [sum(g.decode_s for g in ar)]
        for label, _, _ in configs:
            t0 = time.thread_time()
            gens = [engines[label].generate(p, n_new) for p in prompts]
            runs[label].append({"gens": gens, "s": sum(g.decode_s for g in gens), "cpu_s": time.thread_time() - t0})
            steps = sum(len(g.accepted) for g in gens)
            print(f"  {path.name} repeat {len(runs[label])} {label}: {runs[label][-1]['s']:.2f} s decode, "
                  f"τ {1 + sum(a for g in gens for a in g.accepted) / max(1, steps):.2f}", flush=True)
    ar_ms = statistics.median(ar_s) * 1e3 / sum(len(t) for t in ar_tokens)
    draft = base.step.one("draft")[1]
    rows = []
    for label, ps, program in configs:
        gens = runs[label][0]["gens"]
        tokens = sum(len(g.tokens) for g in gens)
        accepted = [a for g in gens for a in g.accepted]
        ms = statistics.median(r["s"] for r in runs[label]) * 1e3 / tokens
        # on a CPU (one intra-op thread) the thread's CPU time, prefill included: what other processes
        # on a shared machine disturb least; on a GPU it is the host's share only
        cpu_ms = statistics.median(r["cpu_s"] for r in runs[label]) * 1e3 / tokens
        verify = program.step.one("verify")[1]
        rows.append({
            "pipeline_file": str(path), "target": spec.target, "label": label, "pipeline": pipeline_string(ps),
            "drafter": {"kind": draft["kind"], "block_size": draft["block_size"]},
            "verify": verify["mode"], "verify_q": verify["q"], "first": verify.get("first"),
            "exit_layer": verify.get("exit_layer"), "drafted": program.step.one("propose")[1]["budget"],
            "prompts": len(prompts), "max_new_tokens": n_new, "steps": len(accepted),
            "tau": round(1 + sum(accepted) / max(1, len(accepted)), 4),
            "ms_per_token": round(ms, 4), "tokens_per_ms": round(1 / ms, 4) if ms else 0.0,
            "ar_ms_per_token": round(ar_ms, 4), "speedup_over_ar": round(ar_ms / ms, 4) if ms else 0.0,
            "thread_cpu_ms_per_token": round(cpu_ms, 4), "tokens_per_cpu_ms": round(1 / cpu_ms, 4) if cpu_ms else 0.0,
            "ar_thread_cpu_ms_per_token": round(statistics.median(ar_cpu) * 1e3 / sum(len(t) for t in ar_tokens), 4),
            "outputs_equal_ar": f"{sum(g.tokens == a for g, a in zip(gens, ar_tokens))}/{len(prompts)}",
        })
        r = rows[-1]
        print(f"{path.name:>14} {label:<26} τ={r['tau']:6.3f}  {ms:8.3f} ms/token  {r['tokens_per_ms']:7.4f} tok/ms  "
              f"(thread CPU {cpu_ms:8.3f} ms/token)  "
              f"AR {ar_ms:8.3f}  ×{r['speedup_over_ar']:.3f}  equal AR {r['outputs_equal_ar']}", flush=True)
    return rows


def against_best_tree(rows: list[dict], key: str = "tokens_per_ms") -> list[dict]:
    """Each two-level row against the best one-level tree of its pipeline at its budget (by `key`)."""
    out = []
    for r in rows:
        if r["verify"] != "two-level":
            continue
        trees = [t for t in rows if t["pipeline_file"] == r["pipeline_file"] and t["verify"] == "tree"
                 and t["verify_q"] == r["verify_q"] and not t["label"].endswith("-graphed")]  # eager against eager
        if not trees:
            continue
        best = max(trees, key=lambda t: t[key])
        out.append({"pipeline_file": r["pipeline_file"], "label": r["label"], "against": best["label"], "by": key,
                    "gain": round(r[key] / best[key] - 1, 4),
                    "tau_change": round(r["tau"] / best["tau"] - 1, 4)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipelines", nargs="*", type=Path, default=[ROOT / "examples" / "hybrid.yaml"])
    parser.add_argument("--budgets", default="16,32,64", help="verified nodes per step (trees; two-level survivors)")
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--draft-factor", type=int, default=4, help="a two-level step drafts factor x budget nodes")
    parser.add_argument("--exit-layers", default="2", help="early-exit first levels: target layers read, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per configuration (median)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (tiny models: 1 is fastest)")
    parser.add_argument("--max-new-tokens", type=int, help="override the spec's serving.max_new_tokens")
    parser.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    parser.add_argument("--graphs", action="store_true", help="also the chain and the trees as graphed steps (cuda-graphs)")
    args = harness.add_results_args(parser, smoke=False).parse_args(argv)

    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for path in args.pipelines:
        rows += bench_pipeline(path, args, device)
    summary = against_best_tree(rows, "tokens_per_cpu_ms" if device.type == "cpu" else "tokens_per_ms")
    for s in summary:
        print(f"{Path(s['pipeline_file']).name:>14} {s['label']:<26} vs {s['against']:<10} {s['by']} "
              f"{s['gain']:+.1%}  τ {s['tau_change']:+.1%}")
    out = harness.write_run(
        args, "hybrid_tree", device, rows, against_best_tree=summary,
        what="τ, ms/token and tokens/ms: chain, tree-verify{budget} and two-level-verify{budget, draft-budget, first}, "
             "torch backend (eager loops), greedy, prefill excluded",
        timing=f"runtime clocks (device synchronised), median of {args.repeats} interleaved runs over all prompts; AR = "
               "the engine's generate_ar, once per repeat",
        threads=torch.get_num_threads() if device.type == "cpu" else None,
        load_average=os.getloadavg() if device.type == "cpu" else None)  # a shared CPU's timings mean little
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
