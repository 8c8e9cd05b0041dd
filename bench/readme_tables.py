"""Regenerate every table that quotes a results file, from the results files (never typed by hand).

    python -m bench.readme_tables      # rewrites the marked regions of README.md and docs/experiments/*.md

A region is `<!-- results:NAME -->` ... `<!-- /results:NAME -->`; NAME picks the renderer in RENDERERS
(each renderer's region lives in one document: README.md holds `headline`, each study's page in
docs/experiments/ its own). Each renderer reads named files of bench/results/ and says which.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from specpilot.bench.harness import RESULTS, ROOT

DOCUMENTS = ("README.md", "docs/experiments")  # the files, or folders of *.md, whose regions are rendered
REGION = re.compile(r"<!-- results:(\w+) -->.*?<!-- /results:\1 -->", re.S)


def _short(commit: str) -> str:
    """A full hash shortened to 12 digits, any suffix kept ("-dirty"); anything else (a run from a commit
    plus a named change) whole."""
    head = re.match(r"[0-9a-f]{13,}", commit)
    return commit[:12] + commit[head.end():] if head else commit


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _load_present(names) -> list[tuple[str, dict]]:
    """(name, contents) of those results files that exist, in order."""
    return [(name, d) for name in names if (d := _load(name)) is not None]


def _missing(command: str, where: str = "") -> str:
    return f"_no results file yet: run `{command}`{' ' + where if where else ''}_"


def _where(d: dict) -> str:
    """The card a file was measured on, or "cpu"."""
    return "cpu" if d["gpu"] == "cpu" else d["device"]


def _version(d: dict, package: str) -> str:
    return d["versions"].get(package) or "?"


STEP_TIMES, STEP_TIMES_QWEN = "step_times_h200_llama.json", "step_times_h200_qwen.json"


def step_times() -> str:
    d = _load(STEP_TIMES)
    if d is None:
        return _missing("python -m bench.steps.step_times --shapes llama-3.1-8b", "on a GPU")
    rows = {(r["path"], r["what"], r["q"]): r for r in d["records"]}
    ar = rows["fused", "ar", 1]["ms"]
    lines = [
        f"{d['device']}, Llama-3.1-8B shapes, torch {_version(d, 'torch')}, triton {_version(d, 'triton')}, commit "
        f"{d['commit'].split()[0]}; read bandwidth measured in the same run: {d['read_bandwidth_Bps'] / 1e12:.2f} TB/s. "
        f"Source: `bench/results/{STEP_TIMES}`. torch: the reference stack; fused: the fused-decoder "
        "stacks (target and DFlash drafter) with split-KV attention over a device-length cache; fused+u12: the "
        "same with every linear and lm_head in the 12-bit format; fused-cublas: the fused path with fused_linear off "
        "(cuBLAS GEMMs beside separate norm, SiLU·mul and add kernels); at q = 4 both paths run cuBLAS "
        "(fused_linear serves 1, 5..16 and 32 rows), so that pair shows the run's spread; RoPE apart: the fused step with rope_qkv and "
        "split-KV attention as separate launches (what kernels/rope_attention.py does in one); fused-pdl: the fused "
        "AR step with programmatic "
        "dependent launch (kernels/overlap.py, off by default); u12 unfused: the fused+u12 AR step with u12_linear "
        "beside separate norm, SiLU·mul and add kernels (the default is u12_fused_linear's epilogues, each norm "
        "after o and down handed to the next GEMV: NormHandoff); u12 norm prologue: with u12_fused_linear's norm "
        "prologue instead. Tree rows: k-ary top-4 trees, "
        "q = nodes + anchor.",
        "",
        "| step | q | floor ms | torch ms | fused ms | fused × floor | fused × fused AR | fused-cublas ms "
        "| RoPE apart ms | fused-pdl ms | fused+u12 ms | u12 speedup | u12 unfused ms | u12 norm prologue ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    col = lambda path, what, q: f"{rows[path, what, q]['ms']:.2f}" if (path, what, q) in rows else ""  # noqa: E731
    for (path, what, q), r in rows.items():
        if path == "fused-vocab":  # the draft-vocab pass's head: the draft row again, its own floor
            lines.append(f"| draft, head over {r['draft_vocab']} ids | {q} | {r['floor_ms']:.2f} | | {r['ms']:.2f} | "
                         f"{r['ms'] / r['floor_ms']:.2f} | {r['ms'] / ar:.2f} (of the target AR) | | | | | | | |")
        if path != "fused":
            continue
        of_ar = f"{r['ms'] / ar:.2f}" + (" (of the target AR)" if what == "draft" else "")
        u12 = rows.get(("fused+u12", what, q))  # the default u12 path
        u12_cols = f"{u12['ms']:.2f} | {r['ms'] / u12['ms']:.2f}×" if u12 else " | "
        lines.append(f"| {what} | {q} | {r['floor_ms']:.2f} | {rows['torch', what, q]['ms']:.2f} | {r['ms']:.2f} | "
                     f"{r['ms'] / r['floor_ms']:.2f} | {of_ar} | {col('fused-cublas', what, q)} | "
                     f"{col('fused-rope-apart', what, q)} | {col('fused-pdl', what, q)} | {u12_cols} | "
                     f"{col('fused+u12-unfused', what, q)} | {col('fused+u12-prologue', what, q)} |")
    qwen_file = _load(STEP_TIMES_QWEN)
    if qwen_file:
        qwen = {(r["what"], r["q"]): r for r in qwen_file["records"] if r["shape"] == "qwen3-8b" and r["path"] == "fused"}
        lines += ["", f"Qwen3-8B shapes (36 layers, qk-norm, vocabulary 151936), another run: commit "
                  f"{qwen_file['commit'].split()[0]}, read bandwidth {qwen_file['read_bandwidth_Bps'] / 1e12:.2f} TB/s; "
                  "TUNED holds Llama-3.1-8B's shapes, and Qwen3-8B's gate_up and down take the nearest of them "
                  f"(kernels/tuning.py). Source: `bench/results/{STEP_TIMES_QWEN}`.", "",
                  "| step | q | floor ms | fused ms | fused × floor | fused × fused AR | fused+u12 ms | u12 speedup |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for (what, q), r in qwen.items():
            if what in ("ar", "draft") or q in (16, 17, 64):
                of_ar = f"{r['ms'] / qwen['ar', 1]['ms']:.2f}" + (" (of the target AR)" if what == "draft" else "")
                u12 = next((u for u in qwen_file["records"] if u["path"] == "fused+u12" and u["what"] == what
                            and u["q"] == q), None)
                u12_cols = f"{u12['ms']:.2f} | {r['ms'] / u12['ms']:.2f}×" if u12 else " | "
                lines.append(f"| {what} | {q} | {r['floor_ms']:.2f} | {r['ms']:.2f} | {r['ms'] / r['floor_ms']:.2f} | "
                             f"{of_ar} | {u12_cols} |")
    return "\n".join(lines)


HF_PEERS = "hf_peers_h200.json"


def hf_peers() -> str:
    d = _load(HF_PEERS)
    if d is None:
        return _missing("python -m bench.steps.hf_peers", "on a GPU")
    lines = [
        f"{d['device']}, {d['shape']} random bf16 weights shared by every path, torch {_version(d, 'torch')}, "
        f"transformers {_version(d, 'transformers')}, commit {d['commit']}; {d['prompt_len']}-token prompt, "
        f"{d['max_new_tokens']} new tokens, decode only; weight-read floor {d['floor_ms_per_token']:.2f} ms/token. "
        f"Source: `bench/results/{HF_PEERS}`.",
        "",
        "| implementation | ms/token | tokens/s | × floor | same tokens as specpilot-eager | token forcing: hard / near-ties |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in d["records"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error'][:60]} | | | | |")
            continue
        forced = r.get("token_forcing")
        forced_col = f"{forced['hard_failures']} / {forced['near_ties']}" if forced else "not run"
        lines.append(f"| {r['impl']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {r['x_floor']:.2f} | "
                     f"{r['agree_prefix']}/{r['new_tokens']} | {forced_col} |")
    return "\n".join(lines)


def attention_split_kv() -> str:
    d = _load("attention_split_kv_h200.json")
    if d is None:
        return _missing("python -m bench.kernels.attention_split_kv", "on a GPU")
    lines = [
        f"{d['device']}, triton {_version(d, 'triton')}, commit {d['commit']} (before the combine fix); {d['timing']}. "
        "Source: `bench/results/attention_split_kv_h200.json`.",
        "",
        "| cache S | new T | SDPA µs | kernel µs | speedup | splits |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["records"]:
        lines.append(f"| {r['S']} | {r['T']} | {r['sdpa_us']:.1f} | {r['kernel_us']:.1f} | {r['speedup']:.2f}× | "
                     f"{r['plan']['splits']} |")
    return "\n".join(lines)


def u12_stats() -> str:
    d = _load("u12_stats_cpu.json")
    if d is None:
        return _missing("python -m bench.kernels.u12_stats")
    lines = [
        f"N(0, {d['sigma']}) bf16 weights at Llama-3.1-8B shapes ({_where(d)}, commit {_short(d['commit'])}). "
        "Source: `bench/results/u12_stats_cpu.json` (`python -m bench.kernels.u12_stats`).",
        "",
        "| tensor | shape | bits/weight (stored) | escape rate | window coverage | lanes a row | bits/weight a GEMV reads |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for t in d["records"]:
        lanes = (f"{t['lanes']} | {t['read_bits_per_weight']:.3f}" if t.get("lanes")
                 else "table | " + (f"{t['read_bits_per_weight']:.3f}" if "read_bits_per_weight" in t else "—"))
        lines.append(f"| {t['name']} | {t['shape'][0]}×{t['shape'][1]} | {t['bits_per_weight']:.3f} | "
                     f"{t['escape_rate']:.2e} | {100 * t['window_coverage']:.3f}% | {lanes} |")
    if d.get("zoo"):
        lines += ["", "The zoo's trained models (every 2-D weight matrix, summed; lanes: the widest tensor's):", "",
                  "| model | matrices | weights | bits/weight (stored) | escape rate | lanes a row | bits/weight a GEMV reads |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for z in d["zoo"]:
            lines.append(f"| {z['model']} | {z['tensors']} | {z['weights']} | {z['bits_per_weight']:.3f} | "
                         f"{z['escape_rate']:.2e} | {z['lanes'] or 'table'} | {z['read_bits_per_weight']:.3f} |")
    return "\n".join(lines)


U12_LINEAR_FILES = ("u12_linear_h200_gemv2-tiles.json", "u12_linear_h200_tiles.json", "u12_linear_h200_gemv2-graph.json",
                    "u12_linear_h200_mma-m32-64-graph.json", "u12_linear_h200_hmma.json", "u12_linear_h200_mma.json",
                    "u12_linear_h200_gemv2-m1.json", "u12_linear_h200_gemv2.json", "u12_linear_h200_nvidia.json")
U12_TILE_KERNEL_RUN = "u12_linear_h200_nvidia.json"  # the tile kernel's run (da24869), before gemv2


def _timing(d: dict) -> str:
    """How a u12_linear file timed its configs, in a few words."""
    return "each config in a CUDA graph" if "CUDA graph" in d.get("timing", "") else "do_bench, single launches"


def u12_linear() -> str:
    files = _load_present(U12_LINEAR_FILES)
    if not files:
        return _missing("python -m bench.kernels.u12_linear", "on a GPU")
    best: dict[tuple[str, int], tuple[dict, str]] = {}
    for name, d in files:  # the newest sweep of each (shape, M) first
        for r in d["records"]:
            best.setdefault((r["name"], r["M"]), (r, name))
    order = {name: i for i, name in enumerate(("qkv", "o", "gate_up", "down", "lm_head"))}
    lines = [
        "H200; per row the best configuration of the newest sweep that covers it (its file and commit "
        "beside it). Sources: " + ", ".join(f"`bench/results/{name}` (commit {_short(d['commit'])}, "
                                           f"triton {_version(d, 'triton')}, {_timing(d)})" for name, d in files) + ".",
        "",
        "| shape | M | cuBLAS bf16 µs | u12 µs | speedup | u12 TB/s (packed bytes) | config | file |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for (shape, m), (r, name) in sorted(best.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 9))):
        lines.append(f"| {shape} | {m} | {r['cublas_us']:.1f} | {r['u12_us']:.1f} | {r['speedup']:.2f}× | "
                     f"{r.get('u12_tb_s', 0):.2f} | {r.get('config', '')} | {name.removesuffix('.json')} |")
    name, d = files[0]
    for w in d.get("whole_step", []):
        if "error" not in w:
            lines.append(f"\nAll linears of a Llama-3.1-8B step in one CUDA graph, M = {w['M']} (`{name}`): cuBLAS "
                         f"{w['cublas_ms']:.2f} ms, u12 {w['u12_ms']:.2f} ms ({w['speedup']:.2f}×).")
    return "\n".join(lines)


def cost_vs_measured() -> str:
    d = _load("cost_vs_measured_h200.json")
    if d is None:
        return _missing("python -m bench.steps.cost_vs_measured")
    lines = [
        "Llama-3.1-8B shapes, batch 1, 512-token cache, CUDA graphs. Source: `bench/results/cost_vs_measured_h200.json`.",
        "",
        "| measured in | model | step | q | measured ms | predicted ms | error |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in d["records"]:
        lines.append(f"| {r['source']} | {r['model']} | {r['what']} | {r['q']} | {r['measured_ms']:.2f} | "
                     f"{r['predicted_ms']:.2f} | {100 * r['error']:+.1f}% |")
    if d.get("fused_linear_fit"):
        lines += ["", "fused_linear's efficiency in the model (gpus.yaml `triton-fused-linear`), fitted to the fused "
                  "steps' profiles: " + "; ".join(
                      f"{f['rows']} row{'s' if f['rows'] > 1 else ''}: {f['launches']} launches, "
                      f"{f['measured_kernel_ms']:.3f} ms of kernel time against {f['stock_priced_ms']:.3f} at the stock "
                      f"GEMM pricing, efficiency {f['efficiency']:.3f}" for f in d["fused_linear_fit"]) + "."]
    if d.get("predicted"):
        lines += ["", "Predicted, not yet measured: " + ", ".join(
            f"a {r['budget']}-node tree verify (q = {r['q']}) {r['predicted_ms']:.2f} ms" for r in d["predicted"]) + "."]
    return "\n".join(lines)


ZOO_TAU_FILES = ("zoo_tau_cpu.json", "zoo_tau_cpu_next.json", "zoo_tau_h200.json", "zoo_tau_h200_next.json")


def zoo_tau() -> str:
    files = _load_present(ZOO_TAU_FILES)
    if not files:
        return _missing("python -m bench.e2e.zoo_tau")
    lines = [
        "Chain verification at the drafter's trained block, greedy; CPU in fp32, H200 in bf16 (with the "
        "`cuda-graphs` pass for the attention pair: graphed steps against the graphed AR baseline; the hybrid "
        "runs eager loops on both sides). Speedup: decode time of AR / of the speculative loop, prefill excluded. "
        "Sources: " + ", ".join(f"`bench/results/{name}`" for name, _ in files) + ".",
        "",
        "| pair | device | drafter | block | prompts | τ | steps by accepted drafts (0, 1, 2, …) | speedup | outputs = AR | token forcing |",
        "|---|---|---|---:|---|---:|---|---:|---|---|",
    ]
    for _, d in files:
        device = _where(d)
        for r in d["records"]:
            hist = r.get("acceptance_histogram") or []
            while len(hist) > 1 and hist[-1] == 0:
                hist = hist[:-1]
            lines.append(f"| {d['pair']} | {device} | {r['drafter']} | {r['block_size']} | {r['prompts']} "
                         f"({r['num_prompts']}) | {r['tau']:.2f} | {', '.join(map(str, hist)) or 'not kept'} | "
                         f"{r['speedup_over_ar']:.2f}× | {r.get('outputs_equal_ar', '-')} | "
                         f"{r['token_forcing'].split(':')[0]} |")
    return "\n".join(lines)


ZOO_E2E = "zoo_e2e_h200.json"


def _strongest_ar(d: dict) -> dict:
    """A zoo_e2e file's fastest AR record (ours or HF's): what its speedups are against."""
    return min((r for r in d["records"] if r["impl"].startswith(("ar", "hf-ar")) and "ms_per_token" in r),
               key=lambda r: r["ms_per_token"])


def zoo_e2e() -> str:
    files = _load_present((ZOO_E2E,))
    if not files:
        return _missing("python -m bench.e2e.zoo_e2e", "on a GPU")
    name, d = files[0]
    best = _strongest_ar(d)
    lines = [
        f"{d['device']}, {d['dtype']}, torch {_version(d, 'torch')}, transformers {_version(d, 'transformers')}, "
        f"commit {_short(d['commit'])}; "
        f"{d['num_prompts']} {d['prompts']} prompts × {d['max_new_tokens']} new tokens, batch 1, greedy, decode only. "
        f"Source: `bench/results/{name}`. graphed: a step a CUDA graph replay; fused: the fused decoder stacks and "
        f"split-KV attention as well. Speedup: against the strongest AR of the run (`{best['impl']}`), prefill excluded; "
        "\"= AR\": outputs equal to our eager AR's (in bf16, q = 1 and q > 1 forwards round differently and part "
        "at near-ties; token forcing in `zoo_tau` is the losslessness check).",
        "",
        "| implementation | tokens/s | ms/token | speedup | τ | outputs = AR |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in d["records"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | failed: {r['error'][:80]} | | | | |")
            continue
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        lines.append(f"| {r['impl']} | {r['tokens_per_s']:.1f} | {r['ms_per_token']:.3f} | "
                     f"{best['ms_per_token'] / r['ms_per_token']:.2f}× | {tau} | {r['equal_to_ar']}/{r['prompts']} |")
    for skipped in d.get("peers_skipped", []):
        lines.append(f"\n{skipped['peer']} not run: {skipped['reason']}.")
    return "\n".join(lines)


TREE_TAU_FILES = ("tree_tau_cpu.json", "tree_tau_h200.json", "tree_tau_h200_graphs.json", "tree_tau_h200_fused.json")


def tree_tau() -> str:
    files = _load_present(TREE_TAU_FILES)
    if not files:
        return _missing("python -m bench.e2e.tree_tau")
    lines = ["Sources: " + ", ".join(
        f"`bench/results/{name}` ({_where(d)}, torch {_version(d, 'torch')}, commit {_short(d['commit'])})"
        for name, d in files) + ". Steps: the passes beyond the spec's in each row's pipeline: none (eager host "
        "loops), `cuda-graphs` (a step a graph replay, accept on the device), or `fused-decoder` with split-KV "
        "attention as well. The AR baseline is the same engine's greedy loop (graphed on a GPU).",
        "",
        "| device | drafter | steps | verify | τ | ms/token | AR ms/token | speedup | outputs = AR |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for _, d in files:
        device = _where(d)
        for r in d["records"]:
            verify = "chain" if r["verify"] == "chain" else f"tree {r['budget']} (top-{r['topk']})"
            steps = ("fused + graphs" if "fused-decoder" in r["pipeline"] else
                     "graphs" if "cuda-graphs" in r["pipeline"] else "eager")
            lines.append(f"| {device} | {r['drafter']['kind']} b{r['drafter']['block_size']} | {steps} | {verify} | "
                         f"{r['tau']:.2f} | {r['ms_per_token']:.2f} | {r['ar_ms_per_token']:.2f} | "
                         f"{r['ar_ms_per_token'] / r['ms_per_token']:.2f}× | {r['outputs_equal_ar']} |")
    return "\n".join(lines)


ISSUE_BANDWIDTH = 4.06e12  # the read bandwidth the fast-path issue states its floor at (bytes/s)


def draft_vocab() -> str:
    d = _load("draft_vocab_cpu.json")
    if d is None:
        return _missing("python -m bench.e2e.draft_vocab")
    rows = d["records"]
    sizes = sorted({r["size"] for r in rows}, key=lambda s: (s != 0, -s))  # 0 (the whole vocabulary) first
    lines = [f"The zoo pair {d['pair']} (vocabulary 8192) on the CPU in fp32, commit {_short(d['commit'])}; corpus "
             f"`{d['corpus']}`; chains at the drafters' trained blocks, {rows[0]['num_prompts']} prompts × "
             f"{rows[0]['max_new_tokens']} tokens a set. Coverage: the corpus tokens the subset holds. Source: "
             "`bench/results/draft_vocab_cpu.json`.", "",
             "| drafter | prompts | " + " | ".join(f"τ at {s}" if s else "τ (all)" for s in sizes) + " | token forcing |",
             "|---|---|" + "---:|" * len(sizes) + "---|"]
    coverage = {r["size"]: r["corpus_coverage"] for r in rows}
    for kind in dict.fromkeys(r["drafter"] for r in rows):
        for prompts in dict.fromkeys(r["prompts"] for r in rows):
            by = {r["size"]: r for r in rows if r["drafter"] == kind and r["prompts"] == prompts}
            ok = all(r["passed"] for r in by.values())
            lines.append(f"| {kind} | {prompts} | " + " | ".join(f"{by[s]['tau']:.3f}" for s in sizes)
                         + f" | {'PASS' if ok else 'FAIL'} (all sizes) |")
    lines.append("| corpus coverage | | " + " | ".join(f"{coverage[s]:.3f}" for s in sizes) + " | |")
    return "\n".join(lines)


REPLAY_TAGS = ("dflash-qwen3-8b", "dflash-qwen3-8b-u12", "dflash-llama-3.1-8b", "dflash-llama-3.1-8b-u12")
REPLAY_FILES = tuple(f"replay_{gpu}_{tag}.json" for gpu in ("h200", "h100") for tag in REPLAY_TAGS)
REPLAY_AIMS = {"chain": 0.92, "tree": 0.88, "best": 5.5}  # issue 42 (bench/e2e/replay.py AIMS)


def _replay_rows() -> list[tuple[str, dict, dict]]:
    """(file, file contents, row) of every replay results file present."""
    return [(name, d, r) for name, d in _load_present(REPLAY_FILES) for r in d["records"]]


def _replay_best(rows) -> tuple[str, dict, dict] | None:
    named = [x for x in rows if (x[2]["profile"], x[2]["benchmark"]) == ("dflash-qwen3-8b", "humaneval")]
    return max(named, key=lambda x: x[2]["speedup"]) if named else None


def replay() -> str:
    """Issue 42: 8B shapes end to end under published acceptance (bench/e2e/replay.py)."""
    rows = _replay_rows()
    if not rows:
        return _missing("bench/run_gpu.sh replayq replayqu replayl replaylu", "on the H200 (one command each)")
    files = dict.fromkeys((name, d["device"], d["commit"], d["profile_status"], d["ar_ms_per_token_before"],
                           d["ar_ms_per_token_after"]) for name, d, _ in rows)
    lines = ["Sources: " + "; ".join(
        f"`bench/results/{name}` ({device}, commit {_short(commit)}, profile {status}; AR {a:.2f} ms/token before "
        f"the sweep, {b:.2f} after)" for name, device, commit, status, a, b in files) + ". Random bf16 weights "
        "N(0, 0.02), batch 1, greedy, prefill excluded; speedup over the stock target in the graphed AR loop over the "
        "fused decoder stack (the mean of its two measurements); τ profile: the profile's for the row's step "
        "(chains at the profile's block: published; other blocks and trees: modeled); τ measured: over the steps no "
        "output end could cut; efficiency: speedup / (τ · t_AR / (t_draft + t_verify)); shares of the loop's time a "
        "step: draft, propose, verify, accept/commit, launch + sync, host.", "",
        "| profile | step | passes | τ profile | τ measured | ms/token | speedup | efficiency | draft / propose / verify "
        "/ accept-commit / launch-sync / host | most costly overhead | token forcing |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for _, _, r in rows:
        sh = r["shares"]
        shares = " / ".join(f"{sh[t]:.3f}" for t in ("draft", "propose", "verify", "accept_commit", "launch_sync", "host"))
        measured = "-" if r["measured_tau"] is None else f"{r['measured_tau']:.2f} ({r['measured_over_profile']:.3f})"
        lines.append(f"| {r['profile']}/{r['benchmark']} | {r['config']} | {r['variant']} | {r['profile_tau']:.2f} "
                     f"({r['tau_source']}) | {measured} | {r['ms_per_token']:.3f} | {r['speedup']:.2f}× | "
                     f"{r['loop_efficiency']:.3f} | {shares} | {r['largest_overhead']} | "
                     f"{'PASS' if r['passed'] else 'FAIL'} ({r['tokens_checked']} tokens) |")
    lines += ["", "| aim (issue 42) | target | measured | verdict | what holds it back (share of a step) |",
              "|---|---:|---:|---|---|"]
    for kind in ("chain", "tree"):
        these = [r for _, _, r in rows if r["kind"] == kind]
        if these:
            worst = min(these, key=lambda r: r["loop_efficiency"])
            lines.append(f"| loop efficiency, {kind}s (worst row: {worst['profile']} {worst['config']} {worst['variant']}) "
                         f"| ≥ {REPLAY_AIMS[kind]} | {worst['loop_efficiency']:.3f} | "
                         f"{verdict([all(r['loop_efficiency'] >= REPLAY_AIMS[kind] for r in these)])} | "
                         f"{worst['largest_overhead']} ({worst['shares'][worst['largest_overhead']]:.3f}) |")
    best = _replay_best(rows)
    if best:
        r = best[2]
        lines.append(f"| best pipeline under DFlash's HumanEval profile (`{r['pipeline']}`) | ≥ {REPLAY_AIMS['best']}× | "
                     f"{r['speedup']:.2f}× | {verdict([r['speedup'] >= REPLAY_AIMS['best']])} | "
                     f"{r['largest_overhead']} ({r['shares'][r['largest_overhead']]:.3f}) |")
    return "\n".join(lines)


def headline() -> str:
    """The measured figures a user should see first, each from the results file it names."""
    lines = ["| measured | figure | card | source |", "|---|---:|---|---|"]

    def row(what: str, figure: str, d: dict, name: str) -> None:
        lines.append(f"| {what} | {figure} | {d['gpu'].upper()} | `{name}` ({_short(d['commit'].split()[0])}) |")

    if (d := _load(STEP_TIMES)) is not None:
        rows = {(r["path"], r["what"], r["q"]): r for r in d["records"]}
        ar, v16, draft = rows["fused", "ar", 1], rows["fused", "verify", 16], rows["fused", "draft", 16]
        row("Llama-3.1-8B AR step on the fast path (fused decoder, split-KV attention, CUDA graphs) ÷ its "
            "weight-read floor", f"{ar['ms'] / ar['floor_ms']:.3f}× ({ar['ms']:.2f} ms)", d, STEP_TIMES)
        row("verify(16) step (16 candidate tokens checked at once) ÷ AR step", f"{v16['ms'] / ar['ms']:.3f}×",
            d, STEP_TIMES)
        row("DFlash draft step (5 layers, block 16) ÷ AR step", f"{draft['ms'] / ar['ms']:.3f}×", d, STEP_TIMES)
    if (d := _load(HF_PEERS)) is not None:
        ok = [r for r in d["records"] if "ms_per_token" in r]
        ours = min((r for r in ok if r["impl"].startswith("specpilot")), key=lambda r: r["ms_per_token"])
        hf = min((r for r in ok if r["impl"].startswith("hf")), key=lambda r: r["ms_per_token"])
        row(f"AR decoding, Llama-3.1-8B shapes: HF transformers' fastest ({hf['impl']}) ÷ specpilot's ({ours['impl']}), "
            "ms/token", f"{hf['ms_per_token'] / ours['ms_per_token']:.2f}×", d, HF_PEERS)
    for (step, gpu), name in STEP_AB.items():
        ab = _load(name)
        rows = {r["variant"]: r for r in ab["records"]} if ab else {}
        default = "u12-handoff" if step == "ar" else "u12-tiles"
        if default in rows:
            best, x = _bf16_over_u12(rows, default)
            what = "AR step" if step == "ar" else "verify(16) step"
            row(f"{what} with lossless 12-bit weights (`weights-u12`): fastest bf16 ({best['variant']}) ÷ u12, "
                "interleaved in one run", f"{x:.3f}×", ab, name)
    if (d := _load(ZOO_E2E)) is not None:
        best = _strongest_ar(d)
        spec = [r for r in d["records"] if r["impl"].startswith(("dflash", "pard")) and "ms_per_token" in r]
        fast = min(spec, key=lambda r: r["ms_per_token"])
        row(f"the zoo's 12.8M-parameter pair end to end: {fast['impl']}'s speedup over the strongest AR "
            f"({best['impl']}) at τ {fast['tau']:.2f} (models this small are launch-bound)",
            f"{best['ms_per_token'] / fast['ms_per_token']:.2f}×", d, ZOO_E2E)
    if (best := _replay_best(_replay_rows())) is not None:
        name, d, r = best
        row(f"Qwen3-8B shape end to end under DFlash's published HumanEval acceptance (a replay drafter: the real "
            f"drafter network, the target's greedy tokens at drawn lengths): best pipeline ({r['config']}, {r['variant']}) "
            "÷ the fused graphed bf16 AR, ms/token", f"{r['speedup']:.2f}× (τ {r['measured_tau']:.2f})", d, name)
    if (d := _load("zoo_tau_h200.json")) is not None:
        passed = sum(r["token_forcing"].startswith("token forcing PASS") for r in d["records"])
        row("token forcing: runs whose every output token the stock target confirmed (zoo, both drafters, "
            "both prompt sets)", f"{passed} of {len(d['records'])}", d, "zoo_tau_h200.json")
    return "\n".join(lines)


def verdict(ok: list[bool]) -> str:
    """A scorecard's word for its checks: all met, none, or (two bandwidths) one."""
    return "met" if all(ok) else "not met" if not any(ok) else "met at one bandwidth"


def targets() -> str:
    """The issues' benchmark targets beside the newest results files' figures."""
    d = _load(STEP_TIMES)
    if d is None:
        return _missing("python -m bench.steps.step_times --shapes llama-3.1-8b", "on a GPU")
    rows = {(r["path"], r["what"], r["q"]): r for r in d["records"]}
    ar, v16, draft = rows["fused", "ar", 1], rows["fused", "verify", 16], rows["fused", "draft", 16]
    u12_ar, u12_v16 = rows.get(("fused+u12", "ar", 1)), rows.get(("fused+u12", "verify", 16))
    u12_tiles_v16 = rows.get(("fused+u12-tiles", "verify", 16))  # weights-u12's layout=auto for a verifying target
    issue_floor = ar["weight_bytes"] / ISSUE_BANDWIDTH
    step = f"`{STEP_TIMES}` ({_short(d['commit'].split()[0])})"

    lines = [
        "Llama-3.1-8B shapes on the H200, batch 1, CUDA graphs; each figure from the newest results file named. "
        f"The AR floor is the weight read at the run's measured bandwidth ({d['read_bandwidth_Bps'] / 1e12:.2f} TB/s) "
        f"and at the issue's {ISSUE_BANDWIDTH / 1e12:.2f}.", "",
        "| issue | target | aim | measured | verdict | source |", "|---|---|---:|---:|---|---|",
        f"| #4 | AR step ÷ weight-read floor | ≤ 1.10 | {ar['ms'] / ar['floor_ms']:.3f} (run), "
        f"{ar['ms'] / (issue_floor * 1e3):.3f} (4.06 TB/s) | "
        f"{verdict([ar['ms'] / ar['floor_ms'] <= 1.10, ar['ms'] / (issue_floor * 1e3) <= 1.10])} | {step} |",
        f"| #4 | verify(16) ÷ AR step | ≤ 1.10 | {v16['ms'] / ar['ms']:.3f} | "
        f"{verdict([v16['ms'] / ar['ms'] <= 1.10])} | {step} |",
        f"| #4 | DFlash draft step (5 layers, block 16) ÷ AR step | ≤ 0.15 | {draft['ms'] / ar['ms']:.3f} "
        f"(its floor alone {draft['floor_ms'] / ar['floor_ms']:.3f}) | {verdict([draft['ms'] / ar['ms'] <= 0.15])} | {step} |",
    ]
    vocab = rows.get(("fused-vocab", "draft", 16))
    if vocab:
        lines.append(f"| #4 | the same with its head over {vocab['draft_vocab']} token ids (draft-vocab pass) | ≤ 0.15 | "
                     f"{vocab['ms'] / ar['ms']:.3f} (its floor alone {vocab['floor_ms'] / ar['floor_ms']:.3f}) | "
                     f"{verdict([vocab['ms'] / ar['ms'] <= 0.15])} | {step} |")
    proxies = [(name, w["speedup"]) for name, f in _load_present(U12_LINEAR_FILES)
               if name != U12_TILE_KERNEL_RUN
               for w in f.get("whole_step", []) if w.get("M") == 1]
    if proxies:  # the gemv2 kernel's runs, newest first: every run's figure
        met = sum(x >= 1.25 for _, x in proxies)
        lines.append(f"| #5 | u12 linears at M = 1 ÷ cuBLAS bf16 (a step's linears in one graph; runs newest first) | ≥ 1.25 | "
                     + ", ".join(f"{x:.3f}" for _, x in proxies)
                     + f" | met in {met} of {len(proxies)} runs | " + ", ".join(f"`{n}`" for n, _ in proxies) + " |")
    if u12_ar:
        lines.append(f"| #5 | whole AR step, bf16 ÷ u12 | ≥ 1.20 | {ar['ms'] / u12_ar['ms']:.3f} | "
                     f"{verdict([ar['ms'] / u12_ar['ms'] >= 1.20])} | {step} |")
    lines += _interleaved(STEP_AB["ar", "h200"], "whole AR step", 1.20)
    lines += _interleaved(STEP_AB["ar", "h100"], "whole AR step on the H100 (the issue asks the H200)", 1.20)
    if u12_v16:
        lines.append(f"| #5 | verify(16) step (M = 16), bf16 ÷ u12 | ≥ 1.15 | {v16['ms'] / u12_v16['ms']:.3f} | "
                     f"{verdict([v16['ms'] / u12_v16['ms'] >= 1.15])} | {step} |")
    if u12_tiles_v16:
        x = v16["ms"] / u12_tiles_v16["ms"]
        lines.append(f"| #5 | verify(16) step, bf16 ÷ u12 on tiled weights (weights-u12's layout=auto) | ≥ 1.15 | "
                     f"{x:.3f} | {verdict([x >= 1.15])} | {step} |")
    lines += _interleaved(STEP_AB["verify16", "h200"], "verify(16) step", 1.15, default="u12-tiles")
    lines += _interleaved(STEP_AB["verify16", "h100"], "verify(16) step on the H100 (the issue asks the H200)", 1.15,
                          default="u12-tiles")
    return "\n".join(lines)


STEP_AB = {("ar", "h200"): "step_ab_h200.json", ("ar", "h100"): "step_ab_h100.json",
           ("verify16", "h200"): "step_ab_h200_verify16.json", ("verify16", "h100"): "step_ab_h100_verify16.json"}


def _bf16_over_u12(rows: dict[str, dict], default: str) -> tuple[dict, float]:
    """An interleaved step_ab run's fastest bf16 variant, and its time over the default u12 variant's."""
    best = min((r for v, r in rows.items() if v.startswith("bf16")), key=lambda r: r["ms"])
    return best, best["ms"] / rows[default]["ms"]


def _interleaved(name: str, step: str, target: float, default: str = "u12-handoff") -> list[str]:
    """Scorecard lines from a bench.steps.step_ab file: the default u12 step (u12-handoff; a short run
    of some variants names its own, u12-tiles for the tiled weights that weights-u12's layout=auto
    gives a verify step) against the fastest bf16 variant of the same interleaved run, and the run's
    fastest u12 variant where that is not the default (named: the default does not run it)."""
    ab = _load(name)
    rows = {r["variant"]: r for r in ab["records"]} if ab else {}
    if default not in rows:
        return []
    best, x = _bf16_over_u12(rows, default)
    fast = min((r for v, r in rows.items() if v.startswith("u12")), key=lambda r: r["ms"])
    source = f"`{name}` ({_short(ab['commit'])})"
    named = "" if default == "u12-handoff" else f" ({default})"
    out = [f"| #5 | {step}, fastest bf16 ({best['variant']}) ÷ u12{named}, interleaved in one run (`bench.steps.step_ab`) | "
           f"≥ {target:.2f} | {x:.3f} | {verdict([x >= target])} | {source} |"]
    if fast["variant"] != default:
        x = best["ms"] / fast["ms"]
        out.append(f"| #5 | {step}, the same run's fastest u12 variant ({fast['variant']}) | ≥ {target:.2f} | "
                   f"{x:.3f} | {verdict([x >= target])} | {source} |")
    return out


def kernel_static() -> str:
    present = _load_present(["kernel_static_sm90_triton36.json", "kernel_static_sm90_triton39.json"])
    if not present:
        return _missing("python -m bench.kernels.kernel_static")
    (name, d), others = present[0], present[1:]
    budget = d["issue_budget_per_weight"]
    also = "".join(f" (Triton {_version(o, 'triton')}'s: `bench/results/{n}`)" for n, o in others)
    lines = [
        f"{d['target']}; triton {_version(d, 'triton')} (the GPU machine's), commit {_short(d['commit'])}. Source: "
        f"`bench/results/{name}`{also}. "
        "prog/SM: programs an SM holds (registers, warps, shared memory); loop: the K loop's SASS instructions; "
        f"/weight: its warp instructions a weight, against at most {budget['u12']:.3f} (u12) and {budget['bf16']:.3f} "
        "(bf16) that the H200 issues a weight at the weight-read floor. M = 1 and 16 here; the file has 4 and 64 too, "
        "and bench.steps.step_ab's knob variants (`--step-variants`).",
        "",
        "| path | shape | M | kernel | warps | registers | spill B | prog/SM | loop | /weight | late loads |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in d["records"]:
        if r["m"] in (1, 16) and r.get("variant", "default") == "default":
            per = r["warp_instructions_per_weight"]
            per = f"{per:.3f}" if per is not None else "-"
            lines.append(f"| {r['what']} | {r['shape']} | {r['m']} | `{r['kernel']}` | {r['num_warps']} | {r['registers']} | "
                         f"{r['spill_bytes']} | {r['programs_per_sm']} | {r['loop_instructions']} | {per} | "
                         f"{r.get('loop_loads_after_first_mac', '-')} |")
    return "\n".join(lines)


def kernel_static_sweep() -> str:
    d = _load("kernel_static_sm90_triton36-sweep.json")
    if d is None:
        return _missing("python -m bench.kernels.kernel_static --sweep hmma --layouts rows,tiles --ms 16 --timed ...")
    lines = [
        f"{d['target']}; triton {_version(d, 'triton')}, commit {_short(d['commit'])}; times from `{d['timed']}` (the H200 "
        "sweep, each config in a CUDA graph). Source: `bench/results/kernel_static_sm90_triton36-sweep.json`. "
        "Spearman's rank correlation, over the hmma configs timed at each split-K, of the time with: late loads "
        "(the K loop's global loads after its first MMA), resident warps an SM, and the loop's instructions a weight.",
        "",
        "| shape | layout | split-K | configs | late loads | warps/SM | instructions/weight | best config | µs |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    fmt = lambda v: "-" if v is None else f"{v:+.2f}"  # noqa: E731
    for c in d["correlations"]:
        if c["kernel"] != "_u12_hmma_kernel":
            continue
        rho = c["spearman_vs_us"]
        lines.append(f"| {c['shape']} | {c.get('layout', 'rows')} | {c['split_k']} | {c['configs']} | {fmt(rho['late_loads'])} | "
                     f"{fmt(rho['warps_per_sm'])} | {fmt(rho['instructions_per_weight'])} | {c['best']} | "
                     f"{c['best_us']:.1f} |")
    o8 = sorted((r for r in d["records"] if r["shape"] == "o" and r["us"] is not None and "-sk8-" in r["config"]
                 and r["config"].startswith("hmma") and r.get("layout", "rows") == "rows"), key=lambda r: r["us"])
    if o8:
        lines += ["", "o at 16 rows, split-K 8 (TUNED's), fastest first:", "",
                  "| config | registers | warps/SM | late loads | loop | µs |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['config']} | {r['registers']} | {r['programs_per_sm'] * r['num_warps']} | "
                  f"{r['loop_loads_after_first_mac']} | {r['loop_instructions']} | {r['us']:.1f} |" for r in o8]
    return "\n".join(lines)


SERVE_LOAD_FILES = ("serve_load_cpu.json", "serve_load_cpu_mixed.json", "serve_load_cpu_sequential.json",
                    "serve_load_h100.json", "serve_load_h100_mixed.json", "serve_load_h200.json",
                    "serve_load_h200_mixed.json")


def serve_load() -> str:
    """`specpilot serve` under concurrent streaming clients (bench/e2e/serve_load.py)."""
    files = _load_present(SERVE_LOAD_FILES)
    if not files:
        return _missing("python -m bench.e2e.serve_load")
    lines = ["| card | engine | requests | streams at once / requests / tokens each | max batch | complete, none duplicated "
             "| output tokens/s | requests/s | latency p50 / p99 s | first token p50 / p99 s | source |",
             "|---|---|---|---|---:|---|---:|---:|---|---|---|"]
    for name, d in files:
        a = d["args"]
        way = "batched" if str(a.get("batching")) == "True" else "one after another"  # args as text; older files: the latter
        share = float(a.get("sampled", 0))
        way = f"{way}, {'greedy' if not share else f'{share:.0%} sampled'}"
        ok = f"{d['complete']}/{d['requests_sent']}, {'yes' if d['none_duplicated'] else 'NO'}"
        lines.append(f"| {_where(d)} | {d['engine']} | {way} | {a['concurrency']} / {a['requests']} / {a['max_tokens']} | "
                     f"{a['max_batch']} | {ok} | {d['output_tokens_per_s']:.1f} | {d['requests_per_s']:.2f} | "
                     f"{d['latency_p50_s']:.2f} / {d['latency_p99_s']:.2f} | {d['ttft_p50_s']:.2f} / "
                     f"{d['ttft_p99_s']:.2f} | `{name}` ({_short(d['commit'])}) |")
    lines += ["", "Streams through the official openai client against a `specpilot serve` process, greedy or a share "
              "sampled (temperature 0.9, top_p 0.95, a seed each); each request's text is checked against the engine's "
              "own output (a sampled one: its seed's), and the server's token counter against the clients' usage. "
              "Batched: the server's batched engine, greedy and sampled requests in one batch (one ragged verify a "
              "step, continuous batching); one after another: the batch-1 loops, a request at a time "
              "(docs/SERVING.md)."]
    return "\n".join(lines)


BATCHED_FILES = tuple(f"batched_{gpu}{tag}.json" for gpu in ("h200", "h100") for tag in ("_graphs", ""))  # the first present
# is rendered: the H200's before the H100's, a graphed run (both engines' verify replayed) before an eager one


def batched() -> str:
    """Issue 45: the batched engine against batched AR per concurrency (bench/e2e/batched.py): the GPU's
    file (8B shapes under a replay profile, and the zoo pairs), then the CPU's (the zoo pairs)."""
    present = _load_present(BATCHED_FILES)
    cpu = _load_present(["batched_cpu.json"])
    if not present and not cpu:
        return _missing("bench/run_gpu.sh batched", "on the H200")
    lines = [] if present else [_missing("bench/run_gpu.sh batched", "on the H200") + " (8B shapes)", ""]
    for name, d in present[:1] + cpu:
        lines += _batched_table(name, d) + [""]
    return "\n".join(lines).rstrip()


def _batched_table(name: str, d: dict) -> list[str]:
    rows = [r for r in d["records"] if "speedup_over_batched_ar" in r]
    lines = [f"Source: `bench/results/{name}` ({_where(d)}, commit {_short(d['commit'])}, torch "
             f"{_version(d, 'torch')}). Continuous batching, c requests in flight; decode tokens/s (prefill "
             "forwards and their first tokens left out) and the speedup in them, the whole run's speedup (prefill "
             "included) beside it; AR = the same batched runtime with no drafter. Variants: `all` = verify-budget, "
             "ragged-verify, spec-control; `no-X` leaves one out; `none` the batched engine alone."
             + "".join(sorted({f" `tree` = {r['pipeline']}: each request's best-first tree in place of its chain."
                               for r in rows if r.get("variant") == "tree"}))
             + (" Steps: " + ("CUDA-graph verify replays by token bucket (a tree step's trees, verify and "
                              "acceptance: one replay)" if (d.get("args") or {}).get("graphs")
                              else "eager (no CUDA graphs), AR and speculative alike") + "." if "args" in d else "")
             + (" Skipped over the run's time budget: " + ", ".join(sorted({(r.get("profile") or r.get("pair")) + " "
                + r["variant"] for r in d["records"] if "skipped" in r})) + "." if any("skipped" in r for r in d["records"])
                else ""), "",
             "| deployment | variant | c | decode tokens/s | AR decode tokens/s | speedup | with prefill | τ | "
             "verify rows/step | latency mean ms | AR steps | token forcing |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        who = f"{r['profile']}/{r['benchmark']}" if r.get("profile") else r["pair"]
        forced = f"{'PASS' if r['passed'] else 'FAIL'} ({r['tokens_checked']})" if "passed" in r else "-"
        served = r.get("speedup_served_prefill_included")
        lines.append(f"| {who} | {r['variant']} | {r['concurrency']} | {r['spec'].get('decode_tokens_per_s', 0):.1f} | "
                     f"{r['ar'].get('decode_tokens_per_s', 0):.1f} | {r['speedup_over_batched_ar']:.2f}× | "
                     f"{f'{served:.2f}×' if served is not None else '-'} | {r['spec']['tau']:.2f} | "
                     f"{r['spec']['verify_rows_per_step']:.1f} | {r['spec']['latency_mean_ms']:.1f} | "
                     f"{r['spec']['ar_steps']} | {forced} |")
    aims = d.get("aims") or {}
    if aims:
        lines += ["", "| aim (issue 45, DFlash HumanEval at 8B) | target | measured | verdict |", "|---|---:|---:|---|"]
        for key, a in aims.items():
            target = "≥ 1.0× everywhere" if key == "never_below_1" else f"≥ {a['aim']}×"
            got = a.get("speedup", a.get("worst"))
            lines.append(f"| {key} | {target} | {got:.2f}× | {verdict([a['met']])} |")
    return lines


def batched_graphed_steps() -> str:
    """Issue 45's graphed H100 run (bench/e2e/batched.py --graphs): each variant's speedup over batched AR
    by concurrency, then the decode step of `all` and of batched AR taken apart with the file's own
    numbers: ms a step (decode tokens / decode tokens/s / steps), the verify forward's ms at the step's
    verify rows (the engine's profiled table, `measured_verify_ms`, interpolated as the engine does) and
    the rest (drafting and the host's share of the step)."""
    from specpilot.runtime.batch_control import StepCost

    name = "batched_h100_graphs.json"
    d = _load(name)
    if d is None:
        return _missing("bench/run_gpu.sh batchedg", "on the H100")
    rows = [r for r in d["records"] if "speedup_over_batched_ar" in r and r.get("profile")]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    sizes = sorted({r["concurrency"] for r in rows})
    speed = {(r["variant"], r["concurrency"]): r["speedup_over_batched_ar"] for r in rows}
    lines = [f"Source: `bench/results/{name}` ({_where(d)}, commit {_short(d['commit'])}, torch {_version(d, 'torch')}); "
             f"{rows[0]['profile']}/{rows[0]['benchmark']} (profile τ {rows[0]['profile_tau']}), speedup over batched AR "
             "in decode tokens/s.", "",
             "| variant | " + " | ".join(f"c{c}" for c in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for v in variants:
        lines.append(f"| {v} | " + " | ".join(f"{speed[(v, c)]:.2f}×" if (v, c) in speed else "-" for c in sizes) + " |")

    def step(run: dict) -> float:
        return (run["seconds"] - run["prefill_s"]) / run["steps"] * 1e3  # decode tokens / decode tokens/s, a step

    lines += ["", "The `all` variant's decode step and batched AR's, taken apart: ms a step = decode tokens / decode "
              "tokens/s / steps (steps that only admitted a request count too, so it understates a decode step by "
              "up to the share of such steps); verify = the engine's profiled verify table at the step's verify rows; "
              "rest = the step less its verify: drafting and everything the host does.", "",
              "| c | spec ms/step | verify rows/step | verify ms | rest ms (share) | AR ms/step | AR rows/step | "
              "AR verify ms | AR rest ms (share) | τ | AR steps / steps |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["variant"] == "all"):
        cost = StepCost.from_table(r["measured_verify_ms"])
        sp, ar = r["spec"], r["ar"]
        sp_ms, ar_ms = step(sp), step(ar)
        sp_v, ar_v = cost.verify(sp["verify_rows_per_step"]), cost.verify(ar["verify_rows_per_step"])
        lines.append(f"| {r['concurrency']} | {sp_ms:.1f} | {sp['verify_rows_per_step']:.1f} | {sp_v:.1f} | "
                     f"{sp_ms - sp_v:.1f} ({(sp_ms - sp_v) / sp_ms:.0%}) | {ar_ms:.1f} | {ar['verify_rows_per_step']:.1f} | "
                     f"{ar_v:.1f} | {ar_ms - ar_v:.1f} ({(ar_ms - ar_v) / ar_ms:.0%}) | {sp['tau']:.2f} | "
                     f"{sp['ar_steps']} / {sp['steps']} |")
    return "\n".join(lines)


TWO_LEVEL_BATCHED = ("python -m bench.e2e.two_level --concurrency 1,4,16 --budgets 16 --tree-budgets 4,8 --draft-factors 2 "
                     "--exit-layers 1 --firsts early-exit-split,early-exit-drafter --with-budget --repeats 2")


def two_level_batched() -> str:
    """Issue 46: two-level's first levels in the batched engine against the one-level tree at the same
    verify budget a request, per concurrency (bench/e2e/two_level.py --concurrency)."""
    d = _load("two_level_batched_cpu.json")
    if d is None:
        return _missing(f"OMP_NUM_THREADS=1 {TWO_LEVEL_BATCHED}")
    against = {(s["pair"], s["concurrency"], s["label"]): s for s in d.get("against_best_tree", [])}
    lines = [f"Source: `bench/results/two_level_batched_cpu.json` ({_where(d)}, commit {_short(d['commit'])}, torch "
             f"{_version(d, 'torch')}, {d.get('threads')} thread, load average at the end "
             f"{', '.join(f'{x:.2f}' for x in d.get('load_average') or [])}). Decode tokens "
             "per ms of the loop thread's CPU time and of the wall clock (median of the repeats), τ, verified rows a "
             "step, each two-level row against the one-level tree of the same budget at its concurrency; `-vb`: under "
             "verify-budget.", "",
             "| pair | c | configuration | tokens/CPU-ms | tokens/wall-ms | τ | rows/step | vs tree-N: tokens/CPU-ms | "
             "τ | vs the best tree ≤ N: tokens/CPU-ms | τ | outputs = batch-1 AR |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["records"]:
        s = against.get((r["pair"], r["concurrency"], r["label"]))
        cells = ([f"{s['gain_tokens_per_cpu_ms']:+.1%}", f"{s['tau_change']:+.1%}",
                  f"{s['gain_over_best_tree']:+.1%} ({s['best_tree']})", f"{s['tau_change_best_tree']:+.1%}"]
                 if s else [""] * 4)
        lines.append(f"| {r['pair']} | {r['concurrency']} | {r['label']} | {r['tokens_per_cpu_ms']:.3f} | "
                     f"{r['tokens_per_ms']:.3f} | {r['tau']:.3f} | {r['verify_rows_per_step']:.1f} | "
                     + " | ".join(cells) + f" | {r['outputs_equal_batch1']}/{r['outputs']} |")
    return "\n".join(lines)


def agent() -> str:
    """Issue 44: the search agent on the CPU (bench/agent/tune.py, batch_regimes.py, transfer.py)."""
    tune, regimes, transfer = _load("agent_cpu.json"), _load("agent_batch_cpu.json"), _load("agent_transfer_cpu.json")
    if not (tune or regimes or transfer):
        return _missing("python -m bench.agent.tune examples/pipeline.yaml --device cpu")
    lines = ["| measured (CPU, the zoo pair) | figure | source |", "|---|---|---|"]
    if tune:
        ratio, bound = tune.get("chosen_over_start_relative"), tune.get("chosen_over_start_bound90")
        figure = (f"{ratio:.3f}× (90% upper bound {bound:.3f}×)" if ratio and bound else
                  f"{tune['chosen_over_start']:.3f}× (ms/token)")
        src = f"`agent_cpu.json` ({_short(tune['commit'])})"
        lines += [f"| search from `{tune['args']['pipeline']}`: start → chosen | `{tune['start']}` → `{tune['chosen']}` "
                  f"| {src} |",
                  f"| chosen ÷ start, engine/AR per token, paired over {tune['args'].get('confirm_rounds')} interleaved "
                  f"repeats | {figure}; {'faster' if tune['faster'] else 'not measurably faster'}; "
                  f"{tune['chosen_token_forcing']} | {src} |",
                  f"| trials measured / rejected; why it stopped | {tune['trials']} / {tune['rejected']}; "
                  f"{tune['stopped']} | {src} |"]
    if regimes:
        chosen = ", ".join(f"{b}: `{p or '(empty)'}`" for b, p in regimes["chosen"].items())
        lines.append(f"| batch regimes tuned with one memory: chosen per batch | {chosen} "
                     f"({'different' if regimes['different'] else 'the same'}) | "
                     f"`agent_batch_cpu.json` ({_short(regimes['commit'])}) |")
    if transfer:
        c, w = transfer["cold_trials_to_target"], transfer["warm_trials_to_target"]
        ratio = transfer.get("warm_over_cold")
        lines.append(f"| memory transfer, PARD after DFlash: trials to the cold search's final speed, warm / cold | "
                     f"{w} / {c}" + (f" = {ratio:.2f} (aim ≤ 0.5: {'met' if transfer['aim_met'] else 'not met'})"
                                     if ratio is not None else " (aim ≤ 0.5: not met)")
                     + f" | `agent_transfer_cpu.json` ({_short(transfer['commit'])}) |")
    return "\n".join(lines)


def _trial_rows(records: list[dict], extra_key: str | None = None) -> list[str]:
    lines = [("| " + (f"{extra_key} | " if extra_key else "") + "trial | round | pipeline | proposer | status | engine/AR "
              "| per repeat | ÷ control (90% bound) | τ |"),
             "|" + ("---|" if extra_key else "") + "---:|---:|---|---|---|---:|---|---|---:|"]
    for r in records:
        if r.get("relative") is None:
            continue
        reps = ", ".join(f"{x:.2f}" for x in r.get("rounds_relative") or [])
        vs = f"{r['vs_control']:.3f} ({r['vs_control_bound']:.3f})" if r.get("vs_control") else "-"
        status = r["status"] + (" (control)" if r.get("control") else "") + (", taken" if r.get("improved") else "")
        lines.append("| " + (f"{r[extra_key]} | " if extra_key else "") + f"{r['trial']} | {r['round']} | "
                     f"`{r['pipeline'] or '(empty)'}` | {r['proposer']} | {status} | {r['relative']:.3f} | {reps} | "
                     f"{vs} | {r['tau']:.2f} |")
    return lines


def agent_runs() -> str:
    """Every measured trial of the CPU searches (bench/agent/tune.py, batch_regimes.py, transfer.py)."""
    tune, regimes, transfer = _load("agent_cpu.json"), _load("agent_batch_cpu.json"), _load("agent_transfer_cpu.json")
    if not (tune or regimes or transfer):
        return _missing("python -m bench.agent.tune examples/pipeline.yaml --device cpu")
    lines = []
    if tune:
        lines += [f"Search: `bench/results/agent_cpu.json` (commit {_short(tune['commit'])}); stopped: {tune['stopped']}.",
                  ""] + _trial_rows([r for r in tune["records"] if r.get("kind") == "trial"])
        lines += ["", "| confirmation (interleaved) | pipeline | engine/AR | per repeat |", "|---|---|---:|---|"]
        for r in (r for r in tune["records"] if r.get("kind") == "confirm"):
            reps = ", ".join(f"{x:.2f}" for x in r["extra"].get("rounds_relative", []))
            lines.append(f"| {r['which']} | `{r['pipeline']}` | {r['relative']:.3f} | {reps} |")
        lines.append("")
    if regimes:
        lines += [f"Batch regimes: `bench/results/agent_batch_cpu.json` (commit {_short(regimes['commit'])}).", ""]
        lines += ["| batch | start → chosen | stopped | measured trials |", "|---|---|---|---:|"]
        for b, s in regimes["searches"].items():
            lines.append(f"| {b} | `{s['start']}` → `{s['chosen']}` | {s['stopped']} | {s['measured_trials']} |")
        lines += ["", "| at batch | pipelines (own choice first) | engine/AR | others ÷ own (90% bound) |",
                  "|---|---|---|---|"]
        for b, c in regimes["cross"].items():
            if "relative" not in c:
                lines.append(f"| {b} | {', '.join(f'`{p}`' for p in c['pipelines'])} | - | {c.get('note', '')} |")
                continue
            rel = ", ".join(f"{x:.3f}" if x else "-" for x in c["relative"])
            oth = ", ".join(f"{o[0]:.3f} ({o[1]:.3f})" if o else "-" for o in c["others_over_own"])
            lines.append(f"| {b} | {', '.join(f'`{p}`' for p in c['pipelines'])} | {rel} | {oth} |")
        lines += [""] + _trial_rows(regimes["records"], "batch") + [""]
    if transfer:
        lines += [f"Memory transfer: `bench/results/agent_transfer_cpu.json` (commit {_short(transfer['commit'])}); "
                  f"target engine/AR {transfer['target_relative']:.3f} (the cold search's best, with its tolerance).", "",
                  "| search | start → best | best engine/AR | stopped | measured trials |", "|---|---|---:|---|---:|"]
        for name, s in transfer["searches"].items():
            lines.append(f"| {name} | `{s['start']}` → `{s['best']}` | {s['best_relative']:.3f} | {s['stopped']} | "
                         f"{s['measured_trials']} |")
        lines += [""] + _trial_rows(transfer["records"], "search")
    return "\n".join(lines).rstrip()


def agent_landscape() -> str:
    """Hand-picked pipelines of the CPU agent's deployment, timed interleaved (bench/agent/landscape.py)."""
    present = _load_present(["agent_landscape_cpu.json", "agent_landscape_cpu_b32.json"])
    if not present:
        return _missing("python -m bench.agent.landscape examples/pipeline.yaml --pipelines ...")
    lines = []
    for name, d in present:
        a = d["args"]
        lines += [f"Source: `bench/results/{name}` (commit {_short(d['commit'])}; batch {a.get('batch') or 1}, "
                  f"{a.get('num_prompts')} prompts, {a.get('rounds')} interleaved repeats). Engine/AR per token; "
                  "\"÷ first\": over the first row's.", "",
                  "| pipeline | engine/AR | per repeat | ÷ first | τ | token forcing |", "|---|---:|---|---:|---:|---|"]
        for r in d["records"]:
            reps = ", ".join(f"{x:.2f}" for x in r["extra"].get("rounds_relative", []))
            rel = f"{r['relative']:.3f}" if r.get("relative") else r["status"]
            over = f"{r['over_first']:.3f}" if r.get("over_first") else "-"
            tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
            forced = (f"PASS ({r['tokens_checked']} tokens)" if r["status"] == "validated" else
                      f"{r['status']}: {r.get('reason', '')[:60]}")
            lines.append(f"| `{r['pipeline'] or '(empty)'}` | {rel} | {reps} | {over} | {tau} | {forced} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def agent_predict() -> str:
    """The cost model's predictions against measured engine/AR per trial on the CPU (bench/agent/predict.py)."""
    d = _load("agent_predict_cpu.json")
    if d is None:
        return _missing("OMP_NUM_THREADS=1 python -m bench.agent.predict examples/pipeline.yaml --device cpu --threads 1")
    a, dev = d["args"], d["cpu_device"]
    f, host = dev["figures"], dev["host"]
    devices = list(d["spearman"])
    m = d.get("measured") or {}
    if m:
        ma = m.get("args") or {}
        source = (f"predicted at {_short(d['commit'])} from the trials measured in `{m['from']}` at "
                  f"{_short(m.get('commit') or '?')}: {ma.get('num_prompts')} prompts, {ma.get('rounds')} interleaved "
                  f"repeats, load average {', '.join(map(str, m.get('load_before') or []))} before, "
                  f"{', '.join(map(str, m.get('load_after') or []))} after")
    else:
        source = (f"commit {_short(d['commit'])}; {a.get('num_prompts')} prompts, {a.get('rounds')} interleaved repeats; "
                  f"load average {', '.join(map(str, d.get('load_before', [])))} before, "
                  f"{', '.join(map(str, d.get('load_after', [])))} after")

    def num(x, digits=3):
        return "-" if x is None else f"{x:.{digits}f}"

    step_op = (f"{f['step_op_overhead_s'] * 1e6:.2f} µs a counted op of a step (a tiny op "
               f"{f['op_overhead_s'] * 1e6:.2f} µs)" if "step_op_overhead_s" in f else
               f"{f['op_overhead_s'] * 1e6:.2f} µs an op (a tiny op's)")
    lines = [f"Source: `bench/results/agent_predict_cpu.json` ({source}). CPU device: {host['cpu']}, "
             f"{host['cores']} cores, {host['threads']} torch thread(s), torch "
             f"{host['torch']}, measured {dev['date']} (load {', '.join(f'{x:.2f}' for x in dev['load'])}): read "
             f"{f['bandwidth'] / 1e9:.1f} GB/s, {step_op}, matmul peak "
             f"{f['matmul_peak'] / 1e9:.0f} GFLOP/s. Engine/AR per token: measured, then each device's "
             "prediction raw / calibrated from every other trial (leave-one-out).", "",
             "| pipeline | measured | τ | " + " | ".join(f"{n} raw / loo" for n in devices) + " | τ predicted (cpu, loo) |",
             "|---|---:|---:|" + "---:|" * len(devices) + "---:|"]
    for r in d["records"]:
        m, p = r["measured"], r["predicted"]
        cells = " | ".join(f"{num(p[n]['relative'])} / {num(p[n]['loo'])}" if p.get(n) else "-" for n in devices)
        cpu = p.get("cpu") or {}
        lines.append(f"| `{r['pipeline'] or '(empty)'}` | {num(m.get('relative'))} | {num(m.get('tau'), 2)} | {cells} | "
                     f"{num(cpu.get('tau_loo'), 2)} |")
    lines += ["", "| Spearman's rho against measured | " + " | ".join(devices) + " |", "|---|" + "---:|" * len(devices)]
    for key, what in (("raw", "raw (alpha of the first pipeline's τ)"), ("prior", "calibrated from the trials before it"),
                      ("loo_alpha", "alpha from every other trial"), ("loo", "alpha and calibration from every other trial")):
        lines.append(f"| {what} | " + " | ".join(num(d["spearman"][n].get(key), 2) for n in devices) + " |")
    return "\n".join(lines)


RENDERERS = {"agent": agent, "agent_runs": agent_runs, "agent_landscape": agent_landscape, "agent_predict": agent_predict, "serve_load": serve_load, "headline": headline, "batched": batched, "batched_graphed_steps": batched_graphed_steps, "two_level_batched": two_level_batched, "targets": targets, "draft_vocab": draft_vocab, "zoo_tau": zoo_tau,
             "zoo_e2e": zoo_e2e, "tree_tau": tree_tau, "cost_vs_measured": cost_vs_measured, "step_times": step_times,
             "hf_peers": hf_peers, "attention_split_kv": attention_split_kv, "u12_stats": u12_stats,
             "u12_linear": u12_linear, "kernel_static": kernel_static, "kernel_static_sweep": kernel_static_sweep,
             "replay": replay}


def regions(text: str) -> list[str]:
    """The names of the results regions in `text`, in order."""
    return [m.group(1) for m in REGION.finditer(text)]


def render(text: str) -> str:
    """`text` with every results region rendered from the results files now."""
    def replace(m: re.Match) -> str:
        name = m.group(1)
        body = RENDERERS[name]() if name in RENDERERS else f"_unknown results section {name!r}_"
        return f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->"

    return REGION.sub(replace, text)


def documents(root: Path = ROOT) -> list[Path]:
    """The documents whose regions are rendered (DOCUMENTS: README.md and docs/experiments/*.md)."""
    out = []
    for entry in DOCUMENTS:
        path = root / entry
        out += sorted(path.glob("*.md")) if path.is_dir() else [path]
    return out


def main() -> int:
    for path in documents():
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"rendered {path.relative_to(ROOT)}: {', '.join(regions(new))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
