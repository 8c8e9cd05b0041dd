"""The verify(16) step's layer without its attention, call by call: where the u12 step's time between
the weight reads goes, on tiled u12 weights at 16 rows, one GPU.

The u12 verify(16) step can run its layers two ways (runtime/fused.py):
  plain   rmsnorm with the residual add, qkv, o, rmsnorm with the residual add, gate_up, silu_mul,
          down: seven launches a layer, the linears u12_linear's
  fused   u12_fused_linear's hmma epilogues, four launches: qkv taking the norm handed on, o adding
          into the stream and handing the next norm on, gate_up gated taking it, down adding and
          handing on
Each call of each way is timed as a CUDA graph of the call over the layers' distinct weights (about
10.5 GB packed for Llama-3.1-8B's 32, so every call reads HBM), then the two ways' whole chains; and
the fused calls once more without their handoffs (o and down with the residual add alone, gate_up
gated on an x already normed), which splits a fused call's cost into its epilogue's and its
handoff's. o's input is a random [16, hidden] in place of attention's. docs/experiments/step-times-8b.md
tells what this found.

Writes bench/results/layer16_<gpu>[_<tag>].json through the harness (records: group, call, us for
one call a layer over all layers) and prints a table.

    python -m bench.steps.layer16 [--layers 32] [--out FILE|DIR] [--tag TAG]
    python -m bench.steps.layer16 --smoke   # 2 tiny layers on the CPU (TRITON_INTERPRET=1): checks the script
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import shapes
from specpilot.bench import harness

MODEL = shapes.LLAMA_8B
M = 16  # the verify(16) step's rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap)
    ap.add_argument("--layers", type=int, default=shapes.config(MODEL)["num_hidden_layers"])
    args = ap.parse_args(argv)
    if args.layers < 1:
        print(f"bench.steps.layer16 --layers: expected a positive count, got {args.layers}", file=sys.stderr)
        return 2
    if reason := harness.refuse_device("bench.steps.layer16", args.smoke):
        print(reason, file=sys.stderr)
        return 2
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.rmsnorm import rmsnorm
    from specpilot.kernels.silu_mul import silu_mul
    from specpilot.kernels.u12 import u12_linear
    from specpilot.kernels.u12.fused import NormHandoff, u12_fused_linear

    device = "cpu" if args.smoke else "cuda"
    model = shapes.TINY if args.smoke else MODEL
    layers = 2 if args.smoke else args.layers
    linears = shapes.layer_linears(model)
    eps = shapes.config(model)["rms_norm_eps"]
    hidden, inter, n_qkv = linears["o"][0], linears["down"][1], linears["qkv"][0]
    gen = torch.Generator(device=device).manual_seed(0)

    def packed(n: int, k: int):
        return pack_u12((torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16), layout="tiles")

    ws = [dict(qkv=packed(n_qkv, hidden), o=packed(hidden, linears["o"][1]), gate_up=packed(2 * inter, hidden),
               down=packed(hidden, inter)) for _ in range(layers)]
    norms = [(1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16) for _ in range(2 * layers)]
    rand = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)  # noqa: E731
    stream, attn, h, gu, act = (rand(M, hidden), rand(M, linears["o"][1]), rand(M, hidden), rand(M, 2 * inter),
                                rand(M, inter))

    # the handoffs each fused consumer reads (a producer call allocates one's xg and parts)
    hands = []
    for i in range(layers):
        ho, hd = NormHandoff(norms[2 * i + 1], eps), NormHandoff(norms[(2 * i + 2) % (2 * layers)], eps)
        u12_fused_linear(attn, ws[i]["o"], residual=stream, hand_out=ho)
        u12_fused_linear(act, ws[i]["down"], residual=stream, hand_out=hd)
        hands.append((ho, hd))

    def each(call):  # one call over every layer's weights
        return [lambda i=i: call(i) for i in range(layers)]

    plain = {
        "rmsnorm+add (x2)": each(lambda i: (rmsnorm(h, norms[2 * i], eps, residual=stream),
                                            rmsnorm(h, norms[2 * i + 1], eps, residual=stream))),
        "qkv": each(lambda i: u12_linear(h, ws[i]["qkv"])),
        "o": each(lambda i: u12_linear(attn, ws[i]["o"])),
        "gate_up": each(lambda i: u12_linear(h, ws[i]["gate_up"])),
        "silu_mul": each(lambda i: silu_mul(gu)),
        "down": each(lambda i: u12_linear(act, ws[i]["down"])),
    }
    fused = {
        "qkv hand_in": each(lambda i: u12_fused_linear(hands[i - 1][1].xg, ws[i]["qkv"], hand_in=hands[i - 1][1])),
        "o residual hand_out": each(lambda i: u12_fused_linear(attn, ws[i]["o"], residual=stream,
                                                               hand_out=hands[i][0])),
        "gate_up gated hand_in": each(lambda i: u12_fused_linear(hands[i][0].xg, ws[i]["gate_up"], gated=True,
                                                                 hand_in=hands[i][0])),
        "down residual hand_out": each(lambda i: u12_fused_linear(act, ws[i]["down"], residual=stream,
                                                                  hand_out=hands[i][1])),
    }
    epilogues = {  # the fused calls without the handoffs
        "o residual": each(lambda i: u12_fused_linear(attn, ws[i]["o"], residual=stream)),
        "gate_up gated": each(lambda i: u12_fused_linear(h, ws[i]["gate_up"], gated=True)),
        "down residual": each(lambda i: u12_fused_linear(act, ws[i]["down"], residual=stream)),
    }

    def plain_layer(i):
        x, _ = rmsnorm(h, norms[2 * i], eps, residual=stream)
        u12_linear(x, ws[i]["qkv"])
        o = u12_linear(attn, ws[i]["o"])
        x, _ = rmsnorm(o, norms[2 * i + 1], eps, residual=stream)
        down_in = silu_mul(u12_linear(x, ws[i]["gate_up"]))
        u12_linear(down_in, ws[i]["down"])

    def fused_layer(i):
        ho, hd = hands[i]
        u12_fused_linear(hands[i - 1][1].xg, ws[i]["qkv"], hand_in=hands[i - 1][1])
        u12_fused_linear(attn, ws[i]["o"], residual=stream, hand_out=ho)
        a = u12_fused_linear(ho.xg, ws[i]["gate_up"], gated=True, hand_in=ho)
        u12_fused_linear(a, ws[i]["down"], residual=stream, hand_out=hd)

    chains = {"plain chain": each(plain_layer), "fused chain": each(fused_layer)}
    groups = {"plain": plain, "fused": fused, "fused without handoff": epilogues, "chains": chains}

    def us(fns) -> float:  # min of two graphs' median replays (one wall-clock pass under --smoke)
        if args.smoke:
            return harness.time_graph(fns, repeats=1, warmup=0, cuda=False).median_ms * 1e3
        return min(harness.time_graph(fns).median_ms for _ in range(2)) * 1e3

    records = [{"group": group, "call": name, "us": us(fns)} for group, calls in groups.items()
               for name, fns in calls.items()]
    sums = {group: sum(r["us"] for r in records if r["group"] == group) for group in groups if group != "chains"}
    out = harness.write_run(args, "layer16", device, records, model=model, layers=layers, m=M, sums_us=sums,
                            timing="us for one call a layer over all layers' distinct weights (tiled u12), a CUDA "
                                   "graph's median replay, min of two")
    print(f"{harness.device_name(device)}, {model}, {layers} layers, M = {M}, tiled u12; us for one call a layer "
          "over all layers")
    for group in groups:
        for r in (r for r in records if r["group"] == group):
            print(f"  {group:22} {r['call']:24} {r['us']:9.1f}")
        if group in sums:
            print(f"  {group:22} {'sum':24} {sums[group]:9.1f}")
    if out:
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
