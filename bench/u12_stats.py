"""u12 cost of N(0, 0.02) bf16 weights at the Llama-3.1-8B linear shapes, and of the zoo's trained
models (CPU).

Prints a table and writes bench/results/u12_stats.json. The weights are i.i.d., so the statistics
do not depend on the shape beyond sampling noise; to bound memory (pack_u12 keeps a few int32
copies of its input) tensors of more than MAX_ROWS rows are measured on their first MAX_ROWS
rows, which the file records as "rows_measured". Zoo: every 2-D weight matrix of each committed
model (zoo/<pair>/<model>/model.safetensors; the embedding, which a tied head reads too), summed
per model; "lanes" is the widest tensor's (``U12Tensor.esc_lanes``; 0: some tensor has none).

    python bench/u12_stats.py
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from specpilot.formats.u12 import u12_stats

SIGMA = 0.02
SEED = 0
MAX_ROWS = 16384
# name: (N, K, instances in the model)
LLAMA_31_8B = {
    "qkv": (6144, 4096, 32),
    "o": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 1),
}
OUT = Path(__file__).resolve().parent / "results" / "u12_stats.json"
ZOO = Path(__file__).resolve().parent.parent / "specpilot" / "zoo"


def git_commit() -> str:
    """HEAD, marked dirty when the files behind these numbers differ from it."""
    root = Path(__file__).resolve().parent.parent
    run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout.strip()
    commit = run("rev-parse", "HEAD") or "unknown"
    return commit + ("-dirty" if run("status", "--porcelain", "--", "bench/u12_stats.py", "specpilot/formats/u12.py") else "")


def zoo_rows() -> list[dict]:
    """Per committed zoo model: its 2-D weight matrices in u12, summed (stored and read bits a
    weight weighted by size, escapes, the widest lanes)."""
    rows = []
    for path in sorted(ZOO.glob("*/*/model.safetensors")):
        weights, stored, read, escapes, lanes, tensors = 0, 0.0, 0.0, 0, 0, 0
        for name, w in load_file(path).items():
            if w.dim() != 2 or not name.endswith(".weight"):
                continue
            s = u12_stats(w.to(torch.bfloat16))
            n = w.numel()
            weights, tensors, escapes = weights + n, tensors + 1, escapes + s["escapes"]
            stored += n * s["bits_per_weight"]
            read += n * s["read_bits_per_weight"]
            lanes = -1 if lanes < 0 or s["lanes"] == 0 else max(lanes, s["lanes"])
        rows.append({"model": str(path.parent.relative_to(ZOO)), "tensors": tensors, "weights": weights,
                     "bits_per_weight": stored / weights, "escape_rate": escapes / weights,
                     "lanes": max(lanes, 0), "read_bits_per_weight": read / weights})
    return rows


def main() -> None:
    g = torch.Generator().manual_seed(SEED)
    rows, total_weights, total_bits = [], 0, 0.0
    for name, (n, k, count) in LLAMA_31_8B.items():
        measured = min(n, MAX_ROWS)
        w = (torch.randn(measured, k, generator=g) * SIGMA).to(torch.bfloat16)
        s = u12_stats(w)
        rows.append({
            "name": name, "shape": [n, k], "instances": count, "rows_measured": measured,
            **s, "window_coverage": 1 - s["escape_rate"],
        })
        total_weights += n * k * count
        total_bits += n * k * count * s["bits_per_weight"]
        del w

    result = {
        "what": "u12 format cost of N(0, 0.02) bf16 weights at Llama-3.1-8B linear shapes",
        "sigma": SIGMA, "seed": SEED, "device": "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "git_commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "tensors": rows,
        "zoo": zoo_rows(),
        "model": {
            "linear_weights": total_weights,
            "bits_per_weight": total_bits / total_weights,
            "bytes_bf16": 2 * total_weights,
            "bytes_u12": total_bits / 8,
            "ratio_to_bf16": total_bits / (16 * total_weights),
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{'tensor':<8} {'shape':>13} {'rows':>6} {'bits/w':>8} {'escape rate':>12} {'exps':>5} {'H(exp)':>7} "
          f"{'coverage':>10} {'lanes':>5} {'read b/w':>8}")
    for r in rows:
        print(f"{r['name']:<8} {'x'.join(map(str, r['shape'])):>13} {r['rows_measured']:>6} {r['bits_per_weight']:>8.4f} "
              f"{r['escape_rate']:>12.3e} {r['distinct_exponents']:>5} {r['exponent_entropy_bits']:>7.3f} "
              f"{r['window_coverage']:>10.5%} {r['lanes']:>5} {r['read_bits_per_weight']:>8.4f}")
    print(f"{'zoo model':<22} {'tensors':>7} {'weights':>9} {'bits/w':>8} {'escape rate':>12} {'lanes':>5} {'read b/w':>8}")
    for z in result["zoo"]:
        print(f"{z['model']:<22} {z['tensors']:>7} {z['weights']:>9} {z['bits_per_weight']:>8.4f} "
              f"{z['escape_rate']:>12.3e} {z['lanes']:>5} {z['read_bits_per_weight']:>8.4f}")
    m = result["model"]
    print(f"model linears: {m['linear_weights'] / 1e9:.2f} G weights, {m['bits_per_weight']:.4f} bits/weight, "
          f"{m['bytes_u12'] / 1e9:.2f} GB vs {m['bytes_bf16'] / 1e9:.2f} GB bf16 ({m['ratio_to_bf16']:.4f}x)")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
