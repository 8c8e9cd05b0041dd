"""τ of the zoo's drafters with their heads over a token subset (the draft-vocab pass), through `compile`.

    python -m bench.e2e.draft_vocab [--pair code-qwen3] [--sizes 0,4096,2048,1024,512,256] [--corpus stdlib]
                                    [--num-prompts 8] [--max-new-tokens 64] [--device auto] [--passes ...]
                                    [--out FILE|DIR] [--tag TAG]

For each drafter (dflash, pard), subset size (0: the whole vocabulary, no pass) and prompt set
(humaneval, code-heldout) the whole compile pipeline runs: chain at the drafter's trained block
size, `draft-vocab{size=N, corpus=C}`, then `--passes`; no engine is written. Recorded: τ, the
corpus share the subset covers, and token forcing of every output token (the pass must stay
lossless). The subset comes from the corpus, never from the prompts. Writes
bench/results/draft_vocab_<gpu|cpu>[_<tag>].json through the harness. The step time a subset saves
at 8B shapes is bench.steps.step_times' `fused-vocab` draft row.
"""

from __future__ import annotations

import argparse
import sys

from bench.e2e.zoo_tau import PROMPT_SETS, compile_zoo, tau_row, zoo_arguments
from specpilot.bench import harness
from specpilot.runtime.draft_vocab import STDLIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo_arguments(ap, 8, "passes after draft-vocab (e.g. cuda-graphs on a GPU)")
    ap.add_argument("--sizes", default="0,4096,2048,1024,512,256", help="subset sizes; 0 = the whole vocabulary")
    ap.add_argument("--corpus", default=STDLIB)
    args = ap.parse_args(argv)
    rows, env = [], {}
    print(f"{'drafter':8} {'size':>6} {'prompts':13} {'coverage':>8} {'τ':>6}  outputs = AR  token forcing", flush=True)
    for kind in args.drafters.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            pipeline = ", ".join(p for p in (f'draft-vocab{{size={size}, corpus="{args.corpus}"}}' if size else "",
                                             args.passes) if p)
            for prompts in PROMPT_SETS:
                r = compile_zoo(args.pair, kind, prompts, args.num_prompts, args.max_new_tokens, pipeline, args.device,
                                "draft_vocab")
                env = r.report["environment"]
                subset = r.report["drafter"].get("vocab_subset")
                rows.append({**tau_row(r, kind, prompts), "size": size, "corpus": args.corpus if size else None,
                             "corpus_coverage": subset["corpus_coverage"] if subset else 1.0,
                             "passed": r.validation.passed})
                row = rows[-1]
                print(f"{kind:8} {size or 'all':>6} {prompts:13} {row['corpus_coverage']:8.4f} {row['tau']:6.3f}  "
                      f"{row['outputs_equal_ar']:>12}  {row['token_forcing']}", flush=True)
    out = harness.write_run(args, "draft_vocab", env.get("device", "cpu"), rows, pair=args.pair, corpus=args.corpus)
    print(f"-> {out}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
