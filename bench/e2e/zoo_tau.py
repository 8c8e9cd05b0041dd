"""τ and per-position acceptance of the zoo's drafters on each prompt set, through `compile`.

    python -m bench.e2e.zoo_tau [--pair code-qwen3] [--drafters dflash,pard] [--passes cuda-graphs]
                                [--prompt-sets humaneval,code-heldout] [--variant NAME=PASSES ...]
                                [--num-prompts 16] [--max-new-tokens 64] [--device auto] [--out FILE|DIR] [--tag TAG]

For each drafter (dflash, pard), prompt set (humaneval, code-heldout; `ifeval`, the chat set, goes
through the target's chat template) and variant the whole compile pipeline runs (no engine
written): the variant's passes, by default one variant `chain` of `--passes` (the drafter's trained
block size unless they set one); `--variant tree=tree-verify{budget=32,topk=4},cuda-graphs` adds one.
τ counts the bonus token, the histogram counts steps by accepted drafts, every output token is
token-forced; the speedup is over the compile's AR baseline (on a GPU the graphed loop over the fused
decoder stack, on the CPU the static-cache loop). A pair built in by name works too
(`--pair smollm2-135m-instruct`). Writes bench/results/zoo_tau_<gpu|cpu>[_<tag>].json through the harness.
"""

from __future__ import annotations

import argparse
import sys

from specpilot.bench import harness
from specpilot.compiler import compile_pipeline
from specpilot.spec import parse_spec

PROMPT_SETS = ("humaneval", "code-heldout")


def compile_zoo(pair: str, kind: str, prompts: str, num_prompts: int, max_new_tokens: int, passes: str,
                device: str, source: str):
    """The whole compile pipeline on the zoo pair's `kind` drafter over one prompt set, no engine written."""
    spec = parse_spec({"name": f"{pair}-{kind}-{prompts}", "target": pair, "drafter": {"kind": kind},
                       "serving": {"max_new_tokens": max_new_tokens},
                       "benchmark": {"prompts": prompts, "num_prompts": num_prompts},
                       **({"passes": passes} if passes else {})}, source)
    return compile_pipeline(spec, out_dir=None, device=device)


def tau_row(r, kind: str, prompts: str) -> dict:
    """A results row of a compile: τ, acceptance, speedup and token forcing."""
    rep = r.report
    return {"drafter": kind, "pipeline": rep["pipeline"], "block_size": rep["drafter"]["block_size"], "prompts": prompts,
            "num_prompts": rep["prompts"], "max_new_tokens": rep["max_new_tokens"], "tau": rep["tau"],
            "acceptance_histogram": rep["acceptance_histogram"], "ar_ms_per_token": rep["ar_ms_per_token"],
            "engine_ms_per_token": rep["engine_ms_per_token"], "speedup_over_ar": rep["speedup_over_ar"],
            "outputs_equal_ar": rep["outputs_equal_ar"], "token_forcing": rep["token_forcing"]}


def variants(args) -> list[tuple[str, str]]:
    """(name, passes) of each --variant NAME=PASSES, else the one variant `chain` of --passes."""
    out = []
    for v in args.variant or [f"chain={args.passes}"]:
        name, sep, passes = v.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant {v!r}: expected NAME=PASSES (e.g. tree=tree-verify{{budget=32}})")
        out.append((name, passes))
    return out


def zoo_arguments(ap: argparse.ArgumentParser, num_prompts: int, passes_help: str) -> None:
    """The options of a script that compiles a zoo pair's drafters (`compile_zoo`) and writes a results file
    (the harness's --out and --tag)."""
    ap.add_argument("--pair", default="code-qwen3")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--drafters", default="dflash,pard", help="comma-separated drafter kinds of the pair")
    ap.add_argument("--passes", default="", help=passes_help)
    harness.add_results_args(ap, smoke=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo_arguments(ap, 16, "a pass pipeline for every compile (e.g. cuda-graphs on a GPU)")
    ap.add_argument("--prompt-sets", default=",".join(PROMPT_SETS), help="comma-separated prompt sets (ifeval: chat)")
    ap.add_argument("--variant", action="append", metavar="NAME=PASSES",
                    help="a named pass pipeline to compile each drafter and set with (repeatable; default chain=--passes)")
    args = ap.parse_args(argv)
    rows, env = [], {}
    for kind in args.drafters.split(","):
        for prompts in args.prompt_sets.split(","):
            for variant, passes in variants(args):
                r = compile_zoo(args.pair, kind, prompts, args.num_prompts, args.max_new_tokens, passes, args.device,
                                "zoo_tau")
                env = r.report["environment"]
                rows.append({"variant": variant, **tau_row(r, kind, prompts)})
                print(f"{kind:7} {prompts:13} {variant:8} τ {rows[-1]['tau']:.3f}  speedup "
                      f"{rows[-1]['speedup_over_ar']:.2f}x  {rows[-1]['token_forcing']}", flush=True)
    print(f"-> {harness.write_run(args, 'zoo_tau', env.get('device', 'cpu'), rows, pair=args.pair)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
