"""What a kernel that only reads a linear's weight bytes takes, on one GPU: the bound under any GEMM.

The u12 kernels at 16 rows run the small Llama-3.1-8B shapes (qkv, o, down) at 1.6-2.2 TB/s where
gate_up reaches 2.8 on an H100 (bench/results/layer16_h100.json), and Nsight Compute has their warps
waiting on global loads with DRAM under half busy. Is that what any kernel reading 25-90 MB gets, or
the way they load? Here kernels that do nothing but read (an int32 sum of every word) time each
shape's byte count, u12 (1.5 bytes a weight) and bf16 (2), three ways:

  lsu   each thread's 16-byte loads straight to registers (ld.global.v4, as the hmma kernel loads
        its words), UNROLL chunks of a program issued before they are summed;
  cp    the same loads in a ``tl.range(num_stages=STAGES)`` loop, which Triton pipelines through
        shared memory with cp.async (Ampere's per-thread asynchronous copies, the LSU path still);
  tma   a tensor descriptor's block loads in the same kind of loop: Hopper's TMA engine copies whole
        blocks to shared memory behind an mbarrier, outside the per-thread load path.

Each way over a small grid of program counts (1-8 an SM), warps and depths; per byte count the
fastest config is kept. Every call is timed as the median replay of a CUDA graph of one call per
distinct copy of the bytes (about 2 GB of copies, so every call reads HBM), twice, the minimum
kept; the sums are checked against torch's. Writes bench/results/read_bound_<gpu>[_<tag>].json
through the harness and prints a table.

    python -m bench.kernels.read_bound [--sizes o,qkv,down,gate_up,lm_head] [--ways lsu,cp,tma] [--out FILE|DIR]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import triton
import triton.language as tl

from bench import shapes as model_shapes
from specpilot.bench import harness

SHAPES = model_shapes.layer_linears(model_shapes.LLAMA_8B)

FORMATS = {"u12": 1.5, "bf16": 2.0}  # bytes a weight
ROW = 256  # int32 words a descriptor row (1 KB)
COPY_BYTES = 2e9  # distinct copies of each byte count, so every call of a graph reads HBM


@triton.jit
def _read_words(src, out, n_chunks, per, CHUNK: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums chunks p · per .. (p + 1) · per - 1 of CHUNK words: UNROLL chunks' loads at once
    (lsu), or with STAGES one chunk an iteration of a loop Triton pipelines STAGES deep (cp: cp.async)."""
    pid = tl.program_id(0)
    first = pid * per
    last = tl.minimum(first + per, n_chunks)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], tl.int32)
    if STAGES:
        for c in tl.range(first, last, num_stages=STAGES):
            acc += tl.load(tl.multiple_of(src + c * CHUNK + offs, 16))
    else:
        for c in range(first, last, UNROLL):
            for u in tl.static_range(UNROLL):
                ptr = src + (c + u) * CHUNK + offs  # under 2^31 words: int32 offsets
                acc += tl.load(tl.multiple_of(ptr, 16), mask=(c + u) * CHUNK + offs < last * CHUNK, other=0)
    tl.store(out + pid, tl.sum(acc, 0))


@triton.jit
def _read_tma(desc, out, n_blocks, per, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums blocks p · per .. of ROWS descriptor rows (ROWS KB), STAGES deep through TMA."""
    pid = tl.program_id(0)
    first = pid * per
    last = tl.minimum(first + per, n_blocks)
    acc = tl.zeros([ROWS, 256], tl.int32)
    for b in tl.range(first, last, num_stages=STAGES):
        acc += desc.load([b * ROWS, 0])
    tl.store(out + pid, tl.sum(tl.sum(acc, 1), 0))


def configs(way: str, sms: int) -> list[dict]:
    """The grid a way is timed over: programs an SM, warps, and its depth."""
    grid = [dict(programs=sms * p) for p in (1, 2, 4, 8)]
    if way == "lsu":
        return [dict(g, warps=w, unroll=u) for g in grid for w in (4, 8) for u in (1, 2, 4)]
    if way == "cp":
        return [dict(g, warps=w, stages=s) for g in grid for w in (4, 8) for s in (3, 5)]
    return [dict(g, warps=4, rows=r, stages=s) for g in grid for r in (8, 16) for s in (3, 5)]


def launcher(way: str, cfg: dict, buf: torch.Tensor, out: torch.Tensor):
    """A call reading all of `buf` (int32, a whole number of 1 KB rows) by `way` at `cfg`."""
    p, w = cfg["programs"], cfg["warps"]
    if way == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        rows = cfg["rows"]
        view = buf.view(-1, ROW)
        n_blocks = view.shape[0] // rows
        desc = TensorDescriptor.from_tensor(view, [rows, ROW])
        per = math.ceil(n_blocks / p)
        return lambda: _read_tma[(p,)](desc, out, n_blocks, per, ROWS=rows, STAGES=cfg["stages"], num_warps=w)
    chunk = 32 * w * 4  # 16 bytes a thread
    n_chunks = buf.numel() // chunk
    per = math.ceil(n_chunks / p)
    u, stages = cfg.get("unroll", 1), cfg.get("stages", 0)  # lsu: unroll; cp: stages
    per = math.ceil(per / u) * u
    return lambda: _read_words[(p,)](buf, out, n_chunks, per, CHUNK=chunk, UNROLL=u, STAGES=stages, num_warps=w)


def label(way: str, cfg: dict) -> str:
    return "-".join([way] + [f"{k[0]}{v}" for k, v in cfg.items()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap, smoke=False)
    ap.add_argument("--sizes", default="o,qkv,down,gate_up,lm_head")
    ap.add_argument("--ways", default="lsu,cp,tma")
    args = ap.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.read_bound", smoke=False):
        print(reason, file=sys.stderr)
        return 2
    sizes = [s for s in args.sizes.split(",") if s]
    ways = [w for w in args.ways.split(",") if w]
    for s in sizes:
        if s not in SHAPES:
            sys.exit(f"--sizes: {s!r} is not one of {', '.join(SHAPES)}")
    for w in ways:
        if w not in ("lsu", "cp", "tma"):
            sys.exit(f"--ways: {w!r} is not one of lsu, cp, tma")
    if "tma" in ways:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)

    def save(rows: list[dict]):  # after every size: a run cut by its time limit keeps what it timed
        return harness.write_run(args, "read_bound", "cuda", rows, sms=sms,
                                 timing="us a call: median replay of a CUDA graph of one call per distinct copy "
                                        "(about 2 GB), min of two")

    rows = []
    for name in sizes:
        n, k = SHAPES[name]
        for fmt, per_weight in FORMATS.items():
            nbytes = math.ceil(n * k * per_weight / (16 * 1024)) * 16 * 1024  # whole 16 KB blocks
            copies = max(2, min(32, math.ceil(COPY_BYTES / nbytes)))
            bufs = [torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda", generator=gen)
                    for _ in range(copies)]
            want = [int(b.sum(dtype=torch.int64)) & 0xFFFFFFFF for b in bufs]
            row = dict(name=name, format=fmt, bytes=nbytes, copies=copies, us={})
            for way in ways:
                for cfg in configs(way, sms):
                    outs = [torch.zeros(cfg["programs"], dtype=torch.int32, device="cuda") for _ in bufs]
                    calls = [launcher(way, cfg, b, o) for b, o in zip(bufs, outs)]
                    try:
                        calls[0]()
                        got = int(outs[0].sum(dtype=torch.int64)) & 0xFFFFFFFF
                        if got != want[0]:
                            raise AssertionError(f"sum {got:#x}, torch's {want[0]:#x}")
                        ms = min(harness.time_graph(calls).median_ms, harness.time_graph(calls).median_ms) / copies
                    except Exception as e:  # a config the GPU or Triton refuses: recorded, not fatal
                        row.setdefault("errors", {})[label(way, cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
                        continue
                    row["us"][label(way, cfg)] = ms * 1e3
            best = {}
            for way in ways:
                mine = {c: t for c, t in row["us"].items() if c.startswith(way + "-")}
                if mine:
                    c = min(mine, key=mine.get)
                    best[way] = dict(config=c, us=mine[c], tb_s=nbytes / mine[c] / 1e6)
            row["best"] = best
            rows.append(row)
            print(f"{name:8s} {fmt:5s} {nbytes / 1e6:7.1f} MB  "
                  + "  ".join(f"{w} {b['us']:7.2f} us {b['tb_s']:.2f} TB/s" for w, b in best.items()), flush=True)
            save(rows)
            del bufs
            torch.cuda.empty_cache()
    print(f"wrote {save(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
