"""Steps shaped as the IR lowers them, for the cost model's calibration: a Llama-3.1-8B target and a
DFlash-recipe drafter as plain torch (separate q/k/v/o/gate/up/down linears, SDPA, a static KV cache),
random N(0, 0.02) bf16 weights.

    python -m bench.steps.step_bench [--out FILE|DIR] [--tag TAG]
    python -m bench.steps.step_bench --smoke --out DIR     # the tiny shape on the CPU: checks the script

AR, verify(q) and draft steps at batch 1 and 4 and caches of 512 and 8192, in CUDA graphs (and a few
eager), CUDA events, median and min of 30 replays after 3 warm-ups; then the kernels each step
launches (profiler) and one tiny kernel's cost in a graph and eagerly. Writes
bench/results/step_bench_<gpu>.json through the harness: its records are the cost model's step
records ({"kind": "step", "what", "q", "batch", "cache_len", "cuda_graphs", "ms"}).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench import shapes
from specpilot.bench import harness
from specpilot.hf.known import DFLASH_LAYERS

DTYPE = torch.bfloat16
# (batch, q, cache length, CUDA graphs) of the target's steps, then (cache length, graphs) of the drafter's
PLAN = ((1, 1, 512, True), (1, 4, 512, True), (1, 16, 512, True), (1, 64, 512, True), (1, 256, 512, True),
        (1, 1, 8192, True), (1, 16, 8192, True), (4, 1, 512, True), (4, 16, 512, True), (1, 1, 512, False),
        (1, 16, 512, False))
DRAFT_PLAN = ((512, True), (8192, True), (512, False))
DRAFT_Q = 16
SMOKE_PLAN, SMOKE_DRAFT_PLAN = ((1, 1, 8, False), (1, 4, 8, False), (2, 4, 8, False)), ((8, False),)


@dataclass
class Dims:
    """The sizes the steps are built at (a config.json's, read once)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    draft_layers: int
    draft_context_layers: int  # the target layers the drafter's fc reads
    max_len: int

    @staticmethod
    def of(config: dict, draft_layers: int, draft_context_layers: int, max_len: int) -> "Dims":
        return Dims(config["vocab_size"], config["hidden_size"], config["intermediate_size"],
                    config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
                    config["head_dim"], config["rms_norm_eps"], config["rope_theta"], draft_layers,
                    draft_context_layers, max_len)


class IRSteps:
    """The target's and the drafter's steps over random weights, as the IR lowers them."""

    def __init__(self, d: Dims, device: torch.device) -> None:
        self.d, self.device = d, device
        self.target = dict(embed=self.w(d.vocab, d.hidden), head=self.w(d.vocab, d.hidden), norm=self.ones(),
                           layers=[self.layer() for _ in range(d.layers)])
        self.drafter = dict(fc=self.w(d.hidden, d.hidden * d.draft_context_layers), cnorm=self.ones(), norm=self.ones(),
                            layers=[self.layer() for _ in range(d.draft_layers)])
        inv = 1.0 / (d.theta ** (torch.arange(0, d.head_dim, 2, device=device, dtype=torch.float32) / d.head_dim))
        ang = torch.outer(torch.arange(d.max_len, device=device, dtype=torch.float32), inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(DTYPE)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(DTYPE)

    def w(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=self.device, dtype=torch.float32) * 0.02).to(DTYPE)

    def ones(self) -> torch.Tensor:
        return torch.ones(self.d.hidden, device=self.device, dtype=DTYPE)

    def layer(self) -> dict:
        d = self.d
        return dict(q=self.w(d.heads * d.head_dim, d.hidden), k=self.w(d.kv_heads * d.head_dim, d.hidden),
                    v=self.w(d.kv_heads * d.head_dim, d.hidden), o=self.w(d.hidden, d.heads * d.head_dim),
                    g=self.w(d.intermediate, d.hidden), u=self.w(d.intermediate, d.hidden),
                    d=self.w(d.hidden, d.intermediate), n1=self.ones(), n2=self.ones())

    def cache(self, layers: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        d = self.d
        return [tuple(torch.randn(batch, d.kv_heads, d.max_len, d.head_dim, device=self.device, dtype=DTYPE)
                      for _ in range(2)) for _ in range(layers)]

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [B, h, q, hd]
        c, s = self.cos[pos][None, None], self.sin[pos][None, None]
        half = self.d.head_dim // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    def attn_block(self, x, lw, kc, vc, start, q_rows, kv_src, mask):
        d, batch = self.d, x.shape[0]
        h = F.rms_norm(x, (d.hidden,), lw["n1"], d.eps)
        q = F.linear(h, lw["q"]).view(batch, q_rows, d.heads, d.head_dim).transpose(1, 2)
        src = h if kv_src is None else torch.cat([kv_src, h], 1)
        n = src.shape[1]
        k = F.linear(src, lw["k"]).view(batch, n, d.kv_heads, d.head_dim).transpose(1, 2)
        v = F.linear(src, lw["v"]).view(batch, n, d.kv_heads, d.head_dim).transpose(1, 2)
        qpos = torch.arange(start + n - q_rows, start + n, device=self.device)
        kpos = torch.arange(start, start + n, device=self.device)
        q, k = self.rope(q, qpos), self.rope(k, kpos)
        kc[:, :, start:start + n] = k
        vc[:, :, start:start + n] = v
        o = F.scaled_dot_product_attention(q, kc[:, :, :start + n], vc[:, :, :start + n], attn_mask=mask, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(batch, q_rows, d.heads * d.head_dim), lw["o"])
        h = F.rms_norm(x, (d.hidden,), lw["n2"], d.eps)
        return x + F.linear(F.silu(F.linear(h, lw["g"])) * F.linear(h, lw["u"]), lw["d"])

    def target_step(self, tok, cache, start, mask):
        t = self.target
        x = F.embedding(tok, t["embed"])
        for lw, (kc, vc) in zip(t["layers"], cache):
            x = self.attn_block(x, lw, kc, vc, start, tok.shape[1], None, mask)
        return F.linear(F.rms_norm(x, (self.d.hidden,), t["norm"], self.d.eps), t["head"]).argmax(-1)

    def draft_step(self, tok, feats, cache, start):
        dr = self.drafter
        ctx = F.rms_norm(F.linear(feats, dr["fc"]), (self.d.hidden,), dr["cnorm"], self.d.eps)
        x = F.embedding(tok, self.target["embed"])
        for lw, (kc, vc) in zip(dr["layers"], cache):
            x = self.attn_block(x, lw, kc, vc, start, tok.shape[1], ctx, None)
        return F.linear(F.rms_norm(x, (self.d.hidden,), dr["norm"], self.d.eps), self.target["head"]).argmax(-1)

    def causal_mask(self, q: int, start: int) -> torch.Tensor | None:
        if q == 1:
            return None
        i = torch.arange(q, device=self.device)[:, None]
        j = torch.arange(start + q, device=self.device)[None, :]
        return (j <= start + i)[None, None]


def timed(fn, graphs: bool, cuda: bool, repeats: int = 30, warmup: int = 3) -> tuple[float, float]:
    """(median, min) ms of `fn`, captured in a CUDA graph when `graphs` (eager otherwise)."""
    run = harness.capture(fn, warmup, cuda) if graphs else fn
    samples = harness.event_samples(run, repeats, warmup, cuda)
    return statistics.median(samples), min(samples)


def count_kernels(fn) -> int:
    """CUDA kernels one eager call of `fn` launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv: list[str] | None = None) -> int:
    args = harness.add_results_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args(argv)
    if (reason := harness.refuse_device("bench.steps.step_bench", args.smoke, interpreter=False)) is not None:
        print(reason, file=sys.stderr)
        return 2
    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    name = shapes.TINY if args.smoke else shapes.LLAMA_8B
    draft_reads = len(shapes.dflash_config(shapes.LLAMA_8B)["target_layer_ids"])
    dims = Dims.of(shapes.config(name), 1 if args.smoke else DFLASH_LAYERS, draft_reads, 64 if args.smoke else 8192 + 512)
    plan, draft_plan, repeats = (SMOKE_PLAN, SMOKE_DRAFT_PLAN, 2) if args.smoke else (PLAN, DRAFT_PLAN, 30)
    torch.manual_seed(0)
    steps = IRSteps(dims, device)
    records: list[dict] = []

    def record(what, q, batch, cache_len, graphs, ms, best, **extra):
        records.append(dict(kind="step", what=what, q=q, batch=batch, cache_len=cache_len, cuda_graphs=graphs, ms=ms,
                            min_ms=best, **extra))
        print(f"{what:7s} q={q:4d} B={batch} L={cache_len:5d} graphs={int(graphs)}  {ms:8.3f} ms (min {best:.3f})",
              flush=True)

    started = time.time()
    caches = {1: steps.cache(dims.layers, 1)}
    draft_cache = steps.cache(dims.draft_layers, 1)
    for batch, q, cache_len, graphs in plan:
        if batch not in caches:
            caches[batch] = steps.cache(dims.layers, batch)
        tok = torch.randint(0, dims.vocab, (batch, q), device=device)
        mask = steps.causal_mask(q, cache_len)
        ms, best = timed(lambda: steps.target_step(tok, caches[batch], cache_len, mask), graphs, cuda, repeats)
        record("ar" if q == 1 else "verify", q, batch, cache_len, graphs, ms, best)
    for cache_len, graphs in draft_plan:
        tok = torch.randint(0, dims.vocab, (1, DRAFT_Q), device=device)
        feats = torch.randn(1, DRAFT_Q, dims.hidden * dims.draft_context_layers, device=device, dtype=DTYPE)
        ms, best = timed(lambda: steps.draft_step(tok, feats, draft_cache, cache_len), graphs, cuda, repeats)
        record("draft", DRAFT_Q, 1, cache_len, graphs, ms, best, context=DRAFT_Q)

    micro: dict = {}
    if cuda:  # kernels a step launches (eager), and one tiny kernel's launch cost in a graph and eagerly
        tok1 = torch.randint(0, dims.vocab, (1, 1), device=device)
        tok16 = torch.randint(0, dims.vocab, (1, 16), device=device)
        m16 = steps.causal_mask(16, 512)
        feats16 = torch.randn(1, 16, dims.hidden * dims.draft_context_layers, device=device, dtype=DTYPE)
        kernels = dict(ar=count_kernels(lambda: steps.target_step(tok1, caches[1], 512, None)),
                       verify16=count_kernels(lambda: steps.target_step(tok16, caches[1], 512, m16)),
                       draft16=count_kernels(lambda: steps.draft_step(tok16, feats16, draft_cache, 512)))
        x = torch.randn(4096, device=device, dtype=DTYPE)

        def tiny():
            for _ in range(500):
                x.mul_(1.0001)
        graph_ms, _ = timed(tiny, True, cuda, 10)
        eager_ms, _ = timed(tiny, False, cuda, 10)
        micro = dict(kernels=kernels, tiny_kernel_graph_us=graph_ms * 1e3 / 500, tiny_kernel_eager_us=eager_ms * 1e3 / 500)
        print(micro)
    out = harness.write_run(
        args, "step_bench", device, records, shape=name,
        sms=torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        method="CUDA events around one step (graph replay or eager), median of 30 after 3 warm-ups; random "
               "N(0,0.02) bf16 weights", micro=micro)
    print(f"-> {out or 'no file (--smoke)'}; {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
