"""The hmma kernel's knobs (kernels/u12_hmma.py's ``AHEAD``, a register double buffer,
with ``AHEAD_X``'s x prefetch or without, and ``ESC_SPLIT``, the escapes walked by the splits) at
M = 16 on tiled weights, against the same kernel without them and cuBLAS bf16, at the Llama-3.1-8B
layer shapes.

Per shape (qkv, o, gate_up, down; random N(0, 0.02) weights, escapes about 1.5e-4 of them,
bench/results/u12_stats.json; distinct copies of about 2 GB so every call reads HBM): cuBLAS;
TUNED_TILES' config as it is ("tuned"), with AHEAD (its block_w at 32, the most AHEAD takes), with
AHEAD and AHEAD_X, with the weight loads' cache policy (``W_CACHE``: "-wca", "-wcg", "-wef"), with
ESC_SPLIT (split-K shapes) and with ESC_SPLIT and AHEAD; 64-row programs of 4 warps held to 168
registers, and 16-row programs of one warp, each without and with AHEAD (the one-warp ones with
AHEAD_X too); 32-row programs of 2 warps at 128 registers with AHEAD; WARP_K's
programs ("wk" rows: the warps on a program's 16 or 32 rows, each its share of the words), 4 warps
on 16 rows without a split (and with AHEAD) or with 2, 2 warps of 4 splits, 4 warps on 32 rows, 8 warps
on 16 or 32 rows; more warps an SM ("bw" rows: 16-word chunks at 80 registers, and 16- or 32-word chunks
at 64-128 registers with twice the tuned splits, "-sk2x"). Each
config is checked against x · Wᵀ in fp32 first (relative error under 1e-2), then timed as the
median replay of a CUDA graph of one call per copy, twice, the minimum kept (bench/u12_linear.py's
time_graph). Writes bench/results/u12_hmma_knobs_<gpu>.json (GPU, versions, commit; its "tuned"
list: each shape's fastest config, a TUNED_TILES entry with its knobs as U12Config fields, which
bench/step_ab.py --tiles-tuned times in the verify step) and prints a line a shape.

    python bench/hmma_knobs.py [--shapes o,down,qkv,gate_up] [--labels tuned,wk4-bn16,...] [--out FILE]
    python bench/hmma_knobs.py --smoke --out FILE   # o at 32 x 256 on the CPU (TRITON_INTERPRET=1): checks the script
    (SPECPILOT_COMMIT=... names the commit where the tree has no .git)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from u12_linear import SHAPES, git_commit, smoke_or_gpu, time_list, write_result  # noqa: E402

SPLIT = {"qkv": 4, "o": 8, "gate_up": 1, "down": 8}  # TUNED_TILES' splits


def configs(name: str, tuned) -> list[tuple[str, object]]:
    """(label, config): a label holds "-ahead" where the config's ahead is on, ends in "-ahead-x"
    where its ahead_x is too, holds "-escsplit" where its esc_split is, starts "wk" where its warp_k is."""
    from specpilot.kernels.u12_linear import U12Config

    hmma = dict(num_stages=1, kernel="hmma", split_k=SPLIT[name])
    ahead, ahead_x = dict(ahead=True), dict(ahead=True, ahead_x=True)
    at32 = dataclasses.replace(tuned, block_w=32)  # the most AHEAD takes
    w4, w1 = U12Config(64, 32, num_warps=4, maxnreg=168, **hmma), U12Config(16, 32, num_warps=1, maxnreg=168, **hmma)
    rows = [
        ("tuned", tuned),
        ("tuned-ahead", dataclasses.replace(at32, **ahead)),
        ("tuned-ahead-x", dataclasses.replace(at32, **ahead_x)),
        ("w4-r168", w4),
        ("w4-r168-ahead", dataclasses.replace(w4, **ahead)),
        ("w1-r168", w1),
        ("w1-r168-ahead", dataclasses.replace(w1, **ahead)),
        ("w1-r168-ahead-x", dataclasses.replace(w1, **ahead_x)),
        ("w2-r128-ahead", U12Config(32, 32, num_warps=2, maxnreg=128, **ahead, **hmma)),
        # 32-row programs of 2 warps, the tuned warps in flight in twice the programs: gate_up's 448
        # 64-row programs leave 52 of 132 SMs a fourth (bench/hmma_trace.py on the H200: its slowest
        # loop 46.5 µs against a median 40.75), its 896 of 32 rows 7 or 6 an SM. TUNED_TILES' since
        # (qkv at block_w 64); "w4-r128" the 64-row, 4-warp configs before (qkv's at 168 registers: "w4-r168")
        ("w2-r128", U12Config(32, 32, num_warps=2, maxnreg=128, **hmma)),
        ("w4-r128", U12Config(64, 32, num_warps=4, maxnreg=128, **hmma)),
        # the weight loads' cache policy (u12_hmma.W_CACHE, whose default "tuned" runs): both caches, L2 only,
        # L1 evict-first
        ("tuned-wca", dataclasses.replace(tuned, w_cache="ca")),
        ("tuned-wcg", dataclasses.replace(tuned, w_cache="cg")),
        ("tuned-wef", dataclasses.replace(tuned, w_cache="ef")),
    ]
    wk = dict(num_stages=1, kernel="hmma", warp_k=True)  # WARP_K: the warps split a program's words, fewer splits
    wk4 = U12Config(16, 32, num_warps=4, maxnreg=128, **wk)
    rows += [
        ("wk4-bn16", wk4),
        ("wk4-bn16-ahead", dataclasses.replace(wk4, ahead=True)),
        ("wk4-bn16-sk2", dataclasses.replace(wk4, split_k=2)),
        ("wk2-bn16-sk4", U12Config(16, 32, split_k=4, num_warps=2, maxnreg=128, **wk)),
        ("wk4-bn32", U12Config(32, 32, num_warps=4, maxnreg=168, **wk)),
        ("wk8-bn16", dataclasses.replace(wk4, num_warps=8)),
        ("wk8-bn32", U12Config(32, 32, num_warps=8, maxnreg=168, **wk)),
    ]
    # More warps an SM: a one-group chunk (block_w 16) keeps the loop's loads before its first MMA
    # at 80 registers where two groups (32) issue 8 after it (bench/results/kernel_static_knobs_sm90_triton36.json),
    # so 6-8 programs an SM where TUNED_TILES' 128 hold 4; and twice the splits, the programs to fill
    # them. Each slower than tuned on an H100 (bench/results/tried/u12_hmma_knobs_occupancy_a6a74c8_h100.json)
    sk = SPLIT[name]
    occ = dict(num_stages=1, kernel="hmma", num_warps=4)
    rows += [
        ("bw16-r80", U12Config(64, 16, split_k=sk, maxnreg=80, **occ)),
        ("bw16-sk2x-r64", U12Config(64, 16, split_k=2 * sk, maxnreg=64, **occ)),
        ("bw16-sk2x-r80", U12Config(64, 16, split_k=2 * sk, maxnreg=80, **occ)),
        ("bw32-sk2x-r80", U12Config(64, 32, split_k=2 * sk, maxnreg=80, **occ)),
        ("bw32-sk2x-r128", U12Config(64, 32, split_k=2 * sk, maxnreg=128, **occ)),
    ]
    if SPLIT[name] > 1:  # ESC_SPLIT takes split-K launches only
        rows += [("tuned-escsplit", dataclasses.replace(tuned, esc_split=True)),
                 ("tuned-escsplit-ahead", dataclasses.replace(at32, esc_split=True, **ahead))]
    return rows


def pick(rows: list[tuple[str, object]], labels: str | None, name: str) -> list[tuple[str, object]]:
    """The rows named in labels (comma-separated, the table's order kept), all where None; a label the
    shape's table lacks is refused by name (a short run's typo would time nothing of it)."""
    if labels is None:
        return rows
    wanted = [s for s in labels.split(",") if s]
    missing = [s for s in wanted if s not in dict(rows)]
    if missing:
        raise SystemExit(f"bench/hmma_knobs.py --labels: {', '.join(missing)} not in {name}'s table "
                         f"(expected some of: {', '.join(label for label, _ in rows)})")
    return [(label, cfg) for label, cfg in rows if label in wanted]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="o,down,qkv,gate_up")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--labels", help="time only these rows of each shape's table (comma-separated), for a short run")
    ap.add_argument("--smoke", action="store_true", help="o at 32 x 256 under the interpreter: the script's check, no timing")
    args = ap.parse_args(argv)
    unknown = [name for name in args.shapes.split(",") if name not in SPLIT]
    if unknown:
        sys.exit(f"bench/hmma_knobs.py --shapes: {', '.join(unknown)} unknown (expected some of: {', '.join(SPLIT)})")
    device = smoke_or_gpu("bench/hmma_knobs.py", args.smoke)
    from specpilot.kernels.u12_linear import TUNED_TILES, U12Config, u12_linear
    from specpilot.formats.u12 import pack_u12

    shapes = {"o": (32, 256)} if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()

    def save(rows: list[dict]) -> Path:  # after every shape: a run cut by its time limit keeps what it timed
        result = dict(
            benchmark="hmma_knobs", what=__doc__.split("\n\n")[0].replace("\n", " "),
            timing="median replay of a CUDA graph of one call per distinct weight copy (about 2 GB), min of two; us",
            gpu=gpu, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
            git_commit=git_commit(("kernels/u12_hmma.py", "bench/hmma_knobs.py")),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows,
            tuned=tuned_rows)
        return write_result(result, args.out, "u12_hmma_knobs", gpu)

    def table(name: str, n: int, k: int) -> list[tuple[str, object]]:
        tuned = (U12Config(64, 32, split_k=SPLIT[name], num_warps=4, num_stages=1, kernel="hmma", maxnreg=128)
                 if args.smoke else TUNED_TILES[(16, n, k)])
        return pick(configs(name, tuned), args.labels, name)

    tables = {name: table(name, n, k) for name, (n, k) in shapes.items()}  # every --labels checked first
    gen = torch.Generator(device=device).manual_seed(0)
    rows, wrong, tuned_rows = [], [], []
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
            times.setdefault("cublas", []).append(time_list([lambda w=w: torch.matmul(x, w.T) for w in ws], args.smoke) * 1e3 / copies)
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
                    time_list([lambda t=t, cfg=cfg: u12_linear(x, t, cfg) for t in packed], args.smoke) * 1e3 / copies)
        best = {label: min(v) for label, v in times.items()}
        rows.append(dict(name=name, N=n, K=k, M=16, us=best, rel_err=errors,
                         configs={label: str(c) for label, c in cfgs}))
        win = min((label for label in best if label != "cublas"), key=best.get, default=None)
        if win is not None:  # the shape's fastest config as a TUNED_TILES entry (bench/step_ab.py --tiles-tuned)
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
