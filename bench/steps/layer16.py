"""The verify(16) step's layer without its attention, call by call: where the u12 step's time between
the weight reads goes, on tiled u12 weights at 16 rows, one GPU.

The u12 verify(16) step runs its layers one of two ways (runtime/fused.py):
  plain   run_layers (u12-tiles, the default): rmsnorm with the residual add, qkv, o, rmsnorm with
          the residual add, gate_up, silu_mul, down: seven launches a layer, the linears u12_linear's
  fused   run_layers_linear with U12_MANY_ROWS (u12-tiles, the default): u12_fused_linear's hmma
          epilogues, four launches: qkv taking the norm down handed on, o adding into the stream and
          handing the next norm on, gate_up gated taking it, down adding and handing on
and the fused way measured slower in the step (bench/results/tried/step_ab_verify16_5f739f0_h100.json, 5f739f0)
though it launches three kernels fewer; this found why (its epilogues' serial loads). Each call of each way is timed here as a CUDA graph of the call over
the 32 layers' distinct weights (about 10.5 GB packed, so every call reads HBM), then the two ways'
whole chains; and the fused calls once more without their handoffs (o and down with the residual
add alone, gate_up gated on an x already normed, qkv plain), which splits a fused call's cost
into its epilogue's and its handoff's. o's input is a random [16, 4096] in place of attention's.

Writes bench/results/layer16_<gpu>.json (GPU, versions, commit; us for 32 calls of each kind and
for each chain) and prints a table.

    python bench/layer16.py [--out FILE] [--layers 32]
    python bench/layer16.py --smoke --out FILE   # 2 small layers on the CPU (TRITON_INTERPRET=1): checks the script
    (SPECPILOT_COMMIT=... names the commit where the tree has no .git)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from u12_linear import SHAPES, git_commit, smoke_or_gpu, time_list, write_result  # noqa: E402

EPS = 1e-5
FILES = ("kernels/u12_hmma.py", "kernels/u12_fused_linear.py", "kernels/u12_linear.py", "bench/layer16.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--smoke", action="store_true", help="2 small layers under the interpreter: the script's check")
    args = ap.parse_args(argv)
    if args.layers < 1:
        sys.exit(f"bench/layer16.py --layers: expected a positive count, got {args.layers}")
    device = smoke_or_gpu("bench/layer16.py", args.smoke)
    from specpilot.kernels.rmsnorm import rmsnorm
    from specpilot.kernels.silu_mul import silu_mul
    from specpilot.kernels.u12_fused_linear import NormHandoff, u12_fused_linear
    from specpilot.kernels.u12_linear import u12_linear
    from specpilot.formats.u12 import pack_u12

    layers = 2 if args.smoke else args.layers
    hidden, inter = (64, 128) if args.smoke else (SHAPES["o"][1], SHAPES["down"][1])
    n_qkv = 96 if args.smoke else SHAPES["qkv"][0]
    m = 16
    gen = torch.Generator(device=device).manual_seed(0)

    def packed(n: int, k: int):
        return pack_u12((torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16), layout="tiles")

    ws = [dict(qkv=packed(n_qkv, hidden), o=packed(hidden, hidden), gate_up=packed(2 * inter, hidden),
               down=packed(hidden, inter)) for _ in range(layers)]
    norms = [(1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16) for _ in range(2 * layers)]
    rand = lambda *shape: torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)  # noqa: E731
    stream, attn, h, gu, act = rand(m, hidden), rand(m, hidden), rand(m, hidden), rand(m, 2 * inter), rand(m, inter)

    # the handoffs each fused consumer reads (a producer call allocates one's xg and parts)
    hands = []
    for i in range(layers):
        ho, hd = NormHandoff(norms[2 * i + 1], EPS), NormHandoff(norms[(2 * i + 2) % (2 * layers)], EPS)
        u12_fused_linear(attn, ws[i]["o"], residual=stream, hand_out=ho)
        u12_fused_linear(act, ws[i]["down"], residual=stream, hand_out=hd)
        hands.append((ho, hd))

    def each(call):  # one call over every layer's weights
        return [lambda i=i: call(i) for i in range(layers)]

    plain = {
        "rmsnorm+add (x2)": each(lambda i: (rmsnorm(attn, norms[2 * i], EPS, residual=stream),
                                            rmsnorm(attn, norms[2 * i + 1], EPS, residual=stream))),
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
        x, _ = rmsnorm(attn, norms[2 * i], EPS, residual=stream)
        u12_linear(x, ws[i]["qkv"])
        o = u12_linear(attn, ws[i]["o"])
        x, _ = rmsnorm(o, norms[2 * i + 1], EPS, residual=stream)
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
    us = {group: {name: min(time_list(fns, args.smoke) * 1e3 for _ in range(1 if args.smoke else 2)) for name, fns in calls.items()}
          for group, calls in groups.items()}
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()
    result = dict(
        benchmark="layer16", what=__doc__.split("\n\n")[0].replace("\n", " "), layers=layers, m=m,
        timing="us for one call per layer over all layers' distinct weights (tiled u12), a CUDA graph's median "
               "replay, min of two",
        gpu=gpu, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        git_commit=git_commit(FILES),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), us=us,
        sums={group: sum(v.values()) for group, v in us.items() if group != "chains"})
    out = write_result(result, args.out, "layer16", gpu)
    print(f"{gpu}, {layers} layers, M = {m}, tiled u12; us for one call a layer over all layers")
    for group, v in us.items():
        for name, t in v.items():
            print(f"  {group:22} {name:24} {t:9.1f}")
        if group != "chains":
            print(f"  {group:22} {'sum':24} {sum(v.values()):9.1f}")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
