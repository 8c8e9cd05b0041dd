"""Llama-3.1-8B-shaped target and DFlash-shaped drafter steps, as the IR lowers them (separate
q/k/v/o/gate/up/down linears), random N(0, 0.02) bf16 weights, static KV cache, torch SDPA.
Times AR / verify(q) / draft steps in CUDA graphs (and a few eager), CUDA events, median of replays."""
import json, os, statistics, sys, time
import torch
import torch.nn.functional as F

torch.manual_seed(0)
dev = "cuda"
dt = torch.bfloat16
V, H, I, L, NH, KVH, HD = 128256, 4096, 14336, 32, 32, 8, 128
DL, CTXL = 5, (1, 9, 17, 25, 31)
MAXLEN = 8192 + 512
OUT = os.environ.get("OUT", "/tmp")

def w(*shape):
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * 0.02).to(dt)

def layer_weights():
    return dict(q=w(NH * HD, H), k=w(KVH * HD, H), v=w(KVH * HD, H), o=w(H, NH * HD),
                g=w(I, H), u=w(I, H), d=w(H, I), n1=torch.ones(H, device=dev, dtype=dt), n2=torch.ones(H, device=dev, dtype=dt))

T = dict(embed=w(V, H), head=w(V, H), norm=torch.ones(H, device=dev, dtype=dt), layers=[layer_weights() for _ in range(L)])
Dw = dict(fc=w(H, H * len(CTXL)), cnorm=torch.ones(H, device=dev, dtype=dt), norm=torch.ones(H, device=dev, dtype=dt),
          layers=[layer_weights() for _ in range(DL)])
inv = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=dev, dtype=torch.float32) / HD))
ang = torch.outer(torch.arange(MAXLEN, device=dev, dtype=torch.float32), inv)
COS = torch.cat([ang.cos(), ang.cos()], -1).to(dt)
SIN = torch.cat([ang.sin(), ang.sin()], -1).to(dt)

def rope(x, pos):  # x [B, h, q, hd]
    c, s = COS[pos][None, None], SIN[pos][None, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * c + torch.cat((-x2, x1), -1) * s

def make_cache(layers, B):
    return [(torch.randn(B, KVH, MAXLEN, HD, device=dev, dtype=dt), torch.randn(B, KVH, MAXLEN, HD, device=dev, dtype=dt)) for _ in range(layers)]

def attn_block(x, lw, kc, vc, start, q_rows, kv_src, mask):
    B = x.shape[0]
    h = F.rms_norm(x, (H,), lw["n1"], 1e-5)
    q = F.linear(h, lw["q"]).view(B, q_rows, NH, HD).transpose(1, 2)
    src = h if kv_src is None else torch.cat([kv_src, h], 1)
    n = src.shape[1]
    k = F.linear(src, lw["k"]).view(B, n, KVH, HD).transpose(1, 2)
    v = F.linear(src, lw["v"]).view(B, n, KVH, HD).transpose(1, 2)
    qpos = torch.arange(start + n - q_rows, start + n, device=dev)
    kpos = torch.arange(start, start + n, device=dev)
    q, k = rope(q, qpos), rope(k, kpos)
    kc[:, :, start:start + n] = k
    vc[:, :, start:start + n] = v
    o = F.scaled_dot_product_attention(q, kc[:, :, :start + n], vc[:, :, :start + n], attn_mask=mask, enable_gqa=True)
    x = x + F.linear(o.transpose(1, 2).reshape(B, q_rows, NH * HD), lw["o"])
    h = F.rms_norm(x, (H,), lw["n2"], 1e-5)
    return x + F.linear(F.silu(F.linear(h, lw["g"])) * F.linear(h, lw["u"]), lw["d"])

def target_step(tok, cache, start, mask):
    x = F.embedding(tok, T["embed"])
    q_rows = tok.shape[1]
    for lw, (kc, vc) in zip(T["layers"], cache):
        x = attn_block(x, lw, kc, vc, start, q_rows, None, mask)
    return F.linear(F.rms_norm(x, (H,), T["norm"], 1e-5), T["head"]).argmax(-1)

def draft_step(tok, feats, cache, start):
    ctx = F.rms_norm(F.linear(feats, Dw["fc"]), (H,), Dw["cnorm"], 1e-5)
    x = F.embedding(tok, T["embed"])
    for lw, (kc, vc) in zip(Dw["layers"], cache):
        x = attn_block(x, lw, kc, vc, start, tok.shape[1], ctx, None)
    return F.linear(F.rms_norm(x, (H,), Dw["norm"], 1e-5), T["head"]).argmax(-1)

def causal_mask(q, start):
    if q == 1:
        return None
    i = torch.arange(q, device=dev)[:, None]
    j = torch.arange(start + q, device=dev)[None, :]
    return (j <= start + i)[None, None]

def timed(fn, graphs, reps=30, warm=3):
    if graphs:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warm):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    else:
        run = fn
    for _ in range(warm):
        run()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); run(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts), min(ts)

records, rows = [], []
def rec(what, q, B, cache_len, graphs, ms, best, **extra):
    records.append(dict(kind="step", what=what, q=q, batch=B, cache_len=cache_len, cuda_graphs=graphs, ms=ms, min_ms=best, **extra))
    rows.append(f"{what:7s} q={q:4d} B={B} L={cache_len:5d} graphs={int(graphs)}  {ms:8.3f} ms (min {best:.3f})")
    print(rows[-1], flush=True)

caches = {1: make_cache(L, 1)}
dcache = make_cache(DL, 1)
t0 = time.time()
plan = [(1, 1, 512, True), (1, 4, 512, True), (1, 16, 512, True), (1, 64, 512, True), (1, 256, 512, True),
        (1, 1, 8192, True), (1, 16, 8192, True), (4, 1, 512, True), (4, 16, 512, True), (1, 1, 512, False), (1, 16, 512, False)]
for B, q, Lc, graphs in plan:
    if B not in caches:
        caches[B] = make_cache(L, B)
    tok = torch.randint(0, V, (B, q), device=dev)
    mask = causal_mask(q, Lc)
    ms, best = timed(lambda: target_step(tok, caches[B], Lc, mask), graphs)
    rec("ar" if q == 1 else "verify", q, B, Lc, graphs, ms, best)
for Lc, graphs in ((512, True), (8192, True), (512, False)):
    tok = torch.randint(0, V, (1, 16), device=dev)
    feats = torch.randn(1, 16, H * len(CTXL), device=dev, dtype=dt)
    ms, best = timed(lambda: draft_step(tok, feats, dcache, Lc), graphs)
    rec("draft", 16, 1, Lc, graphs, ms, best, context=16)

# kernel counts per step (eager, profiler) and per-kernel latency of tiny kernels
from torch.profiler import profile, ProfilerActivity
def count_kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
tok1 = torch.randint(0, V, (1, 1), device=dev)
tok16 = torch.randint(0, V, (1, 16), device=dev)
m16 = causal_mask(16, 512)
kc = dict(ar=count_kernels(lambda: target_step(tok1, caches[1], 512, None)),
          verify16=count_kernels(lambda: target_step(tok16, caches[1], 512, m16)),
          draft16=count_kernels(lambda: draft_step(tok16, torch.randn(1, 16, H * 5, device=dev, dtype=dt), dcache, 512)))
x = torch.randn(4096, device=dev, dtype=dt)
def tiny():
    for _ in range(500):
        x.mul_(1.0001)
tg, _ = timed(tiny, True, reps=10)
te, _ = timed(tiny, False, reps=10)
micro = dict(kernels=kc, tiny_kernel_graph_us=tg * 1e3 / 500, tiny_kernel_eager_us=te * 1e3 / 500)
print(micro)
p = torch.cuda.get_device_properties(0)
out = dict(gpu="h200", shape="llama-3.1-8b", device=p.name, sms=p.multi_processor_count,
           versions=dict(torch=torch.__version__, cuda=torch.version.cuda), date=time.strftime("%Y-%m-%d"),
           method="CUDA events around one step (graph replay or eager), median of 30 after 3 warm-ups; random N(0,0.02) bf16 weights",
           script="bench/step_bench.py (cost-model calibration)", micro=micro, records=records)
json.dump(out, open(os.path.join(OUT, "h200_steps.json"), "w"), indent=1)
print("\n".join(rows)); print("total", time.time() - t0)
