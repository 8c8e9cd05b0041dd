"""Regenerate the README's result tables from bench/results/*.json (never typed by hand).

    python bench/readme_tables.py          # rewrites the marked sections of README.md in place

A section is `<!-- results:NAME -->` ... `<!-- /results:NAME -->`; NAME picks the renderer below.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def step_times() -> str:
    d = _load("step_times_h200.json")
    if d is None:
        return "_no results file yet: run `python bench/step_times.py` on a GPU_"
    lines = [
        f"{d['gpu']}, torch {d['torch']}, commit {d['commit'].split()[0]}; read bandwidth measured in the same run: "
        f"{d['read_bandwidth_Bps'] / 1e12:.2f} TB/s. Source: `bench/results/step_times_h200.json`.",
        "",
        "| shape | step | q | ms | weight-read floor ms | × floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['shape']} | {r['what']} | {r['q']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['ms'] / r['floor_ms']:.2f} |")
    return "\n".join(lines)


def u12_stats() -> str:
    d = _load("u12_stats.json")
    if d is None:
        return "_no results file yet: run `python bench/u12_stats.py`_"
    lines = [
        f"N(0, {d['sigma']}) bf16 weights at Llama-3.1-8B shapes ({d['device']}). Source: `bench/results/u12_stats.json`.",
        "",
        "| tensor | shape | bits/weight | escape rate | window coverage |",
        "|---|---|---:|---:|---:|",
    ]
    for t in d["tensors"]:
        lines.append(f"| {t['name']} | {t['shape'][0]}×{t['shape'][1]} | {t['bits_per_weight']:.3f} | "
                     f"{t['escape_rate']:.2e} | {100 * t['window_coverage']:.3f}% |")
    return "\n".join(lines)


def u12_linear() -> str:
    d = _load("u12_linear_nvidia_h200.json")
    if d is None:
        return "_no results file yet: run `python bench/u12_linear.py` on a GPU_"
    rows = d.get("rows") or d.get("results") or []
    lines = [
        f"{d.get('gpu', '?')}, torch {d.get('torch', '?')}, triton {d.get('triton', '?')}. "
        "Source: `bench/results/u12_linear_nvidia_h200.json`.",
        "",
        "| shape | M | cuBLAS bf16 µs | u12 µs | speedup |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['M']} | {r['cublas_us']:.1f} | {r['u12_us']:.1f} | {r['speedup']:.2f}× |")
    return "\n".join(lines)


def cost_vs_measured() -> str:
    d = _load("cost_vs_measured_h200.json")
    if d is None:
        return "_no results file yet: run `python bench/cost_vs_measured.py`_"
    lines = [
        "Llama-3.1-8B shapes, batch 1, 512-token cache, CUDA graphs. Source: `bench/results/cost_vs_measured_h200.json`.",
        "",
        "| measured in | model | step | q | measured ms | predicted ms | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['source']} | {r['model']} | {r['what']} | {r['q']} | {r['measured_ms']:.2f} | "
                     f"{r['predicted_ms']:.2f} | {100 * r['error']:+.1f}% |")
    return "\n".join(lines)


def zoo_tau() -> str:
    d = _load("zoo_tau_cpu.json")
    if d is None:
        return "_no results file yet: run `python bench/zoo_tau.py`_"
    env = d["environment"]
    lines = [
        f"Pair `{d['pair']}`, chain verification at the drafter's trained block, greedy, fp32 on {env['device']} "
        f"(torch {env['torch']}, commit {env['commit']}). Source: `bench/results/zoo_tau_cpu.json`.",
        "",
        "| drafter | block | prompts | τ | steps by accepted drafts (0, 1, 2, …) | outputs = AR | token forcing |",
        "|---|---:|---|---:|---|---|---|",
    ]
    for r in d["rows"]:
        hist = r["acceptance_histogram"]
        while len(hist) > 1 and hist[-1] == 0:
            hist = hist[:-1]
        lines.append(f"| {r['drafter']} | {r['block_size']} | {r['prompts']} ({r['num_prompts']}) | {r['tau']:.2f} | "
                     f"{', '.join(map(str, hist))} | {r['outputs_equal_ar']} | {r['token_forcing'].split(':')[0]} |")
    return "\n".join(lines)


def tree_tau() -> str:
    d = _load("tree_tau_cpu.json")
    if d is None:
        return "_no results file yet: run `python bench/tree_tau.py`_"
    lines = [
        f"{d['device']}, {d['threads']} thread, torch {d['torch']}, commit {d['git_commit'][:12]}. "
        "Source: `bench/results/tree_tau_cpu.json`. ms/token on a CPU says little about a GPU, where "
        "verifying 64 tokens costs about one AR step.",
        "",
        "| target | drafter | verify | τ | ms/token | AR ms/token | outputs = AR |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for r in d["rows"]:
        verify = "chain" if r["verify"] == "chain" else f"tree {r['budget']} (top-{r['topk']})"
        lines.append(f"| {r['target']} | {r['drafter']['kind']} b{r['drafter']['block_size']} | {verify} | "
                     f"{r['tau']:.2f} | {r['ms_per_token']:.2f} | {r['ar_ms_per_token']:.2f} | {r['outputs_equal_ar']} |")
    return "\n".join(lines)


RENDERERS = {"zoo_tau": zoo_tau, "tree_tau": tree_tau, "cost_vs_measured": cost_vs_measured, "step_times": step_times, "u12_stats": u12_stats, "u12_linear": u12_linear}


def render(text: str) -> str:
    def replace(m: re.Match) -> str:
        name = m.group(1)
        body = RENDERERS[name]() if name in RENDERERS else f"_unknown results section {name!r}_"
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    return re.sub(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", replace, text, flags=re.S)


def main() -> int:
    readme = ROOT / "README.md"
    readme.write_text(render(readme.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
