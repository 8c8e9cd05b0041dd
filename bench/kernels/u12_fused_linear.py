"""u12_fused_linear's few-row configs in the u12 AR step's own modes, against its default tiles, on one GPU.

The Llama-3.1-8B u12 AR step (runtime/fused.py: u12 layers through u12_fused_linear, the norms
handed on) makes four calls a layer: qkv takes the norm the down before it handed on, o adds into
the residual stream and hands the next norm on, gate_up (gated: SiLU·mul) takes that norm, down adds
and hands on. Their tiles are derived from u12_linear's (TUNED, swept without epilogues, ungated),
gate_up's halved (``fused_config``); this sweeps them in those modes. For each M in --ms (default
1) and each call: the default config first, then every gemv2 config of bench/kernels/u12_linear.py's SWEEP_GEMV2 whose
accumulators (two a row when gated) fit 64 registers a thread. Each is checked against
u12_fused_linear_reference (the stream within bench/kernels/fused_linear.py's bound: one bf16 step plus
2^-16 of Σ|x'||w|; a handed-on xg exactly dtype(stream · weight) and its parts' sum Σ stream²), then
timed as the median replay of a CUDA graph of one call per distinct copy of the weight (about
1.5 GB of packed copies, at least 2), divided by the copies. Beside it per row, in the same graphs:
cuBLAS bf16 x @ W.T and u12_linear at its own default (no epilogue). A handed-in norm's parts are as
many as the producer's default config leaves (down's before qkv, o's before gate_up).

Layer: per M, the 32 layers' four calls chained with their handoffs (distinct random weights, about
10.5 GB packed) in one CUDA graph, at the default configs and at the sweep's best: the figure for
kernels/u12/fused.py's TUNED_FUSED, which bench/steps/step_ab.py --u12-fused-tuned then times in the step.

Writes bench/results/u12_fused_linear_<gpu>[_<tag>].json through the harness: records (the best
config per call and M), "sweep" (every row), "tuned" (the best as TUNED_FUSED's keys: rows bucket,
N, K, gated), "layer"; prints a short table last. --smoke runs the same code on tiny shapes (the CPU
under TRITON_INTERPRET=1, wall-clock timing, no graph) to check the script itself.

    python -m bench.kernels.u12_fused_linear [--budget-s 240] [--ms 1] [--no-layer] [--smoke] [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench import shapes as model_shapes
from bench.kernels import fused_linear as fl_bench  # error_bound, check_close, Timer, time_graph
from bench.kernels.sweep import print_sweep_summary
from bench.kernels.u12_linear import SWEEP_GEMV2
from specpilot.bench import harness

# name: (N weight rows, K, gated, mode): "in" takes a handed-in norm, "out" adds into the stream and
# hands the next norm on; producer: the call whose handoff an "in" call takes. The largest first: a
# budget that runs out leaves the smallest calls at their defaults.
_LINEARS = model_shapes.layer_linears(model_shapes.LLAMA_8B)
SHAPES = {name: (*_LINEARS[name], gated, mode) for name, gated, mode in
          (("gate_up", True, "in"), ("down", False, "out"), ("qkv", False, "in"), ("o", False, "out"))}
SMOKE_SHAPES = {"qkv": (48, 32, False, "in"), "o": (32, 48, False, "out"),  # hidden 32, o's K apart from down's
                "gate_up": (64, 32, True, "in"), "down": (32, 32, False, "out")}
PRODUCER = {"qkv": "down", "gate_up": "o"}
MS = (1,)
LAYERS = model_shapes.config(model_shapes.LLAMA_8B)["num_hidden_layers"]
SIGMA = 0.02
EPS = 1e-5
COPY_BYTES = 1.5e9  # packed weight copies a timed graph cycles through (no L2 reuse between calls)


def sweep_configs(m: int, n: int, k: int, gated: bool, smoke: bool) -> list:
    """The default config first, then SWEEP_GEMV2's configs whose accumulators (twice when gated:
    a gate and an up row each) fit 64 registers a thread. --smoke: one more, small."""
    from specpilot.kernels.u12 import U12Config, fused_config
    from specpilot.kernels.u12.epilogue import block_m
    from specpilot.kernels.u12.gemv2 import gemv2_acc_registers

    default = fused_config(m, n, k, gated, on_gpu=torch.cuda.is_available() and not smoke)
    if smoke:
        return [default, U12Config(8, 4, num_warps=1, num_stages=1, kernel="gemv2")]
    fits = [c for c in SWEEP_GEMV2 if gemv2_acc_registers(c, block_m(m)) * (2 if gated else 1) <= 64]
    return [default] + [c for c in fits if c != default]


def parts_of(stream: torch.Tensor, programs: int) -> torch.Tensor:
    """Σ stream² per row in `programs` parts over contiguous column blocks: [programs, M] fp32, as a
    producer's programs leave them (the last ones empty where the columns run out)."""
    m, k = stream.shape
    width = -(-k // programs)
    sq = torch.zeros(m, programs * width, dtype=torch.float32, device=stream.device)
    sq[:, :k] = stream.float() ** 2
    return sq.view(m, programs, width).sum(2).T.contiguous()


class Call:
    """One layer call of the step at M rows: its inputs, reference and error bound, and a launcher
    `run(t, cfg)` for any copy t of its weight."""

    def __init__(self, name: str, m: int, shapes: dict, w: torch.Tensor, t, device: str, gen: torch.Generator) -> None:
        from specpilot.kernels.u12 import fused as ufl

        n, k, gated, mode = shapes[name]
        self.name, self.gated, self.mode = name, gated, mode
        rnd = lambda *shape: torch.randn(*shape, device=device, generator=gen)  # noqa: E731
        if mode == "in":
            pn, pk, *_ = shapes[PRODUCER[name]]
            programs = -(-pn // ufl.fused_config(m, pn, pk, False, on_gpu=device == "cuda").block_n)
            stream = rnd(m, k).to(torch.bfloat16)
            gamma = (1 + 0.1 * rnd(k)).to(torch.bfloat16)
            self.hand = ufl.NormHandoff(gamma, EPS, (stream.float() * gamma.float()).to(torch.bfloat16),
                                        parts_of(stream, programs))
            self.x = self.hand.xg
            self.ref = ufl.u12_fused_linear_reference(self.x, t, gated=gated, hand_in=self.hand)
            inv = torch.rsqrt(self.hand.parts.sum(0) / k + EPS)
            self.bound = fl_bench.error_bound(self.x.float() * inv[:, None], w, None, gated, None)
        else:
            self.x = rnd(m, k).to(torch.bfloat16)
            self.gamma = (1 + 0.1 * rnd(n)).to(torch.bfloat16)
            self.stream = rnd(m, n).to(torch.bfloat16)
            self.ref = ufl.u12_fused_linear_reference(self.x, t, residual=self.stream.clone(),
                                                      hand_out=ufl.NormHandoff(self.gamma, EPS))
            self.bound = fl_bench.error_bound(self.x, w, None, False, self.ref)
            self.timed_stream = self.stream.clone()  # added into while timed; never checked

    def run(self, t, cfg, stream: torch.Tensor | None = None):
        """The call on weight t with config cfg; "out" adds into `stream` (default: a fresh copy)
        and returns (the stream, its NormHandoff), "in" returns (y, None)."""
        from specpilot.kernels.u12 import fused as ufl

        if self.mode == "in":
            return ufl.u12_fused_linear(self.x, t, gated=self.gated, hand_in=self.hand, config=cfg), None
        hand = ufl.NormHandoff(self.gamma, EPS)
        stream = self.stream.clone() if stream is None else stream
        return ufl.u12_fused_linear(self.x, t, residual=stream, hand_out=hand, config=cfg), hand

    def check(self, t, cfg) -> None:
        """The call's output within the bound of the reference; a handoff's xg and parts as its stream says."""
        y, hand = self.run(t, cfg)
        fl_bench.check_close(y, self.ref, self.bound)
        if hand is not None:
            if not torch.equal(hand.xg, (y.float() * self.gamma.float()).to(y.dtype)):
                raise AssertionError("the handed-on xg is not dtype(stream · weight)")
            sq = (y.float() ** 2).sum(1)
            if not torch.allclose(hand.parts.sum(0), sq, rtol=1e-4, atol=1e-3):
                raise AssertionError("the handed-on parts do not sum to the stream's Σ y²")


def layer_rows(shapes: dict, ms, best: dict, device: str, gen: torch.Generator, layers: int) -> list[dict]:
    """The four calls of `layers` layers chained with their handoffs in one graph: default configs against the best."""
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.u12 import fused as ufl

    cuda = device == "cuda"
    weights = []
    for _ in range(layers):
        weights.append({name: pack_u12((torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16))
                        for name, (n, k, *_) in shapes.items()})
    hidden, attn = shapes["o"][0], shapes["o"][1]
    gammas = [(1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).to(torch.bfloat16) for _ in range(2)]
    out = []
    for m in ms:
        x_o = torch.randn(m, attn, device=device, generator=gen).to(torch.bfloat16)  # attention's output
        stream = torch.randn(m, hidden, device=device, generator=gen).to(torch.bfloat16)
        first = ufl.NormHandoff(gammas[0], EPS, stream.clone(), parts_of(stream, 4))  # layer 0's handed-in norm

        def step(cfgs):  # each layer as runtime/fused.py runs it, the handoffs chained
            hand = first
            for ws in weights:
                ufl.u12_fused_linear(hand.xg, ws["qkv"], hand_in=hand, config=cfgs["qkv"])
                h1 = ufl.NormHandoff(gammas[1], EPS)
                ufl.u12_fused_linear(x_o, ws["o"], residual=stream, hand_out=h1, config=cfgs["o"])
                act = ufl.u12_fused_linear(h1.xg, ws["gate_up"], gated=True, hand_in=h1, config=cfgs["gate_up"])
                hand = ufl.NormHandoff(gammas[0], EPS)
                ufl.u12_fused_linear(act, ws["down"], residual=stream, hand_out=hand, config=cfgs["down"])

        defaults = {name: None for name in shapes}
        tuned = {name: best.get((name, m), (None,))[0] for name in shapes}
        default_ms = fl_bench.time_graph([lambda: step(defaults)], cuda)
        best_ms = fl_bench.time_graph([lambda: step(tuned)], cuda)
        out.append({
            "what": f"{layers} layers' u12_fused_linear calls as the u12 AR step makes them (qkv with the norm "
                    "handed in, o adding and handing on, gate_up gated with it handed in, down adding and "
                    "handing on) in one CUDA graph; no attention, RoPE or lm_head",
            "M": m, "layers": layers, "default_ms": default_ms, "best_ms": best_ms, "speedup": default_ms / best_ms,
            "configs": {name: str(c) if c else "default" for name, c in tuned.items()},
        })
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(parser)
    parser.add_argument("--budget-s", type=float, default=240.0, help="sweep time budget; later rows are skipped")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="rows of x (1..4), comma-separated")
    parser.add_argument("--no-layer", action="store_true", help="skip the 32-layer CUDA graphs")
    args = parser.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.u12_fused_linear", args.smoke):
        print(reason, file=sys.stderr)
        return 2
    cuda = not args.smoke
    ms = [1, 3] if args.smoke else [int(v) for v in args.ms.split(",")]
    if not all(1 <= m <= 4 for m in ms):
        print(f"bench.kernels.u12_fused_linear: --ms: rows 1..4 (the gemv2 kernel's), got {args.ms}", file=sys.stderr)
        return 2

    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.u12 import u12_linear
    from specpilot.kernels.u12.epilogue import block_m

    t0 = time.monotonic()
    device = "cuda" if cuda else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    if cuda:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        fl_bench.Timer(True, 200, 200)(lambda a=a: a @ a)  # clocks up from idle before the first timing
        del a

    sweep, rows, best = [], [], {}
    for name, (n, k, gated, mode) in shapes.items():
        w = (torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16)
        copies = [(w, pack_u12(w))]  # distinct weights for the graph, at least 2 on a GPU
        while cuda and len(copies) < max(2, min(LAYERS, int(COPY_BYTES // (1.5 * n * k)))):
            wc = (torch.randn(n, k, device=device, generator=gen) * SIGMA).to(torch.bfloat16)
            copies.append((wc, pack_u12(wc)))
        t = copies[0][1]

        def timed(make) -> float:  # make(bf16 w, u12 t) -> a call: µs a call, over the copies in one graph
            return fl_bench.time_graph([make(wc, tc) for wc, tc in copies], cuda) * 1e3 / len(copies)

        for m in ms:
            call = Call(name, m, shapes, w, t, device, gen)
            x = call.x
            cublas_us = timed(lambda wc, tc, x=x: lambda: x @ wc.T)
            u12_us = timed(lambda wc, tc, x=x: lambda: u12_linear(x, tc))
            base = {"name": name, "N": n, "K": k, "M": m, "gated": gated, "mode": mode,
                    "cublas_us": cublas_us, "u12_linear_us": u12_us}
            for i, cfg in enumerate(sweep_configs(m, n, k, gated, args.smoke)):
                row = {**base, "config": str(cfg), "default": i == 0}
                if i > 0 and time.monotonic() - t0 > args.budget_s:  # the default always runs: every row has one
                    sweep.append({**row, "skipped": "time budget"})
                    continue
                try:
                    call.check(t, cfg)
                    stream = getattr(call, "timed_stream", None)
                    us = timed(lambda wc, tc, cfg=cfg: lambda: call.run(tc, cfg, stream))
                except Exception as e:  # a config that does not compile, run or match: recorded, not fatal
                    sweep.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                sweep.append({**row, "us": us, "speedup_vs_cublas": cublas_us / us})
                if (name, m) not in best or us < best[(name, m)][1]:
                    best[(name, m)] = (cfg, us)
            if (name, m) in best:
                cfg, us = best[(name, m)]
                default = next((s for s in sweep if s["name"] == name and s["M"] == m and s["default"]), {})
                rows.append({**base, "fused_us": us, "speedup_vs_cublas": cublas_us / us,
                             "u12_tb_s": t.nbytes / us / 1e6, "config": str(cfg),
                             "default_config": default.get("config"), "default_us": default.get("us")})
        del w, t, copies
        if cuda:
            torch.cuda.empty_cache()
    sweep_s = time.monotonic() - t0

    layer = []
    if not args.no_layer:
        try:
            layer = layer_rows(shapes, ms, best, device, gen, 2 if args.smoke else LAYERS)
        except Exception as e:  # e.g. out of memory on a smaller GPU: the rows still count
            layer = [{"error": f"{type(e).__name__}: {str(e)[:300]}"}]
        if cuda:
            torch.cuda.empty_cache()

    fields = ("block_n", "block_w", "split_k", "num_warps", "num_stages", "decode", "kernel", "maxnreg")
    tuned = [{"key": [block_m(m), shapes[name][0], shapes[name][1], shapes[name][2]], "shape": name, "M": m,
              "config": str(cfg), **{f: getattr(cfg, f) for f in fields}}
             for (name, m), (cfg, _) in best.items()]
    timing = ("median replay of a CUDA graph of one call per distinct copy of the weight (about 1.5 GB packed, at "
              "least 2), divided by the copies; layer: CUDA graph replays, median of 20") if cuda else \
        "smoke: wall clock of one call under the interpreter"
    out = harness.write_run(args, "u12_fused_linear", device, rows, timing=timing, sweep_seconds=sweep_s,
                            total_seconds=time.monotonic() - t0, tuned=tuned, layer=layer, sweep=sweep)
    print_sweep_summary(harness.device_name(device), out, sweep, sweep_s)
    for r in layer:
        print(f"layers M={r['M']}: default {r['default_ms']:.3f} ms, best {r['best_ms']:.3f} ms, {r['speedup']:.3f}x"
              if "M" in r else f"layers: {r['error']}")
    print(f"{'call':<8} {'M':>2} {'cuBLAS us':>10} {'u12_linear':>10} {'default':>8} {'best':>8}  best config")
    for r in rows:
        print(f"{r['name']:<8} {r['M']:>2} {r['cublas_us']:>10.1f} {r['u12_linear_us']:>10.1f} "
              f"{r['default_us'] or float('nan'):>8.1f} {r['fused_us']:>8.1f}  {r['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
