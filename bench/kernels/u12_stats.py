"""u12 cost of N(0, 0.02) bf16 weights at the Llama-3.1-8B linear shapes, and of the zoo's trained
models (CPU).

Prints a table and writes bench/results/u12_stats_cpu.json (records: the Llama-3.1-8B shapes; zoo:
the trained models; model: the whole target's linears) through the harness. The weights are i.i.d., so the statistics
do not depend on the shape beyond sampling noise; to bound memory (pack_u12 keeps a few int32
copies of its input) tensors of more than MAX_ROWS rows are measured on their first MAX_ROWS
rows, which the file records as "rows_measured". Zoo: every 2-D weight matrix of each committed
model (zoo/<pair>/<model>/model.safetensors; the embedding, which a tied head reads too), summed
per model; "lanes" is the widest tensor's (``U12Tensor.esc_lanes``; 0: some tensor has none).

    python -m bench.kernels.u12_stats [--out FILE|DIR]
"""

from __future__ import annotations

import argparse
import sys

import torch
from safetensors.torch import load_file

from bench import shapes
from specpilot.bench import harness
from specpilot.formats.u12 import u12_stats
from specpilot.runtime.builtin import resolve_builtin
from specpilot.zoo import PAIRS

SIGMA = 0.02
SEED = 0
MAX_ROWS = 16384


def linears(name: str = shapes.LLAMA_8B) -> dict[str, tuple[int, int, int]]:
    """name: (N, K, instances in the model) of the target's linears: each layer's, and the head once."""
    layers = shapes.config(name)["num_hidden_layers"]
    return {lin: (n, k, 1 if lin == "lm_head" else layers) for lin, (n, k) in shapes.layer_linears(name).items()}


def zoo_rows() -> list[dict]:
    """Per committed zoo model: its 2-D weight matrices in u12, summed (stored and read bits a
    weight weighted by size, escapes, the widest lanes)."""
    rows = []
    for pair in PAIRS:
        zoo = resolve_builtin(pair).parent
        for path in sorted(zoo.glob("*/model.safetensors")):
            rows.append(dict(model=f"{pair}/{path.parent.name}", **u12_row(path)))
    return rows


def u12_row(path) -> dict:
    """A weights file's 2-D matrices in u12, summed."""
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
    return {"tensors": tensors, "weights": weights, "bits_per_weight": stored / weights,
            "escape_rate": escapes / weights, "lanes": max(lanes, 0), "read_bits_per_weight": read / weights}


def main(argv: list[str] | None = None) -> int:
    args = harness.add_results_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                                    smoke=False).parse_args(argv)
    g = torch.Generator().manual_seed(SEED)
    rows, total_weights, total_bits = [], 0, 0.0
    for name, (n, k, count) in linears().items():
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

    zoo = zoo_rows()
    model = {"linear_weights": total_weights, "bits_per_weight": total_bits / total_weights,
             "bytes_bf16": 2 * total_weights, "bytes_u12": total_bits / 8,
             "ratio_to_bf16": total_bits / (16 * total_weights)}
    out = harness.write_run(args, "u12_stats", "cpu", rows,
                            what="u12 format cost of N(0, 0.02) bf16 weights at Llama-3.1-8B linear shapes",
                            sigma=SIGMA, seed=SEED, zoo=zoo, model=model)

    print(f"{'tensor':<8} {'shape':>13} {'rows':>6} {'bits/w':>8} {'escape rate':>12} {'exps':>5} {'H(exp)':>7} "
          f"{'coverage':>10} {'lanes':>5} {'read b/w':>8}")
    for r in rows:
        print(f"{r['name']:<8} {'x'.join(map(str, r['shape'])):>13} {r['rows_measured']:>6} {r['bits_per_weight']:>8.4f} "
              f"{r['escape_rate']:>12.3e} {r['distinct_exponents']:>5} {r['exponent_entropy_bits']:>7.3f} "
              f"{r['window_coverage']:>10.5%} {r['lanes']:>5} {r['read_bits_per_weight']:>8.4f}")
    print(f"{'zoo model':<22} {'tensors':>7} {'weights':>9} {'bits/w':>8} {'escape rate':>12} {'lanes':>5} {'read b/w':>8}")
    for z in zoo:
        print(f"{z['model']:<22} {z['tensors']:>7} {z['weights']:>9} {z['bits_per_weight']:>8.4f} "
              f"{z['escape_rate']:>12.3e} {z['lanes']:>5} {z['read_bits_per_weight']:>8.4f}")
    m = model
    print(f"model linears: {m['linear_weights'] / 1e9:.2f} G weights, {m['bits_per_weight']:.4f} bits/weight, "
          f"{m['bytes_u12'] / 1e9:.2f} GB vs {m['bytes_bf16'] / 1e9:.2f} GB bf16 ({m['ratio_to_bf16']:.4f}x)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
