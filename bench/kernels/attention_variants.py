"""How a decode step's attention launch is best built, measured as the step runs it.

    python -m bench.kernels.attention_variants [--shapes ar:1:512,...] [--capacity 4160] [--parts] [--out FILE|DIR]

Llama-3.1-8B attention (32 heads, 8 kv heads, head dim 128, bf16, batch 1): 32 layers' calls in one
CUDA graph, as a step replays them (each layer its own [1, 8, capacity, 128] K/V cache and q|k|v
input, the cache length a device tensor), timed with CUDA events over replays (median), µs a layer.
Shapes: AR (T = 1) over 512 and 4096 cached tokens, verify (T = 16, 32, 64, causal) and a 17-node
tree over 512 (verify(16) over 4000 too). Variants, each a choice the kernels leave open:

  apart     rope_qkv, then attention_split_kv (with its combine kernel: three launches a layer)
  fused     rope_attention (kernels/rope_attention.py): two
  splits    the rule's (split_count), half, a quarter

Every variant's output is checked against the first's (the registry's bf16 tolerance). Writes
bench/results/attention_variants_<gpu>[_<tag>].json through the harness and prints the table last,
best per shape first. What was tried and dropped (8 warps a program, splits cut for the capacity,
the combine in the split kernel): docs/experiments/attention-split-kv.md.

--parts times, per shape at the rule's splits, the combine kernel alone (32 launches in a graph
over partials of that many splits, and of only the splits the past fills: what the split kernel's
launch costs is the rest), instead of the variants.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton

from bench import shapes as model_shapes
from specpilot.bench import harness

_LLAMA = model_shapes.config(model_shapes.LLAMA_8B)
HEADS, KV_HEADS, HEAD_DIM = _LLAMA["num_attention_heads"], _LLAMA["num_key_value_heads"], _LLAMA["head_dim"]
LAYERS, ROPE_THETA = _LLAMA["num_hidden_layers"], _LLAMA["rope_theta"]
CAPACITY = 4096 + 64  # cache slots (--capacity): the grid, and so the rule's splits, is planned for them
SHAPES = (("ar", 1, 512), ("ar", 1, 4096), ("verify", 16, 512), ("verify", 16, 4000), ("verify", 32, 512),
          ("verify", 64, 512), ("tree", 17, 512))


def _tree_mask(t: int) -> torch.Tensor:
    """A 4-ary tree's ancestor mask over t nodes (node u's parent (u - 1) // 4)."""
    mask = torch.eye(t, dtype=torch.bool)
    for u in range(1, t):
        mask[u] |= mask[(u - 1) // 4]
    return mask


def _graph_us(step, repeats: int) -> tuple[float, list]:
    """Median µs a layer of `step` (LAYERS calls) replayed as one CUDA graph, and its outputs (an
    eager call's: the same kernels on the same inputs)."""
    outs = step()  # also compiles outside the capture
    return harness.time_graph([step], repeats).median_ms * 1e3 / LAYERS, outs


_PARTIALS: dict = {}


def _combine_only(ask, t: int, cached_splits: int, dev) -> list:
    """LAYERS launches of the combine kernel alone, over partials of cached_splits + 1 splits,
    every cached one holding keys (m ~ N(0, 1), l in [1, 2), acc ~ N(0, 1): finite, as the split
    kernel leaves them)."""
    rows, n = t * (HEADS // KV_HEADS), cached_splits + 1
    key = (t, n)
    if key not in _PARTIALS:
        g = torch.Generator(device=dev).manual_seed(1)
        _PARTIALS[key] = [(torch.randn(KV_HEADS, n, rows, device=dev, generator=g),
                           1 + torch.rand(KV_HEADS, n, rows, device=dev, generator=g),
                           torch.randn(KV_HEADS, n, rows, HEAD_DIM, device=dev, generator=g),
                           torch.empty(1, t, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16).transpose(1, 2))
                          for _ in range(LAYERS)]
    for m, l, acc, out in _PARTIALS[key]:
        ask._combine_kernel[(rows, KV_HEADS)](
            m, l, acc, out, m, m, t, HEADS // KV_HEADS, KV_HEADS, n, cached_splits * ask.BLOCK_N, ask.BLOCK_N, 0,
            out.stride(0), out.stride(1), out.stride(2), HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM, BLOCK_N=ask.BLOCK_N,
            BLOCK_S=ask.COMBINE_CHUNK if n > ask.COMBINE_CHUNK else triton.next_power_of_2(n),
            FILLED_ONLY=n > ask.COMBINE_CHUNK, PAST_TENSOR=False, ROUND_BF16=False,
            num_warps=ask.NUM_WARPS, num_stages=2, enable_fp_fusion=True, PDL=0)
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap, smoke=False)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--capacity", type=int, default=CAPACITY,
                    help="cache slots (bench/steps/step_times.py's steps: 2048); shapes past it are skipped")
    ap.add_argument("--shapes", help="comma-separated WHAT:T:PAST of SHAPES to run (default: all of them)")
    ap.add_argument("--parts", action="store_true", help="the combine launch alone beside the whole (module docstring)")
    args = ap.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.attention_variants", smoke=False):
        print(reason, file=sys.stderr)
        return 2
    from specpilot.kernels import attention_split_kv as ask
    from specpilot.kernels.rope_attention import rope_attention
    from specpilot.kernels.rope_kv import rope_qkv
    from specpilot.runtime.model import rope_cos_sin

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    cap = args.capacity
    caches = [(torch.randn(1, KV_HEADS, cap, HEAD_DIM, device=dev, dtype=dt, generator=g),
               torch.randn(1, KV_HEADS, cap, HEAD_DIM, device=dev, dtype=dt, generator=g)) for _ in range(LAYERS)]
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
    rows, reference = [], {}
    sms = ask.sm_count(dev)
    wanted = SHAPES
    if args.shapes:
        wanted = [(w, int(t), int(p)) for w, t, p in (s.split(":") for s in args.shapes.split(","))]
        unknown = [s for s in wanted if s not in SHAPES]
        if unknown:
            sys.exit(f"bench.kernels.attention_variants: --shapes: {unknown} not among {list(SHAPES)}")
    for what, t, past in [shape for shape in wanted if shape[1] + shape[2] <= cap]:
        qkv = [torch.randn(1, t, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
        mask = _tree_mask(t).to(dev) if what == "tree" else "causal"
        cos, sin = rope_cos_sin(inv_freq, (past + torch.arange(t, device=dev))[None], dt)
        length = torch.tensor(past, device=dev)
        slots = (length + torch.arange(t, device=dev))[None]
        rule = ask.plan(1, HEADS, KV_HEADS, t, cap - t, sms).splits
        for fused, splits in itertools.product((False, True),
                                               sorted({rule, max(1, rule // 2), max(1, rule // 4)}, reverse=True)):
            def step(fused=fused, splits=splits):
                outs = []
                for (k, v), x in zip(caches, qkv):
                    if fused:
                        outs.append(rope_attention(x, cos, sin, k, v, past=length, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                                   mask=mask, splits=splits))
                    else:
                        q = rope_qkv(x, cos, sin, k, v, slots, num_heads=HEADS, num_kv_heads=KV_HEADS)
                        outs.append(ask.attention_split_kv(q, k, v, past=length, mask=mask, splits=splits))
                return outs

            if args.parts and not (fused and splits == rule):
                continue
            us, outs = _graph_us(step, args.repeats)
            parts = {}
            if args.parts:  # the combine alone: over the grid's splits, and over those the past fills
                active = -(-past // ask.plan(1, HEADS, KV_HEADS, t, past, sms, splits=splits).split_len)
                for label, n in (("combine_us", splits), ("combine_active_us", active)):
                    parts[label] = _graph_us(lambda n=n: _combine_only(ask, t, n, dev), args.repeats)[0]
            key = (what, t, past)
            if key not in reference:
                reference[key] = [o.clone() for o in outs]
            worst = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, reference[key]))
            ok = all(torch.allclose(o.float(), r.float(), atol=2 ** -5, rtol=2 ** -6) for o, r in zip(outs, reference[key]))
            rows.append(dict(what=what, t=t, past=past, path="fused" if fused else "apart", splits=splits,
                             rule_splits=rule, us_per_layer=us, max_abs_diff=worst, agrees=ok, **parts))
    out = harness.write_run(args, "attention_variants", dev, rows, capacity=cap,
                            method=f"{LAYERS} layers' calls in one CUDA graph, CUDA events, median of "
                                   f"{args.repeats} replays, µs a layer")
    print(f"{harness.device_name(dev)} -> {out}")
    print(f"{'shape':18} {'path':6} {'splits':>6} {'us/layer':>9} agrees"
          + ("  combine  combine(active)" if args.parts else ""))
    for key in dict.fromkeys((r["what"], r["t"], r["past"]) for r in rows):
        for r in sorted((r for r in rows if (r["what"], r["t"], r["past"]) == key), key=lambda r: r["us_per_layer"]):
            print(f"{r['what']}-{r['t']}@{r['past']:<10} {r['path']:6} {r['splits']:>6} "
                  f"{r['us_per_layer']:9.2f} {r['agrees']}"
                  + (f"  {r['combine_us']:7.2f}  {r['combine_active_us']:7.2f}" if args.parts else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
