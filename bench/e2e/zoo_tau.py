"""τ and per-position acceptance of the zoo's drafters on each prompt set, through `compile`.

    python -m bench.e2e.zoo_tau [--pair code-qwen3] [--drafters dflash,pard] [--passes cuda-graphs]
                                [--num-prompts 16] [--max-new-tokens 64] [--device auto] [--out FILE|DIR] [--tag TAG]

For each drafter (dflash, pard) and prompt set (humaneval, code-heldout) the whole compile
pipeline runs (chain at the drafter's trained block size, plus `--passes`, no engine written): τ counts the
bonus token, the histogram counts steps by accepted drafts, every output token is token-forced.
Writes bench/results/zoo_tau_<gpu|cpu>[_<tag>].json through the harness.
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
            "acceptance_histogram": rep["acceptance_histogram"], "speedup_over_ar": rep["speedup_over_ar"],
            "outputs_equal_ar": rep["outputs_equal_ar"], "token_forcing": rep["token_forcing"]}


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
    args = ap.parse_args(argv)
    rows, env = [], {}
    for kind in args.drafters.split(","):
        for prompts in PROMPT_SETS:
            r = compile_zoo(args.pair, kind, prompts, args.num_prompts, args.max_new_tokens, args.passes, args.device,
                            "zoo_tau")
            env = r.report["environment"]
            rows.append(tau_row(r, kind, prompts))
            print(f"{kind:7} {prompts:13} τ {rows[-1]['tau']:.3f}  speedup {rows[-1]['speedup_over_ar']:.2f}x  "
                  f"{rows[-1]['token_forcing']}", flush=True)
    print(f"-> {harness.write_run(args, 'zoo_tau', env.get('device', 'cpu'), rows, pair=args.pair)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
