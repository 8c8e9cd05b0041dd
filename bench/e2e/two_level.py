"""Two-level verification against the best one-level tree at the same verify budget: τ, accepted
tokens per ms, the ceiling a perfect first level could reach, and where a step's time goes.

For each pipeline and each verify budget N (the nodes the target verifies): the one-level tree of N
nodes (`tree-verify{budget=N}`), the one-level tree of every drafted budget M = F × N (its τ is what
a perfect first level keeping N of M nodes reaches: the oracle keeps the accepted path, which a tree
of M holds), the drafter first level (at batch 1 it keeps the best-first tree of N: the same nodes as
tree-N, a bigger proposal), and the early-exit first levels at each exit layer L and draft factor F
(the second level continues the survivors from layer L: runtime/two_level.py). Configurations run
interleaved within each repeat, beside AR, through the torch backend's Engine (bench.e2e.hybrid_tree's
loop); every output is compared with AR. On a CPU tokens/ms is per ms of the loop thread's CPU time.

Then one more, untimed-for-the-table run of each configuration with every term of the step timed
(thread CPU ms a step; on a GPU the host's share only, unsynchronised): draft, propose, the first
level's layers and head, the target's verify, accept and commit, the rest (host, prefill included). The summary sets each two-level row against the best one-level tree at
its budget and against the ceiling: tree-N's tokens/ms × τ(tree-M) / τ(tree-N), a perfect first level
that costs nothing. Writes bench/results/two_level_<gpu|cpu>[_<tag>].json through the harness.

    python -m bench.e2e.two_level [PIPELINE.yaml ...] [--budgets 16,32] [--draft-factors 2,4] [--exit-layers 1,2]
                                  [--firsts early-exit,early-exit-drafter] [--repeats 3] [--num-prompts 8]

Batched (`--concurrency 1,4,16`): the zoo pairs (`--zoo`) in the batched engine (runtime/batch.py),
c requests in flight and 2c (at least the prompts) served, per verify budget N a request (the first of
--budgets) and drafted M = F × N (the first of --draft-factors): the one-level trees of N and of the
smaller --tree-budgets (`tree-verify`; the best of them is the best one-level tree at budget N), two-level with the drafter first level and with each early exit (--firsts at each of
--exit-layers), each first level's budget batch-wide (N a request on average, split by its scores),
with `--with-budget` also under `verify-budget` (its cost table chooses the total); all with
ragged-verify, beside batched AR, interleaved within each repeat. Per row: decode tokens per ms of
the loop thread's CPU time and of the wall clock (prefill forwards and their first tokens left out),
τ, verified rows a step, outputs equal to batch-1 AR. Writes bench/results/two_level_batched_<gpu|cpu>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from bench.e2e.hybrid_tree import against_best_tree, bench_pipeline
from specpilot.backends.torch_backend import build_engine, pick_device
from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.compiler import lower_spec, resolve_models, resolve_passes
from specpilot.passes import run_passes
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.two_level_verify import TwoLevelVerify
from specpilot.runtime import dflash, tree_decode, two_level
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.spec import load_spec

ROOT = harness.ROOT
# (module, attribute, term): the functions a step calls, timed where the loops look them up
TERMS = ((tree_decode, "propose_tree", "propose"), (two_level, "exit_forward", "first level: layers"),
         (two_level, "exit_scores", "first level: head"), (two_level, "survivors", "first level: survivors"),
         (tree_decode, "verify_tree_logits", "verify"), (two_level, "verify_tree_logits", "verify"),
         (two_level, "continue_tree", "verify"), (tree_decode, "accept_tree", "accept"),
         (tree_decode, "commit_tree", "commit"))


def configure(passes: list, budgets: list[int], args) -> list[tuple[str, list]]:
    """(label, pass list) of every configuration: per budget N the trees of N and F × N, the drafter
    first level, then each early-exit first level at each exit layer and draft factor."""
    factors = [int(f) for f in args.draft_factors.split(",")]
    exits = [int(e) for e in args.exit_layers.split(",") if e]
    firsts = [f for f in args.firsts.split(",") if f]
    out = []
    for n in budgets:
        out.append((f"tree-{n}", [*passes, TreeVerify(budget=n, topk=args.topk)]))
        out += [(f"tree-{f * n}", [*passes, TreeVerify(budget=f * n, topk=args.topk)]) for f in factors
                if f * n not in budgets]
        out.append((f"two-level-{n}-drafter-m{max(factors) * n}",
                    [*passes, TwoLevelVerify(budget=n, draft_budget=max(factors) * n, topk=args.topk, first="drafter")]))
        for f in factors:
            for layer in exits:
                for first in firsts:
                    out.append((f"two-level-{n}-{first}{layer}-m{f * n}",
                                [*passes, TwoLevelVerify(budget=n, draft_budget=f * n, topk=args.topk, first=first,
                                                         exit_layer=layer)]))
    seen: set[str] = set()
    return [(label, ps) for label, ps in out if not (label in seen or seen.add(label))]


@contextlib.contextmanager
def timed_terms(totals: dict[str, float]) -> Iterator[None]:
    """Add each step term's thread CPU seconds into `totals` while inside (the drafter's forward too)."""
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in TERMS]
    saved.append((dflash.DFlashDrafter, "__call__", dflash.DFlashDrafter.__call__))

    def timed(fn, term):
        def run(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                totals[term] += time.thread_time() - t0
        return run

    for mod, name, term in TERMS:
        setattr(mod, name, timed(getattr(mod, name), term))
    dflash.DFlashDrafter.__call__ = timed(dflash.DFlashDrafter.__call__, "draft")
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def step_terms(path: Path, args, device: torch.device, configs: list[tuple[str, list]]) -> dict[str, dict]:
    """label -> thread CPU ms a step of each term (one run over the prompts; these runs are not the
    table's timings: the wrappers cost a little)."""
    spec = load_spec(path)
    dirs = resolve_models(spec)
    lowered = lower_spec(spec, dirs, "float32" if device.type == "cpu" else spec.dtype)
    base, _ = run_passes(lowered, resolve_passes(spec, None))
    engine = build_engine(base, dirs.target, dirs.drafter, device)
    tokenizer = load_tokenizer(dirs.target)
    texts = load_prompts(spec.benchmark.prompts, args.num_prompts or spec.benchmark.num_prompts, source=str(path))
    prompts = [tokenizer.encode(t).ids for t in texts]
    n_new = args.max_new_tokens or spec.serving.max_new_tokens
    out = {}
    for label, ps in configs:
        e = engine.with_program(run_passes(lowered, ps)[0])
        e.generate(prompts[0][:8] or [0], 4)
        totals: dict[str, float] = defaultdict(float)
        t0 = time.thread_time()
        with timed_terms(totals):
            steps = sum(e.generate(p, n_new).steps for p in prompts)
        total = time.thread_time() - t0
        terms = {k: round(v * 1e3 / steps, 4) for k, v in totals.items()}
        terms["prefill, host and the rest"] = round((total - sum(totals.values())) * 1e3 / steps, 4)
        out[label] = {"steps": steps, "ms_per_step": round(total * 1e3 / steps, 4), "terms": terms}
        print(f"{path.name:>14} {label:<34} " + "  ".join(f"{k} {v:.2f}" for k, v in terms.items()), flush=True)
    return out


def ceilings(rows: list[dict], key: str) -> list[dict]:
    """Each two-level row against what a perfect first level keeping its N of M nodes reaches: τ of
    tree-M at the cost of tree-N (no first level)."""
    out = []
    for r in rows:
        if r["verify"] != "two-level":
            continue
        same = [t for t in rows if t["pipeline_file"] == r["pipeline_file"] and t["verify"] == "tree"]
        small = next((t for t in same if t["verify_q"] == r["verify_q"]), None)
        big = next((t for t in same if t["drafted"] == r["drafted"]), None)
        if small is None or big is None:
            continue
        ceiling = small[key] * big["tau"] / small["tau"]
        out.append({"pipeline_file": r["pipeline_file"], "label": r["label"], "by": key,
                    "ceiling_tau": big["tau"], "ceiling_gain": round(big["tau"] / small["tau"] - 1, 4),
                    "reached": round(r[key] / ceiling, 4)})
    return out


def batched_configs(args) -> list[tuple[str, str]]:
    """(label, pipeline string) of every batched configuration (module docstring), AR first."""
    n = int(args.budgets.split(",")[0])
    m = int(args.draft_factors.split(",")[0]) * n

    def two_level(first: str, layer: int = 0) -> str:
        extra = f", exit-layer={layer}" if layer else ""
        return f"two-level-verify{{budget={n}, draft-budget={m}, topk={args.topk}, first={first}{extra}}}"
    levels = [(f"two-level-{n}-drafter-m{m}", two_level("drafter"))]
    levels += [(f"two-level-{n}-{first}{layer}-m{m}", two_level(first, layer))
               for layer in (int(e) for e in args.exit_layers.split(",") if e)
               for first in (f for f in args.firsts.split(",") if f)]
    trees = sorted({n, *(int(b) for b in args.tree_budgets.split(",") if b)})
    out = [("ar", "")] + [(f"tree-{b}", f"tree-verify{{budget={b}, topk={args.topk}}},ragged-verify") for b in trees]
    out += [(label, f"{p},ragged-verify") for label, p in levels]
    if args.with_budget:
        out += [(f"{label}-vb", f"{p},verify-budget,ragged-verify") for label, p in levels]
    return out


def serve_timed(engine, prompts, c: int, requests: int, max_new: int) -> dict:
    """One served load (specpilot.bench.batch.serve) with the loop thread's CPU time beside the wall
    clock; decode = the run less its prefill forwards and the first tokens they commit."""
    from specpilot.bench.batch import serve
    from specpilot.runtime.batch import StepStats

    engine.stats = StepStats()
    cpu = time.thread_time()
    run = serve(engine, prompts, concurrency=c, requests=requests, max_new_tokens=max_new)
    cpu = time.thread_time() - cpu
    st = engine.stats
    tokens = run.tokens - st.prefill_tokens
    return {"tokens": tokens, "tokens_per_cpu_ms": tokens / max(1e-9, 1e3 * (cpu - st.prefill_cpu_s)),
            "tokens_per_ms": tokens / max(1e-9, 1e3 * (run.seconds - st.prefill_s)), "tau": st.tau,
            "steps": st.steps, "verify_rows_per_step": st.verify_rows / max(1, st.steps),
            "pruned_per_step": st.pruned_nodes / max(1, st.steps), "outputs": run.outputs}


def bench_batched(args, device: torch.device) -> tuple[list[dict], list[dict]]:
    """Rows of every (pair, concurrency, configuration), medians over the repeats; and each two-level
    row against the one-level tree of its budget N and the best one-level tree of at most N nodes at
    its concurrency, by tokens per CPU-ms on a CPU, per wall ms on a GPU (the issue's aim: +15%
    tokens/ms, τ within 3%)."""
    import statistics

    from specpilot.dsl import parse_pipeline
    from specpilot.hf.checkpoint import read_config
    from specpilot.ir import lower
    from specpilot.runtime.batch import generate_batched
    from specpilot.runtime.builtin import resolve_builtin

    sizes = [int(c) for c in args.concurrency.split(",")]
    configs = batched_configs(args)
    rows = []
    for pair in filter(None, args.zoo.split(",")):
        name = pair.split("/")[0]
        tdir, ddir = resolve_builtin(name), resolve_builtin(pair)
        dtype = "float32" if device.type == "cpu" else "bfloat16"
        stock = lower(read_config(tdir)[0], read_config(ddir)[0], dtype=dtype, batch=max(sizes))
        engine = build_engine(stock, tdir, ddir, device)
        tokenizer = load_tokenizer(tdir)
        texts = load_prompts(args.prompts, args.num_prompts or 8, source="bench.e2e.two_level")
        prompts = [tokenizer.encode(t).ids for t in texts]
        n_new = args.max_new_tokens or 64
        drafted = int(args.budgets.split(",")[0]) * int(args.draft_factors.split(",")[0])
        capacity = max(map(len, prompts)) + n_new + max(drafted, engine.block_size) + 2
        refs = generate_batched(engine.batched_ar(max_batch=len(prompts), capacity=capacity), prompts, n_new)
        for c in sizes:
            requests = max(2 * c, len(prompts))
            engines, cost = {}, None  # one step-cost table a concurrency: verify-budget rows choose alike
            for label, pipeline in configs:
                if label == "ar":
                    engines[label] = engine.batched_ar(max_batch=c, capacity=capacity)
                    continue
                program = run_passes(stock, parse_pipeline(pipeline, source="bench.e2e.two_level"))[0]
                engines[label] = engine.with_program(program).batched(max_batch=c, capacity=capacity, cost=cost)
                cost = cost or engines[label].policy.cost
            for eng in engines.values():  # warm: c requests of a few tokens, unmeasured
                serve_timed(eng, prompts, c, c, min(16, n_new))
            runs: dict[str, list[dict]] = defaultdict(list)
            load = [os.getloadavg()[0]]
            for _ in range(args.repeats):
                for label, _ in configs:
                    runs[label].append(serve_timed(engines[label], prompts, c, requests, n_new))
                load.append(os.getloadavg()[0])
            for label, pipeline in configs:
                got = runs[label]
                eng = engines[label]
                row = {"pair": pair, "concurrency": c, "label": label, "pipeline": pipeline, "requests": requests,
                       "first": getattr(eng, "first", None) if getattr(eng, "keep", None) else None,
                       "exit_layer": getattr(eng, "exit_layer", 0),
                       "verify_budget": bool(eng.policy.verify_budget),
                       **{k: round(statistics.median(r[k] for r in got), 4)
                          for k in ("tokens_per_cpu_ms", "tokens_per_ms", "tau", "verify_rows_per_step",
                                    "pruned_per_step", "steps")},
                       "tokens_per_cpu_ms_runs": [round(r["tokens_per_cpu_ms"], 4) for r in got],
                       "outputs_equal_batch1": min(sum(out == refs[i % len(prompts)] for i, out in r["outputs"].items())
                                                   for r in got),
                       "outputs": requests, "load_average_1m": [round(x, 2) for x in load]}
                rows.append(row)
                print(f"{pair:>18} c{c:<3} {label:<36} {row['tokens_per_cpu_ms']:8.4f} tok/CPU-ms "
                      f"{row['tokens_per_ms']:8.4f} tok/ms  τ {row['tau']:.3f}  rows/step {row['verify_rows_per_step']:7.1f}"
                      f"  = AR {row['outputs_equal_batch1']}/{requests}", flush=True)
    summary, key = [], "tokens_per_cpu_ms" if device.type == "cpu" else "tokens_per_ms"  # a GPU's: the wall clock
    for r in rows:
        if not r["label"].startswith("two-level"):
            continue
        same = [t for t in rows if (t["pair"], t["concurrency"]) == (r["pair"], r["concurrency"])
                and t["label"].startswith("tree-")]
        n = r["label"].split("-")[2]
        at_n = next(t for t in same if t["label"] == f"tree-{n}")
        best = max(same, key=lambda t: t[key])  # the best one-level tree of at most N nodes
        summary.append({"pair": r["pair"], "concurrency": r["concurrency"], "label": r["label"],
                        "against": at_n["label"], "best_tree": best["label"],
                        "gain_tokens_per_cpu_ms": round(r["tokens_per_cpu_ms"] / at_n["tokens_per_cpu_ms"] - 1, 4),
                        "gain_tokens_per_ms": round(r["tokens_per_ms"] / at_n["tokens_per_ms"] - 1, 4),
                        "tau_change": round(r["tau"] / at_n["tau"] - 1, 4),
                        "by": key, "gain_over_best_tree": round(r[key] / best[key] - 1, 4),
                        "tau_change_best_tree": round(r["tau"] / best["tau"] - 1, 4),
                        "aim_met": r[key] >= 1.15 * best[key] and r["tau"] >= 0.97 * best["tau"]})
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipelines", nargs="*", type=Path,
                        default=[ROOT / "examples" / "pipeline.yaml", ROOT / "examples" / "hybrid.yaml"])
    parser.add_argument("--budgets", default="16,32", help="verified nodes per step (trees; two-level survivors)")
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--draft-factors", default="2,4", help="a two-level step drafts F x budget nodes, each F")
    parser.add_argument("--exit-layers", default="1,2", help="early-exit first levels: target layers read")
    parser.add_argument("--firsts", default="early-exit,early-exit-drafter", help="early-exit first levels to run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (tiny models: 1 is fastest)")
    parser.add_argument("--max-new-tokens", type=int, help="override the spec's serving.max_new_tokens")
    parser.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    parser.add_argument("--no-terms", action="store_true", help="skip the per-term run")
    parser.add_argument("--concurrency", default="", help="batched: requests in flight, comma-separated (the "
                        "batched engine over --zoo instead of the pipelines' batch-1 loops)")
    parser.add_argument("--zoo", default="code-qwen3/dflash,code-qwen3/pard", help="batched: zoo pairs")
    parser.add_argument("--prompts", default="code-heldout", help="batched: prompt set")
    parser.add_argument("--with-budget", action="store_true", help="batched: each two-level row also under verify-budget")
    parser.add_argument("--tree-budgets", default="4,8", help="batched: one-level trees of fewer nodes beside tree-N "
                        "(the best one-level tree at budget N is the best of them)")
    args = harness.add_results_args(parser, smoke=False).parse_args(argv)
    args.graphs = False  # bench_pipeline's flag: eager loops only (two-level steps are not graphed)

    device = pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if args.concurrency:
        rows, summary = bench_batched(args, device)
        for s in summary:
            print(f"{s['pair']:>18} c{s['concurrency']:<3} {s['label']:<38} vs {s['against']:<8} "
                  f"tokens/CPU-ms {s['gain_tokens_per_cpu_ms']:+.1%}  tokens/ms {s['gain_tokens_per_ms']:+.1%}  "
                  f"τ {s['tau_change']:+.1%}; vs the best tree ({s['best_tree']}) by {s['by']} {s['gain_over_best_tree']:+.1%}, "
                  f"τ {s['tau_change_best_tree']:+.1%}  aim {'met' if s['aim_met'] else 'not met'}")
        out = harness.write_run(
            args, "two_level_batched", device, rows, against_best_tree=summary,
            what="the batched engine on the zoo pairs: two-level-verify's first levels (the drafter's and the early "
                 "exits', budget batch-wide) against tree-verify at the same verify budget a request and batched AR, "
                 "ragged-verify throughout, greedy; tokens = decode tokens (prefill forwards and their first tokens "
                 "out)",
            timing=f"median of {args.repeats} interleaved runs of each load; tokens_per_cpu_ms per ms of the loop "
                   "thread's CPU time, tokens_per_ms per wall ms",
            threads=torch.get_num_threads() if device.type == "cpu" else None,
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
            load_average=os.getloadavg() if device.type == "cpu" else None)
        print(f"wrote {out}")
        return 0
    budgets = [int(b) for b in args.budgets.split(",")]
    rows, terms = [], {}
    for path in args.pipelines:
        rows += bench_pipeline(path, args, device, configure)
        if not args.no_terms:
            passes = resolve_passes(load_spec(path), None)
            terms[str(path)] = step_terms(path, args, device, configure(passes, budgets, args))
    key = "tokens_per_cpu_ms" if device.type == "cpu" else "tokens_per_ms"
    summary, ceiling = against_best_tree(rows, key), ceilings(rows, key)
    for s, c in zip(summary, ceiling):
        print(f"{Path(s['pipeline_file']).name:>14} {s['label']:<34} vs {s['against']:<8} {s['by']} {s['gain']:+.1%}  "
              f"τ {s['tau_change']:+.1%}  (a perfect first level: τ {c['ceiling_gain']:+.1%}; reached {c['reached']:.1%} "
              f"of its tokens/ms)")
    out = harness.write_run(
        args, "two_level", device, rows, against_best_tree=summary, ceiling=ceiling, step_terms=terms,
        what="τ and accepted tokens/ms of two-level-verify{budget=N, draft-budget=F*N, first, exit-layer} against "
             "tree-verify{budget=N} and tree-verify{budget=F*N} (a perfect first level's τ), torch backend (eager "
             "loops), greedy, prefill excluded; step_terms: thread CPU ms a step of each term, one separate run",
        timing=f"runtime clocks, median of {args.repeats} interleaved runs over all prompts; on a CPU also the loop "
               "thread's CPU time (prefill included)",
        threads=torch.get_num_threads() if device.type == "cpu" else None,
        load_average=os.getloadavg() if device.type == "cpu" else None)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
