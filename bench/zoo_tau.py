"""τ and per-position acceptance of the zoo's drafters on each prompt set, through `compile`.

    python bench/zoo_tau.py [--pair code-qwen3] [--drafters dflash,pard] [--passes cuda-graphs]
                            [--num-prompts 16] [--max-new-tokens 64] [--device auto]

For each drafter (dflash, pard) and prompt set (humaneval, code-heldout) the whole compile
pipeline runs (chain at the drafter's trained block size, plus `--passes`, no engine written): τ counts the
bonus token, the histogram counts steps by accepted drafts, every output token is token-forced.
Writes bench/results/zoo_tau_<device>.json (device "cpu" or the GPU's name) with versions and commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specpilot.compiler import compile_pipeline
from specpilot.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent
PROMPT_SETS = ("humaneval", "code-heldout")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="code-qwen3")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--drafters", default="dflash,pard", help="comma-separated drafter kinds of the pair")
    ap.add_argument("--passes", default="", help="a pass pipeline for every compile (e.g. cuda-graphs on a GPU)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows, env = [], None
    for kind in args.drafters.split(","):
        for prompts in PROMPT_SETS:
            spec = parse_spec({"name": f"{args.pair}-{kind}-{prompts}", "target": args.pair, "drafter": {"kind": kind},
                               "serving": {"max_new_tokens": args.max_new_tokens},
                               "benchmark": {"prompts": prompts, "num_prompts": args.num_prompts},
                               **({"passes": args.passes} if args.passes else {})}, "zoo_tau")
            r = compile_pipeline(spec, out_dir=None, device=args.device)
            env = r.report["environment"]
            rows.append({"drafter": kind, "pipeline": r.report["pipeline"], "block_size": r.report["drafter"]["block_size"], "prompts": prompts,
                         "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                         "tau": r.report["tau"], "acceptance_histogram": r.report["acceptance_histogram"],
                         "speedup_over_ar": r.report["speedup_over_ar"], "outputs_equal_ar": r.report["outputs_equal_ar"],
                         "token_forcing": r.report["token_forcing"]})
            print(f"{kind:7} {prompts:13} τ {rows[-1]['tau']:.3f}  speedup {rows[-1]['speedup_over_ar']:.2f}x  "
                  f"{rows[-1]['token_forcing']}", flush=True)
    device = env.get("gpu_name", "cpu") if env else "cpu"
    slug = "cpu" if device == "cpu" else device.lower().replace(" ", "_")
    out = args.out or ROOT / "bench" / "results" / f"zoo_tau_{slug}.json"
    out.write_text(json.dumps({"pair": args.pair, "environment": env, "rows": rows}, indent=2) + "\n")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
