"""Batched speculative decoding against batched AR, concurrency 1..64, with an ablation of each mechanism.

    python -m bench.e2e.batched [--profile dflash-qwen3-8b] [--benchmark humaneval]
                                [--concurrency 1,2,4,8,16,32,64]
                                [--variants all,tree,no-budget,no-ragged,no-control,none]
                                [--zoo code-qwen3/dflash,code-qwen3/pard] [--num-prompts 8] [--max-new-tokens 64]
                                [--budget-s 270] [--graphs] [--out FILE|DIR] [--tag TAG] [--smoke]
    python -m bench.e2e.batched --cpu [--concurrency 1,2,4,8,16] ...   # the zoo pairs measured on the CPU

8B shapes: the profile's target with random bf16 weights and a replay DFlash drafter of its shape
(runtime/batch_replay.py: per-request plans drawn from the profile, following each prompt's batched
AR output), served by the batched engine (runtime/batch.py: continuous batching, ragged packed
verification on split-KV's ragged mode). Variants are the schedule's mechanisms (passes): `all` =
verify-budget, ragged-verify, spec-control; `no-budget`, `no-ragged`, `no-control` each leave one
out; `none` keeps just the batched engine (every request verifies its whole block); `tree` verifies
each request's best-first tree of 15 nodes (top-4) instead of its chain, packed raggedly: 16 rows a
request with the anchor, DFlash's block, so the same power-of-two buckets (the profile's tree accept
lengths; verify-budget and spec-control do not apply to one-level trees). The baseline at
each concurrency is batched AR on the same runtime (no drafter). Per row: tokens/s, mean and p90
latency, τ (tokens a speculating request commits a step), verify rows a step, AR steps (speculation
off for the whole batch), the speedup over batched AR, and the outputs of `all` and `tree` token-forced.

Zoo pairs (--zoo): the trained code-qwen3 drafters with their own acceptance, `all` and `none`; the
hybrid pair too (`--zoo code-qwen3-next/dflash`: Gated DeltaNet layers, runtime/batch_hybrid.py; eager,
so not with --graphs).

Aims (issue 45, DFlash's HumanEval profile at 8B on the H200): >= 4.0x over batched AR at c8, >= 3.0x
at c32, never below 1.0x. The summary says met or not. Writes bench/results/batched_<gpu>.json.
--graphs: the verify forwards of both engines and the speculative engine's drafter forwards (DFlash's context
update and block pass, PARD's forward and head) as CUDA-graph replays by shape (runtime/batch.py: GraphedVerify,
GraphedDraft), and the `tree` variant's greedy tree step (trees built on the device, verify, acceptance and KV
compaction) a replay a shape (GraphedVerify.tree); prefill, the chains' acceptance, the replay draft hook and the
host bookkeeping stay eager; each row counts its graphs and its forwards (`graphs`) -> batched_<gpu>_graphs.json.
--smoke: the tiny shapes on the CPU (fp32), two concurrencies: checks the script, measures nothing.
--cpu: a measurement on the CPU (fp32) of the zoo pairs only (8B shapes do not fit a CPU's time), every
variant -> batched_cpu.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from specpilot.backends.torch_backend import ReplaySetup, ShapeModels, build_engine
from specpilot.bench import harness
from specpilot.bench.batch import measure_batches
from specpilot.bench.prompts import load_prompts
from specpilot.dsl import parse_pipeline
from specpilot.hf.checkpoint import read_config
from specpilot.hf.known import dflash_config, model_config
from specpilot.ir import lower
from specpilot.passes import run_passes
from specpilot.runtime.batch import generate_batched
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.validate.forcing import force_tokens

VARIANTS = {"all": "verify-budget,ragged-verify,spec-control", "tree": "tree-verify{budget=15, topk=4},ragged-verify",
            "no-budget": "ragged-verify,spec-control", "no-ragged": "verify-budget,spec-control",
            "no-control": "verify-budget,ragged-verify", "none": ""}
AIMS = {8: 4.0, 32: 3.0}  # concurrency -> speedup over batched AR, DFlash HumanEval at 8B on the H200
AIM_PROFILE = ("dflash-qwen3-8b", "humaneval")
GRAPHED = ("CUDA graphs: the verify forward (target layers, head, argmax) a replay a (token bucket, rows a request), "
           "both engines; the drafter's forwards a replay a shape (DFlash: context-feature update a token bucket, "
           "block pass a padded request count; PARD: forward and head a token bucket, rows a request, padded request "
           "count); the tree variant's greedy step (trees built on the device by the best-first kernel over the "
           "drafter's top-k, the verify under their ancestor masks, tree acceptance and KV compaction) a replay a "
           "(token bucket, nodes a request rounded up to a power of two, draft positions); eager: prefill, the "
           "chains' commit, the drafts' top-k, the replay draft hook, spec control and verify-budget, one host read "
           "a step (accepted counts, bonus tokens and drafts or tree paths together; a second, the drafter's "
           "confidences, only under verify-budget's confidence survival)")


def run_variants(engine, stock, prompts, guesses, sizes, variants, args, label: dict, dtype: str) -> list[dict]:
    rows, ar_runs = [], {}  # batched AR measured once a concurrency, shared by the variants
    for variant in variants:
        if time.perf_counter() - args.started > args.budget_s:
            rows.append({**label, "variant": variant, "skipped": "over the time budget"})
            continue
        passes = VARIANTS[variant]
        program = run_passes(stock, parse_pipeline(passes, source="--variants"))[0] if passes else stock
        eng = engine.with_program(program)
        got = measure_batches(eng, prompts, guesses, sizes, args.max_new_tokens, graphs=args.graphs, ar_runs=ar_runs)
        check = {}
        if variant in ("all", "tree"):
            report = force_tokens(engine.target, engine.target_cfg, got["prompts"], got["outputs"], dtype)
            check = {"token_forcing": report.summary(), "passed": report.passed, "tokens_checked": report.tokens_checked}
        for r in got["rows"]:
            rows.append({**label, "variant": variant, "pipeline": passes, **r, **check})
            print(f"{label.get('profile') or label.get('pair')} {variant:10} c{r['concurrency']:<3} "
                  f"{r['spec']['tokens_per_s']:10.1f} tok/s (AR {r['ar']['tokens_per_s']:10.1f})  "
                  f"x{r['speedup_over_batched_ar']:.3f}  τ {r['spec']['tau']:.3f}", flush=True)
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_profile(args, sizes, device, dtype) -> list[dict]:
    from specpilot.profiles import load_profile

    profile = load_profile(args.profile)
    benchmark = args.benchmark or profile.default_benchmark
    profile.check(benchmark)
    shape = args.target or profile.target
    models = ShapeModels(model_config(shape), dflash_config(shape), ReplaySetup(args.profile, benchmark, args.seed),
                         seed=args.seed)
    stock = lower(models.target_cfg, models.drafter_cfg, dtype=dtype, batch=max(sizes))
    engine = build_engine(stock, None, None, device, shape=models)
    tokenizer = models.tokenizer()
    prompts = [tokenizer.encode(t).ids for t in load_prompts(args.prompts, args.num_prompts, source="bench.e2e.batched")]
    capacity = max(map(len, prompts)) + args.max_new_tokens + engine.block_size + 2
    guesses = generate_batched(engine.batched_ar(max_batch=len(prompts), capacity=capacity), prompts,
                               args.max_new_tokens)
    label = {"profile": args.profile, "benchmark": benchmark, "target": shape, "profile_tau": profile.tau(benchmark)}
    return run_variants(engine, stock, prompts, guesses, sizes, args.variants.split(","), args, label, dtype)


def bench_zoo(args, sizes, device, dtype) -> list[dict]:
    rows = []
    for pair in filter(None, args.zoo.split(",")):
        name, kind = pair.split("/")
        tdir, ddir = resolve_builtin(name), resolve_builtin(pair)
        stock = lower(read_config(tdir)[0], read_config(ddir)[0], dtype=dtype, batch=max(sizes))
        engine = build_engine(stock, tdir, ddir, device)
        tok = load_tokenizer(tdir)
        prompts = [tok.encode(t).ids for t in load_prompts("code-heldout", args.num_prompts, source="bench.e2e.batched")]
        capacity = max(map(len, prompts)) + args.max_new_tokens + engine.block_size + 2
        guesses = generate_batched(engine.batched_ar(max_batch=len(prompts), capacity=capacity), prompts,
                                   args.max_new_tokens)
        variants = args.variants.split(",") if args.cpu else ["all", "none"]
        rows += run_variants(engine, stock, prompts, guesses, sizes, variants, args, {"pair": pair}, dtype)
    return rows


def aims(rows: list[dict]) -> dict:
    named = [r for r in rows if (r.get("profile"), r.get("benchmark")) == AIM_PROFILE and r.get("variant") == "all"
             and "speedup_over_batched_ar" in r]
    out = {}
    for c, aim in AIMS.items():
        hit = [r for r in named if r["concurrency"] == c]
        if hit:
            out[f"c{c}"] = {"aim": aim, "speedup": hit[0]["speedup_over_batched_ar"],
                            "met": hit[0]["speedup_over_batched_ar"] >= aim}
    if named:
        worst = min(named, key=lambda r: r["speedup_over_batched_ar"])
        out["never_below_1"] = {"worst": worst["speedup_over_batched_ar"], "at": worst["concurrency"],
                                "met": worst["speedup_over_batched_ar"] >= 1.0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="dflash-qwen3-8b")
    ap.add_argument("--benchmark", default="humaneval")
    ap.add_argument("--target", help="the target's shape (default: the profile's)")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--zoo", default="code-qwen3/dflash,code-qwen3/pard", help="zoo pairs (empty: none)")
    ap.add_argument("--prompts", default="code-heldout")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=270.0, help="start no variant past this many seconds")
    ap.add_argument("--graphs", action="store_true", help="verify forwards (and batched AR's) and drafter forwards as "
                    "CUDA-graph replays by shape; write batched_<gpu>_graphs.json unless --tag says otherwise")
    ap.add_argument("--cpu", action="store_true", help="measure the zoo pairs on the CPU (fp32): no 8B profile")
    args = harness.add_results_args(ap).parse_args(argv)
    if args.cpu and not args.smoke:
        args.profile = ""
    if args.smoke:
        torch.set_num_threads(1)
        args.target, args.concurrency, args.variants, args.prompts = "tiny", "1,3", "all,tree,none", "code-smoke"
        args.num_prompts, args.max_new_tokens, args.zoo = 2, 12, "code-qwen3/dflash"
    why = harness.refuse_device("bench.e2e.batched", args.smoke or args.cpu, interpreter=False)
    if why:
        print(why, file=sys.stderr)
        return 2
    on_cpu = args.smoke or args.cpu
    device = torch.device("cpu" if on_cpu else "cuda")
    dtype = "float32" if on_cpu else "bfloat16"
    sizes = [int(c) for c in args.concurrency.split(",")]
    args.started = time.perf_counter()
    args.tag = args.tag or ("graphs" if args.graphs else "")
    rows = bench_profile(args, sizes, device, dtype) if args.profile else []
    rows += bench_zoo(args, sizes, device, dtype)
    out = harness.write_run(args, "batched", device, rows, aims=aims(rows), wall_s=time.perf_counter() - args.started,
                            method="continuous batching: c requests in flight, 2c (at least the prompts) served, "
                                   "prompts cycled; speedup in decode tokens/s (prefill forwards and their first "
                                   "tokens left out), the whole run's tokens/s beside it; AR = the batched runtime "
                                   "with no drafter, same attention; "
                                   + (GRAPHED if args.graphs else "eager steps (no CUDA graphs)"))
    print(f"\n{harness.device_name(device)}: {len(rows)} rows -> {out or 'no file (--smoke)'}")
    for name, a in aims(rows).items():
        print(f"  {name}: {a}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
