"""The hmma kernel's tiles and occupancy at M = 16 on tiled weights, against TUNED_TILES' configs and
cuBLAS bf16, at the Llama-3.1-8B layer shapes.

Per shape (qkv, o, gate_up, down; random N(0, 0.02) weights; distinct copies of about 2 GB so every
call reads HBM): cuBLAS; TUNED_TILES' config ("tuned"); 64-row programs of 4 warps at 128 and 168
registers ("w4-r128": TUNED_TILES' before 32-row ones, "w4-r168"), 16-row programs of one warp
("w1-r168"), 32-row programs of 2 warps ("w2-r128"); more programs an SM ("bw" rows: 16-word chunks
at 80 registers, and 16- or 32-word chunks at 64-128 registers with twice the tuned splits, "-sk2x").
Each config is checked against x · Wᵀ in fp32 first (relative error under 1e-2), then timed as the
median replay of a CUDA graph of one call per copy, twice, the minimum kept. Writes
bench/results/hmma_knobs_<gpu>[_<tag>].json through the harness (records: a shape each; "tuned":
each shape's fastest config as a TUNED_TILES entry, which bench/steps/step_ab.py --tiles-tuned times
in the verify step) and prints a line a shape. The knobs this table timed before (the register double
buffer, the splits walking the escapes, the warps splitting the words, the weight loads' cache
policy): docs/experiments/u12-hmma.md.

    python -m bench.kernels.hmma_knobs [--shapes o,down,qkv,gate_up] [--labels tuned,w2-r128,...] [--out FILE|DIR]
    python -m bench.kernels.hmma_knobs --smoke --out FILE   # o at 32 x 256 on the CPU (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from bench import shapes as model_shapes
from specpilot.bench import harness
from specpilot.kernels.u12 import TUNED_TILES, U12Config

SHAPES = model_shapes.layer_linears(model_shapes.LLAMA_8B)
SPLIT = {name: TUNED_TILES[(16, *SHAPES[name])].split_k for name in ("qkv", "o", "gate_up", "down")}


def configs(name: str, tuned: U12Config) -> list[tuple[str, U12Config]]:
    """(label, config) rows of the shape's table: "w<warps>-r<registers>" tiles at the tuned splits,
    "bw<block_w>[-sk2x]-r<registers>" occupancy rows (-sk2x: twice the tuned splits)."""
    hmma = dict(num_stages=1, kernel="hmma", split_k=SPLIT[name])
    rows = [
        ("tuned", tuned),
        ("w4-r128", U12Config(64, 32, num_warps=4, maxnreg=128, **hmma)),
        ("w4-r168", U12Config(64, 32, num_warps=4, maxnreg=168, **hmma)),
        ("w1-r168", U12Config(16, 32, num_warps=1, maxnreg=168, **hmma)),
        ("w2-r128", U12Config(32, 32, num_warps=2, maxnreg=128, **hmma)),
    ]
    # More warps an SM: a one-group chunk (block_w 16) keeps the loop's loads before its first MMA at 80
    # registers, so 6-8 programs an SM where TUNED_TILES' 128 hold 4; and twice the splits to fill them
    sk = SPLIT[name]
    occ = dict(num_stages=1, kernel="hmma", num_warps=4)
    rows += [
        ("bw16-r80", U12Config(64, 16, split_k=sk, maxnreg=80, **occ)),
        ("bw16-sk2x-r64", U12Config(64, 16, split_k=2 * sk, maxnreg=64, **occ)),
        ("bw16-sk2x-r80", U12Config(64, 16, split_k=2 * sk, maxnreg=80, **occ)),
        ("bw32-sk2x-r80", U12Config(64, 32, split_k=2 * sk, maxnreg=80, **occ)),
        ("bw32-sk2x-r128", U12Config(64, 32, split_k=2 * sk, maxnreg=128, **occ)),
    ]
    return rows


def pick(rows: list[tuple[str, object]], labels: str | None, name: str) -> list[tuple[str, object]]:
    """The rows named in labels (comma-separated, the table's order kept), all where None; a label the
    shape's table lacks is refused by name (a short run's typo would time nothing of it)."""
    if labels is None:
        return rows
    wanted = [s for s in labels.split(",") if s]
    missing = [s for s in wanted if s not in dict(rows)]
    if missing:
        raise SystemExit(f"bench.kernels.hmma_knobs --labels: {', '.join(missing)} not in {name}'s table "
                         f"(expected some of: {', '.join(label for label, _ in rows)})")
    return [(label, cfg) for label, cfg in rows if label in wanted]


def graph_us(fns, copies: int, smoke: bool) -> float:
    """µs a call of fns (one a weight copy) replayed in one CUDA graph; under --smoke one run's wall clock."""
    t = harness.time_graph(fns, repeats=1 if smoke else 20, warmup=0 if smoke else 3, cuda=not smoke)
    return t.median_ms * 1e3 / copies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap)
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    ap.add_argument("--labels", help="time only these rows of each shape's table (comma-separated), for a short run")
    args = ap.parse_args(argv)
    unknown = [name for name in args.shapes.split(",") if name not in SPLIT]
    if unknown:
        sys.exit(f"bench.kernels.hmma_knobs --shapes: {', '.join(unknown)} unknown (expected some of: {', '.join(SPLIT)})")
    if reason := harness.refuse_device("bench.kernels.hmma_knobs", args.smoke):
        print(reason, file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    from specpilot.formats.u12 import pack_u12
    from specpilot.kernels.u12 import u12_linear

    shapes = {"o": (32, 256)} if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}

    def save(rows: list[dict]) -> Path | None:  # after every shape: a run cut by its time limit keeps what it timed
        return harness.write_run(args, "hmma_knobs", device, rows, tuned=tuned_rows,
                                 timing="median replay of a CUDA graph of one call per distinct weight copy "
                                        "(about 2 GB), min of two; us")

    def table(name: str, n: int, k: int) -> list[tuple[str, U12Config]]:
        tuned = (U12Config(64, 32, split_k=SPLIT[name], num_warps=4, num_stages=1, kernel="hmma", maxnreg=128)
                 if args.smoke else TUNED_TILES[(16, n, k)])
        return pick(configs(name, tuned), args.labels, name)

    tables = {name: table(name, n, k) for name, (n, k) in shapes.items()}  # every --labels checked first
    gen = torch.Generator(device=device).manual_seed(0)
    rows, wrong, tuned_rows, out = [], [], [], None
    for name, (n, k) in shapes.items():
        cfgs = tables[name]
        copies = 1 if args.smoke else max(2, int(2e9 // (n * k * 2)))
        ws = [(torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(copies)]
        packed = [pack_u12(w, layout="tiles") for w in ws]
        x = torch.randn(16, k, device=device, generator=gen).to(torch.bfloat16)
        ref = x.float() @ ws[0].float().T
        times: dict[str, list[float]] = {}
        errors: dict[str, float] = {}
        for _ in range(1 if args.smoke else 2):
            times.setdefault("cublas", []).append(graph_us([lambda w=w: torch.matmul(x, w.T) for w in ws], copies,
                                                           args.smoke))
            for label, cfg in cfgs:
                try:  # a config this Triton cannot compile or launch is reported, the rest still timed
                    y = u12_linear(x, packed[0], cfg)
                except Exception as e:  # noqa: BLE001 (the run is a device lease: one failure must not end it)
                    wrong.append(f"{name} {label} ({cfg}): failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
                    print("FAILED", wrong[-1], flush=True)
                    continue
                errors[label] = err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                if not err < 1e-2:  # wrong: reported, never timed
                    wrong.append(f"{name} {label} ({cfg}): relative error {err:.3g} against x · Wᵀ")
                    continue
                times.setdefault(label, []).append(
                    graph_us([lambda t=t, cfg=cfg: u12_linear(x, t, cfg) for t in packed], copies, args.smoke))
        best = {label: min(v) for label, v in times.items()}
        rows.append(dict(name=name, N=n, K=k, M=16, us=best, rel_err=errors,
                         configs={label: str(c) for label, c in cfgs}))
        win = min((label for label in best if label != "cublas"), key=best.get, default=None)
        if win is not None:  # the shape's fastest config as a TUNED_TILES entry (bench/steps/step_ab.py --tiles-tuned)
            cfg = dict(cfgs)[win]
            tuned_rows.append(dict(key=[16, n, k], layout="tiles", label=win, us=best[win], cublas_us=best["cublas"],
                                   config=str(cfg), **dataclasses.asdict(cfg)))
        print(f"{name:8}" + " ".join(f" {label} {us:.2f}" for label, us in best.items()), flush=True)
        out = save(rows)
        del ws, packed
        if not args.smoke:
            torch.cuda.empty_cache()
    print("wrote", out)
    for line in dict.fromkeys(wrong):
        print("WRONG", line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
