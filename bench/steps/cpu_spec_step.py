"""What one AR step and one DFlash chain step cost on the CPU, term by term, through the engine the
compile pipeline builds (prepare + build_engine, as bench.e2e.zoo_tau compiles it).

    OMP_NUM_THREADS=1 python -m bench.steps.cpu_spec_step --pair smollm2-135m-instruct \\
        --passes "draft-block-size{size=4},draft-vocab{size=2048}" [--num-prompts 4] [--max-new-tokens 64] [--tag TAG]
    python -m bench.steps.cpu_spec_step --smoke      # the tiny pair: checks the script, writes nothing

Per prompt (humaneval), the AR loop and the chain loop of `decode.generate_dflash` run step by step
here, the same calls in the same order, with a timer around each term:

  AR:    ar_layers (the target's forward less its head), ar_head (lm_head at 1 row), ar_pick (argmax,
         to the host, the output's bookkeeping);
  chain: draft_context (the drafter's context K/V for the tokens the last step committed), draft_block
         (its block pass: embedding, layers, norm), draft_head (its lm_head, over the draft vocabulary
         where draft-vocab set one), draft_pick (argmax of the drafts), verify_layers (the target over
         [last token, drafts], hidden states at the drafter's layers included), verify_head (lm_head
         at the verify's rows), accept (argmax to the host, greedy acceptance, the output's
         bookkeeping), commit (cache rollback, the next context's slice).
  host:  a step's wall time less its terms (the timers' own gaps; each term holds its own Python).

Terms are means over every step of every prompt (so they add up to the mean step); the whole loops
(`Engine.generate_ar`, `Engine.generate`) are timed too, interleaved prompt by prompt, and their
outputs must equal the step-by-step ones. Writes bench/results/cpu_spec_step_cpu[_<tag>].json with the
load average before and after (the CPU is shared: say so beside any number).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from specpilot.backends.torch_backend import build_engine
from specpilot.bench import harness
from specpilot.compiler import prepare
from specpilot.runtime.decode import OutputTokens, accept_greedy, prompt_tensor
from specpilot.spec import parse_spec


class Timers:
    """Seconds by term, summed within a step; `step()` closes a step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def timed(self, term: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.now[term] += time.perf_counter() - t
            return out
        return run

    def step(self, wall: float) -> None:
        terms = dict(self.now)
        terms["host"] = wall - sum(terms.values())
        terms["step"] = wall
        self.steps.append(terms)
        self.now = defaultdict(float)


def _timed_head(model, timers: Timers, term: str):
    """Route a model's `head` through a timer (an instance attribute over the method); returns the undo."""
    model.head = timers.timed(term, type(model).head.__get__(model))
    return lambda: delattr(model, "head")


def ar_steps(engine, prompt: list[int], max_new_tokens: int, timers: Timers) -> list[int]:
    """decode.generate_ar's greedy loop, its terms timed."""
    target = engine.target
    out = OutputTokens(max_new_tokens, engine.eos_token_id)
    with torch.inference_mode():
        ids = prompt_tensor(prompt, target.device)
        cache = target.new_cache(1, ids.shape[1] + max_new_tokens)
        token = target(ids, cache, only_last=True).logits[:, -1].argmax(-1, keepdim=True)
        out.extend(token[0].tolist())
        undo = _timed_head(target, timers, "ar_head")
        try:
            while not out.done:
                t0 = time.perf_counter()
                logits = target(token, cache).logits
                t1 = time.perf_counter()
                token = logits[:, -1].argmax(-1, keepdim=True)
                out.extend(token[0].tolist())
                t2 = time.perf_counter()
                timers.now["ar_layers"] += t1 - t0 - timers.now["ar_head"]
                timers.now["ar_pick"] += t2 - t1
                timers.step(t2 - t0)
        finally:
            undo()
    return out.tokens


def chain_steps(engine, prompt: list[int], max_new_tokens: int, timers: Timers) -> tuple[list[int], list[int]]:
    """decode.generate_dflash's greedy chain loop, its terms timed: (tokens, accepted drafts a step)."""
    target, drafter, block_size = engine.target, engine.drafter, engine.block_size
    layers = tuple(drafter.target_layer_ids)
    out = OutputTokens(max_new_tokens, engine.eos_token_id)
    accepted: list[int] = []
    with torch.inference_mode():
        ids = prompt_tensor(prompt, target.device)
        capacity = ids.shape[1] + max_new_tokens + block_size + 1
        t_cache, d_cache = target.new_cache(1, capacity), drafter.new_cache(1, capacity)
        pre = target(ids, t_cache, hidden_layers=layers, only_last=True)
        first = int(pre.logits[0, -1].argmax())
        drafter.add_context(pre.hidden, d_cache)
        new_context = pre.hidden[:, :0]
        seq = ids[0].tolist()
        out.extend([first])
        seq.append(first)
        masks = [drafter.mask_token_id] * (block_size - 1)
        undo_draft = _timed_head(drafter, timers, "draft_head")
        undo = _timed_head(target, timers, "verify_head")
        try:
            while not out.done:
                t0 = time.perf_counter()
                drafter.add_context(new_context, d_cache)
                t1 = time.perf_counter()
                block = torch.tensor([[seq[-1]] + masks], dtype=torch.long, device=target.device)
                draft_logits = drafter(block, new_context[:, :0], d_cache)[0]
                t2 = time.perf_counter()
                drafts = draft_logits.argmax(-1)
                t3 = time.perf_counter()
                start = t_cache.length
                verify = torch.cat([drafts.new_tensor([seq[-1]]), drafts])[None]
                v = target(verify, t_cache, hidden_layers=layers)
                t4 = time.perf_counter()
                target_argmax = v.logits[0].argmax(-1).tolist()
                draft_list = drafts.tolist()
                n = accept_greedy(draft_list, target_argmax)
                span = draft_list[:n] + [target_argmax[n]]
                accepted.append(out.extend(span) - 1)
                t5 = time.perf_counter()
                t_cache.rollback(start + 1 + n)
                new_context = v.hidden[:, : n + 1]
                seq.extend(span)
                t6 = time.perf_counter()
                now = timers.now
                now["draft_context"] += t1 - t0
                now["draft_block"] += t2 - t1 - now["draft_head"]
                now["draft_pick"] += t3 - t2
                now["verify_layers"] += t4 - t3 - now["verify_head"]
                now["accept"] += t5 - t4
                now["commit"] += t6 - t5
                timers.step(t6 - t0)
        finally:
            undo_draft()
            undo()
    return out.tokens, accepted


AR_TERMS = ("ar_layers", "ar_head", "ar_pick")
CHAIN_TERMS = ("draft_context", "draft_block", "draft_head", "draft_pick", "verify_layers", "verify_head", "accept",
               "commit")


def term_rows(kind: str, steps: list[dict[str, float]]) -> list[dict]:
    terms = (*(AR_TERMS if kind == "ar" else CHAIN_TERMS), "host", "step")
    return [{"loop": kind, "term": t, "mean_ms": round(1e3 * statistics.fmean(s[t] for s in steps), 3),
             "median_ms": round(1e3 * statistics.median(s[t] for s in steps), 3), "steps": len(steps)} for t in terms]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", default="smollm2-135m-instruct")
    ap.add_argument("--passes", default="draft-block-size{size=4},draft-vocab{size=2048}")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = harness.add_results_args(ap).parse_args(argv)
    if args.smoke:
        args.pair, args.passes, args.num_prompts, args.max_new_tokens = "tiny-qwen3", "draft-block-size{size=4}", 1, 8
    load_before = [round(x, 2) for x in os.getloadavg()]
    spec = parse_spec({"name": f"{args.pair}-cpu-step", "target": args.pair, "drafter": {"kind": "dflash"},
                       "serving": {"max_new_tokens": args.max_new_tokens},
                       "benchmark": {"prompts": "humaneval", "num_prompts": args.num_prompts},
                       **({"passes": args.passes} if args.passes else {})}, "bench.steps.cpu_spec_step")
    p = prepare(spec, None, "cpu")
    engine = build_engine(p.program, p.dirs.target, p.dirs.drafter, p.device, shape=p.dirs.shape)
    warm = p.prompts[0][:8]
    engine.generate_ar(warm, 4), engine.generate(warm, 4)
    ar_t, chain_t = Timers(), Timers()
    loops = {"ar_loop_s": 0.0, "chain_loop_s": 0.0, "ar_tokens": 0, "chain_tokens": 0}
    accepted: list[int] = []
    for prompt in p.prompts:
        ar_tokens = ar_steps(engine, prompt, args.max_new_tokens, ar_t)
        chain_tokens, acc = chain_steps(engine, prompt, args.max_new_tokens, chain_t)
        ar, sp = engine.generate_ar(prompt, args.max_new_tokens), engine.generate(prompt, args.max_new_tokens)
        if not ar.tokens == ar_tokens == chain_tokens == sp.tokens:
            raise SystemExit("the step-by-step loops' outputs differ from the engine's: "
                             "this bench no longer mirrors them")
        accepted += acc
        loops["ar_loop_s"] += ar.decode_s
        loops["chain_loop_s"] += sp.decode_s
        loops["ar_tokens"] += len(ar.tokens)
        loops["chain_tokens"] += len(sp.tokens)
    rows = term_rows("ar", ar_t.steps) + term_rows("chain", chain_t.steps)
    ar_step = next(r["mean_ms"] for r in rows if r["loop"] == "ar" and r["term"] == "step")
    for r in rows:
        print(f"{r['loop']:6s} {r['term']:14s} {r['mean_ms']:8.2f} ms (median {r['median_ms']:.2f})")
    tau = 1 + sum(accepted) / max(1, len(accepted))
    ar_ms = 1e3 * loops["ar_loop_s"] / max(1, loops["ar_tokens"])
    chain_ms = 1e3 * loops["chain_loop_s"] / max(1, loops["chain_tokens"])
    chain_step = next(r["mean_ms"] for r in rows if r["loop"] == "chain" and r["term"] == "step")
    summary = {"tau": round(tau, 4), "chain_step_over_ar_step": round(chain_step / ar_step, 4),
               "ar_loop_ms_per_token": round(ar_ms, 3), "chain_loop_ms_per_token": round(chain_ms, 3),
               "speedup_over_ar": round(ar_ms / chain_ms, 4), "threads": torch.get_num_threads(),
               "pipeline": p.pipeline, "load_average_before": load_before,
               "load_average_after": [round(x, 2) for x in os.getloadavg()],
               "what": "an AR step and a DFlash chain step on the CPU, term by term (means over every step)"}
    print(f"τ {tau:.3f}; chain step = {chain_step / ar_step:.2f} AR steps; loops: AR {ar_ms:.2f} ms/token, "
          f"chain {chain_ms:.2f} ms/token, {ar_ms / chain_ms:.3f}x")
    out = harness.write_run(args, "cpu_spec_step", "cpu", rows, **summary)
    print(f"wrote {out}" if out else "smoke run: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
