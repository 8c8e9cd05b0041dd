"""A DFlash drafter's τ two ways on the same prompts: measured by specpilot's decode loop, and
estimated offline by the training forward (train.drafters.dflash_block_logits) over the AR output,
every anchor, as the training scripts' validation estimates it. If they agree, a gap between a
drafter card's validation τ and its measured τ is the data's, not a training/inference mismatch.

    OMP_NUM_THREADS=1 python -m bench.e2e.offline_tau --pair code-qwen3    # -> bench/results/offline_tau_cpu_<pair>.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.decode import generate_ar, generate_dflash
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tokenizer import load_tokenizer
from train.drafters import accepted_prefix, dflash_block_labels, dflash_block_logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="code-qwen3", help="a built-in pair with a DFlash drafter")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--num-prompts", type=int, default=6, help="prompts spread over the set")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    args = harness.add_results_args(ap).parse_args(argv)
    if args.smoke:
        args.num_prompts, args.max_new_tokens = 1, 24
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target_dir = resolve_builtin(args.pair)
    target, cfg = load_target(target_dir, dtype=dtype, device=device)
    drafter = load_drafter(resolve_builtin(f"{args.pair}/dflash"), target, cfg, dtype=dtype, device=device)
    tok = load_tokenizer(target_dir)
    texts = load_prompts(args.prompts)
    step = max(1, len(texts) // args.num_prompts)
    texts = texts[::step][: args.num_prompts]
    s = drafter.block_size
    rows, loop_accepted, loop_steps, corrects = [], 0, 0, []
    for text in texts:
        ids = tok.encode(text).ids
        ar = generate_ar(target, ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
        loop = generate_dflash(target, drafter, ids, block_size=s, mask_token_id=drafter.mask_token_id,
                               max_new_tokens=args.max_new_tokens, eos_token_id=None)
        loop_accepted, loop_steps = loop_accepted + sum(loop.accepted), loop_steps + loop.steps
        seq = torch.tensor([ids + ar.tokens], device=device)
        with torch.inference_mode():
            hidden = target(seq, target.new_cache(*seq.shape), hidden_layers=tuple(drafter.target_layer_ids),
                            only_last=True).hidden
            anchors = torch.arange(len(ids), seq.shape[1] - s + 1, device=device)[None]
            correct = (dflash_block_logits(drafter, hidden, seq, anchors).argmax(-1)
                       == dflash_block_labels(seq, anchors, s))[0]
        corrects.append(correct)
        rows.append({"prompt_tokens": len(ids), "loop_tau": round(loop.tau, 4), "loop_equals_ar": loop.tokens == ar.tokens,
                     "offline_tau": round(1 + accepted_prefix(correct).float().mean().item(), 4)})
        print(f"prompt of {len(ids)} tokens: loop τ {loop.tau:.2f}, offline {rows[-1]['offline_tau']:.2f}", flush=True)
    every = torch.cat(corrects)
    summary = {"loop_tau": round(1 + loop_accepted / max(1, loop_steps), 4),
               "offline_tau": round(1 + accepted_prefix(every).float().mean().item(), 4),
               "accuracy_by_draft": [round(x, 3) for x in every.float().mean(0).tolist()]}
    print(f"loop τ {summary['loop_tau']:.3f}, offline estimate {summary['offline_tau']:.3f}")
    args.tag = args.tag or args.pair
    out = None if args.smoke else harness.write_run(args, "offline_tau", device, rows, **summary)
    print(f"wrote {out}" if out else "smoke run: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
