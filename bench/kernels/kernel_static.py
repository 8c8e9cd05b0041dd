"""What the GPU would run, read without one: the linear kernels of the Llama-3.1-8B step compiled
for sm_90 (kernels/target.py's ``compile_only``: Triton's own ptxas, no GPU), with each kernel's
registers, spills, shared memory, the programs an SM holds, and the SASS of its main loop.

Launches, for each of the layer's shapes (bench.shapes) at M rows (default 1, 4, 16, 64), random
N(0, 0.02) weights packed as the pass packs them:
  u12          u12_linear's default config: what the fused step's u12 GEMMs run (gemv2 below
               TENSOR_CORE_ROWS rows, TUNED's hmma / mma / tile configs above)
  u12-fused    the step's u12_fused_linear calls in its order, at one row (the AR step) and 16 (the
               verify step's mma and hmma epilogues): o with the residual add handing the norm on,
               gate_up gated with the norm handed in, down handing on, qkv handed in
  u12-tiles    u12_linear's default on the tiled weight: gemv2 at one row, TUNED_TILES' hmma configs
               from TENSOR_CORE_ROWS to TILES_MAX_ROWS rows
  u12-fused-tiles  the u12-fused calls on tiled weights at 16 rows (bench.steps.step_ab's u12-tiles);
               not in the default --only
  bf16         fused_linear's default config on the bf16 weight (the path u12 is compared with)

--step-variants compiles the u12 launches again under each of bench.steps.step_ab's TUNED variants
at the rows it times them: a variant that fails to compile or spills shows here, not on the GPU.

Per compiled kernel: REG, LOCAL (spill bytes a thread; 0 is the aim) and SHARED from cuobjdump's
resource usage; programs an SM by the H200's limits (65536 registers allocated 8 a thread at a
time, 64 warps, 32 programs, 228 KB of shared memory, 1 KB of it reserved a program); the SASS
(nvdisasm) instruction count and its main loop: the longest span from a label back to a branch
that returns to it, and its opcode counts (LDG, LDS, HMMA, FFMA, PRMT, ...): what a warp issues a
chunk. No timing: the static facts behind the timed files, checked before spending GPU time.

Writes bench/results/kernel_static_sm90_triton<major><minor>[-<tag>].json through the harness (--sweep:
the tag "sweep" unless --tag names one). The GPU machine runs Triton 3.6, this project's CPU machine
3.9: each compiles its own SASS, so the 3.6 file is the one beside the timed results (a Triton 3.6
wheel unpacked somewhere, then PYTHONPATH=that folder python -m bench.kernels.kernel_static).

    python -m bench.kernels.kernel_static [--ms 1,4,16,64] [--shapes qkv,o,gate_up,down,lm_head]
        [--only u12,u12-fused,u12-tiles,bf16] [--step-variants] [--out FILE|DIR] [--tag TAG]
    python -m bench.kernels.kernel_static --smoke --out FILE    # small shapes: the tests' run
    python -m bench.kernels.kernel_static --sweep hmma --layouts rows,tiles --ms 16 --timed bench/results/u12_linear_h200_hmma.json
    python -m bench.kernels.kernel_static --sweep knobs --layouts tiles --ms 16 --shapes qkv,o,gate_up,down --tag knobs
Run it in a process without TRITON_INTERPRET=1 (under the interpreter Triton compiles nothing).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import shapes as model_shapes
from specpilot.agent.predict import rank_correlation
from specpilot.bench import harness

SHAPES = model_shapes.layer_linears(model_shapes.LLAMA_8B)
FUSED_MS = (1, 16)  # u12_fused_linear's rows: the AR step's, and verify(16)'s mma and hmma epilogues
SMOKE_SHAPES = {"qkv": (384, 256), "o": (256, 256), "gate_up": (1024, 256), "down": (256, 512)}  # a coherent stack
OPCODES = ("LDG", "STG", "LDS", "STS", "LDSM", "BAR", "SHFL", "HMMA", "HGMMA", "FFMA", "FMUL", "FADD", "PRMT",
           "LOP3", "IMAD", "I2F", "F2F", "ATOM", "RED", "CCTL")
SM = dict(registers=65536, warps=64, programs=32, shared=228 * 1024, reserved=1024)  # an H200 (sm_90) SM
# Warp instructions the H200 issues a second (132 SMs, 4 schedulers each, 1.98 GHz boost) over the
# weights it reads a second at the measured 4.06 TB/s: the most a K loop may issue a weight and still
# run at the weight-read floor (a ceiling: a loop that also waits on memory needs less).
ISSUE_PER_S = 132 * 4 * 1.98e9
BUDGET = {"u12": ISSUE_PER_S / (4.06e12 / 1.5), "bf16": ISSUE_PER_S / (4.06e12 / 2.0)}


def tool(name: str) -> str:
    """Triton's bundled CUDA binary `name` (cuobjdump, nvdisasm)."""
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise SystemExit(f"kernel_static: Triton's {name} is missing at {path}")
    return str(path)


def resources(cubin: Path) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's kernel (cuobjdump --dump-resource-usage)."""
    out = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {k.lower(): int(v) for k, v in found.items()}


def sass(cubin: Path) -> list[tuple[str, str]]:
    """The kernel's SASS as (label or "", instruction) pairs in order: a label heads the instruction after it."""
    out = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    code, label = [], ""
    for line in out.splitlines():
        if m := re.match(r"^(\.L_\w+):", line.strip()):
            label = m.group(1)
        elif m := re.match(r"^\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            code.append((label, m.group(1)))
            label = ""
    return code


def opcode(instruction: str) -> str:
    """The instruction's opcode without predicate or modifiers: "@!P0 LDG.E.128 R4, ..." -> "LDG"."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


# kernels whose BLOCK_N counts output columns: gated, a program's W rows are its gate and up rows, 2 BLOCK_N
COLUMN_BLOCKS = ("_u12_fused_gemv_kernel",)
MACS = ("HMMA", "HGMMA", "FFMA")  # the multiply-adds of a GEMM's K loop


def loops(code: list[tuple[str, str]]) -> list[tuple[int, int]]:
    """[start, end] of every span from a label to a branch back to it (a loop's body), in order."""
    where = {label: i for i, (label, _) in enumerate(code) if label}
    found = []
    for i, (_, ins) in enumerate(code):
        if opcode(ins) == "BRA" and (m := re.search(r"`\((\.L_\w+)\)", ins)) and where.get(m.group(1), i + 1) <= i:
            found.append((where[m.group(1)], i))
    return found


def main_loop(code: list[tuple[str, str]]) -> tuple[int, int] | None:
    """The K loop: of the loops, the one with the most tensor-core MMAs, then the most FMAs, then
    the longest; None without a loop. (Not simply the longest, nor the most multiply-adds of any
    kind: an epilogue's escape walk can outgrow the K loop and, walking the side table, issue more
    FMAs than the K loop issues MMAs.)"""
    def weight(span):
        ops = [opcode(ins) for _, ins in code[span[0]:span[1] + 1]]
        return sum(op in ("HMMA", "HGMMA") for op in ops), ops.count("FFMA"), span[1] - span[0]
    return max(loops(code), key=weight, default=None)


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """Programs an SM holds at once by registers (8 a thread at a time), warps, programs and shared memory."""
    by_regs = SM["registers"] // (max(8, -(-registers // 8) * 8) * 32 * warps)
    by_shared = SM["shared"] // (shared + SM["reserved"])
    return min(by_regs, SM["warps"] // warps, SM["programs"], by_shared)


def describe(compiled, workdir: Path) -> dict:
    """The static facts of one compiled launch (kernels/target.Compiled)."""
    cubin = workdir / f"{compiled.name}.cubin"
    cubin.write_bytes(compiled.cubin)
    res, code = resources(cubin), sass(cubin)
    loop = main_loop(code)
    body = [opcode(ins) for _, ins in code[loop[0]:loop[1] + 1]] if loop else []
    counts = collections.Counter(body)
    whole = collections.Counter(opcode(ins) for _, ins in code)
    first_mac = next((i for i, op in enumerate(body) if op in MACS), len(body))
    c = compiled.constexprs
    chunk = c.get("BLOCK_K") or 4 * c.get("BLOCK_W", 0)  # weights of a row a loop iteration (GEMVs: words of 4)
    rows = c.get("BLOCK_N", 0) * (2 if c.get("GATED") and compiled.name in COLUMN_BLOCKS else 1)
    per_warp = rows * chunk / compiled.num_warps
    keep = ("BLOCK_M", "BLOCK_N", "BLOCK_W", "BLOCK_K", "SPLIT_K", "TILED", "GATED", "HAND_IN",
            "HAND_OUT", "RESIDUAL", "NORM", "X_WORDS", "LANES", "EVEN_K", "ASM", "PDL", "EARLY", "ESC_UNROLL")
    return {
        "kernel": compiled.name,
        "constexprs": {k: v for k, v in compiled.constexprs.items() if k in keep},
        "num_warps": compiled.num_warps,
        "registers": res.get("reg"),
        "spill_bytes": res.get("local", 0),
        "stack_bytes": res.get("stack", 0),
        "shared_bytes": max(res.get("shared", 0), compiled.shared),
        "programs_per_sm": programs_per_sm(res.get("reg", 0), compiled.num_warps,
                                           max(res.get("shared", 0), compiled.shared)),
        "sass_instructions": len(code),
        # the whole kernel's: what runs once a program (prologue, epilogue) shows here, not in the loop's
        "kernel_opcodes": {op: whole[op] for op in OPCODES if whole[op]},
        "loop_instructions": len(body),
        "loop_opcodes": {op: counts[op] for op in OPCODES if counts[op]},
        # global loads the loop issues after its first multiply-add: each is a second memory round
        # trip an iteration unless the loads before it cover the latency (ptxas's placement)
        "loop_loads_after_first_mac": sum(op == "LDG" for op in body[first_mac:]),
        "loop_weights_per_warp": per_warp,  # BLOCK_N rows x the chunk, over the warps
        "warp_instructions_per_weight": round(len(body) / per_warp, 4) if body and per_warp else None,
    }


@functools.cache
def _weights(shapes: tuple[tuple[str, tuple[int, int]], ...]) -> tuple[dict, dict]:
    """Random N(0, 0.02) bf16 weights of `shapes` and their u12 packing, made once a run."""
    from specpilot.formats.u12 import pack_u12

    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16) for name, (n, k) in shapes}
    return weights, {name: pack_u12(w) for name, w in weights.items()}


def launches(shapes: dict[str, tuple[int, int]], ms: tuple[int, ...], only: tuple[str, ...]):
    """(what, shape name, M, callable) for every launch this run compiles."""
    from specpilot.kernels.fused_linear import fused_linear
    from specpilot.kernels.u12 import TILES_MAX_ROWS, NormHandoff, u12_fused_linear, u12_linear

    weights, packed = _weights(tuple(shapes.items()))
    gen = torch.Generator().manual_seed(1)
    x = lambda m, k: torch.randn(m, k, generator=gen).to(torch.bfloat16)  # noqa: E731
    for name, (n, k) in shapes.items():
        for m in ms:
            if "u12" in only:
                yield "u12", name, m, lambda m=m, name=name, k=k: u12_linear(x(m, k), packed[name])
            if "bf16" in only:
                yield "bf16", name, m, lambda m=m, name=name, k=k: fused_linear(x(m, k), weights[name])
            if "u12-tiles" in only and m <= TILES_MAX_ROWS:
                tiled = packed[name].with_layout("tiles")
                yield "u12-tiles", name, m, lambda m=m, k=k, tiled=tiled: u12_linear(x(m, k), tiled)
    for what, layout, rows in (("u12-fused", "rows", FUSED_MS), ("u12-fused-tiles", "tiles", (16,))):
        if what not in only or not {"qkv", "o", "gate_up", "down"} <= packed.keys():
            continue
        ws = {name: packed[name].with_layout(layout) for name in ("qkv", "o", "gate_up", "down")}
        hidden = shapes["o"][0]
        norm = torch.ones(hidden, dtype=torch.bfloat16)
        for m in (m for m in ms if m in rows):
            stream, hands = x(m, hidden), []

            def hand_out(name, source, stream=stream, hands=hands, ws=ws):
                hands.append(NormHandoff(norm))
                return u12_fused_linear(source, ws[name], residual=stream, hand_out=hands[-1])

            def hand_in(name, hands=hands, ws=ws, **kw):
                return u12_fused_linear(hands[-1].xg, ws[name], hand_in=hands[-1], **kw)

            yield what, "o", m, lambda m=m, hand_out=hand_out: hand_out("o", x(m, shapes["o"][1]))
            yield what, "gate_up", m, lambda hand_in=hand_in: hand_in("gate_up", gated=True)
            yield what, "down", m, lambda m=m, hand_out=hand_out: hand_out("down", x(m, shapes["down"][1]))
            yield what, "qkv", m, lambda hand_in=hand_in: hand_in("qkv")


def step_variants() -> list[tuple[str, tuple[int, ...], tuple[str, ...], dict, dict]]:
    """bench.steps.step_ab's TUNED variants: (name, the rows it times them at, the launches they
    change, the kernel table, its entries over the default's)."""
    from bench.steps import step_ab
    from specpilot.kernels.u12 import TUNED_TILES

    out = [(name, (1,), ("u12-fused",), table, override)
           for name, (table, override) in step_ab.U12_TUNED_VARIANTS.items() if override]
    out += [(name, (16,), ("u12-tiles", "u12-fused-tiles"), TUNED_TILES, override)
            for name, override in step_ab.TILES_TUNED_VARIANTS.items()]
    out += [(name, (32,), ("u12-tiles",), TUNED_TILES, override)
            for name, override in step_ab.TILES_PAST_16_VARIANTS.items()]
    return out


def run(shapes, ms, only, arch: int = 90, variants: bool = False) -> list[dict]:
    """Every launch compiled and described; with `variants`, again under each of step_variants()
    (the u12 launches of `only` they change, at those of their rows in `ms`)."""
    from bench.steps.step_ab import tuned
    from specpilot.kernels.target import compile_only

    plan = [("default", ms, only, {}, {})]
    if variants:
        for name, rows, whats, table, override in step_variants():
            variant_ms, variant_only = tuple(m for m in rows if m in ms), tuple(w for w in only if w in whats)
            if variant_ms and variant_only:
                plan.append((name, variant_ms, variant_only, table, override))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for variant, variant_ms, variant_only, table, override in plan:
            with tuned(table, override):
                for what, name, m, launch in launches(shapes, variant_ms, variant_only):
                    with compile_only(arch) as compiled:
                        launch()
                    for c in compiled:
                        rows.append({"variant": variant, "what": what, "shape": name, "n_k": list(shapes[name]), "m": m,
                                     **describe(c, Path(tmp))})
    return rows


def _timed_layout(row: dict) -> tuple[str, str]:
    """(config, layout) of a bench.kernels.u12_linear sweep row: its "layout" key, or in files written
    before weights had layouts (a291905) a "-tiles" suffix on the config string."""
    config = row["config"]
    if "layout" in row:
        return config, row["layout"]
    return (config[: -len("-tiles")], "tiles") if config.endswith("-tiles") else (config, "rows")


def sweep(shapes, m: int, kernels: tuple[str, ...], timed: Path | None, arch: int = 90,
          layouts: tuple[str, ...] = ("rows",)) -> list[dict]:
    """The configs bench.kernels.u12_linear sweeps at `m` rows (its sweep_configs: the default first),
    each compiled on the weight in each of `layouts` (U12Tensor.layout) and described; with `timed`
    (that script's results file) each row gets the config's measured "us" where the file timed it
    (same shape, rows, config string and layout)."""
    from bench.kernels import hmma_knobs
    from bench.kernels.u12_linear import sweep_configs
    from specpilot.kernels.target import compile_only
    from specpilot.kernels.u12 import TUNED_TILES, u12_linear

    def configs(n: int, k: int) -> list:  # "knobs": bench.kernels.hmma_knobs' table (TUNED_TILES' shapes, 16 rows)
        if kernels == ("knobs",):

            name = next(s for s, nk in hmma_knobs.SHAPES.items() if nk == (n, k))
            return [cfg for _, cfg in hmma_knobs.configs(name, TUNED_TILES[(16, n, k)])]
        return sweep_configs(m, n, k, kernels)

    times = {}
    if timed is not None:
        times = {(r["name"], r["M"], *_timed_layout(r)): r["us"] for r in json.loads(timed.read_text())["sweep"]
                 if r.get("us") is not None}
    _, packed = _weights(tuple(shapes.items()))
    x = torch.randn(m, max(k for _, k in shapes.values()), generator=torch.Generator().manual_seed(1))
    rows = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for name, (n, k) in shapes.items():
            for cfg in configs(n, k):
                for layout in layouts:
                    with compile_only(arch) as compiled:
                        u12_linear(x[:, :k].to(torch.bfloat16), packed[name].with_layout(layout), cfg)
                    main = [describe(c, Path(tmp)) for c in compiled][0]  # the GEMM (a split-K sum kernel may follow)
                    rows.append({"variant": "sweep", "what": "u12", "shape": name, "n_k": [n, k], "m": m,
                                 "config": str(cfg), "layout": layout, "us": times.get((name, m, str(cfg), layout)),
                                 **main})
    return rows


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of two equal-length lists (None where either is constant)."""
    return rank_correlation(a, b, min_pairs=2)


def sweep_correlations(rows: list[dict]) -> list[dict]:
    """Per shape and split-K, over the timed configs of one kernel: how the measured time ranks
    with the static facts (Spearman): late loads, resident warps an SM, loop instructions a weight."""
    groups = collections.defaultdict(list)
    for r in rows:
        if r.get("us") is not None:
            groups[r["shape"], r["kernel"], r.get("layout", "rows"), r["constexprs"].get("SPLIT_K", 1)].append(r)
    out = []
    for (shape, kernel, layout, split), g in sorted(groups.items()):
        if len(g) < 4:
            continue
        us = [r["us"] for r in g]
        rho = {
            "late_loads": spearman([r["loop_loads_after_first_mac"] for r in g], us),
            "warps_per_sm": spearman([r["programs_per_sm"] * r["num_warps"] for r in g], us),
            "instructions_per_weight": spearman([r["warp_instructions_per_weight"] or 0 for r in g], us),
        }
        best = min(g, key=lambda r: r["us"])
        out.append({"shape": shape, "kernel": kernel, "layout": layout, "split_k": split, "configs": len(g),
                    "spearman_vs_us": {k: None if v is None else round(v, 3) for k, v in rho.items()},
                    "best": best["config"], "best_us": best["us"]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_results_args(ap, smoke=False)
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--only", default="u12,u12-fused,u12-tiles,bf16")
    ap.add_argument("--smoke", action="store_true", help="small shapes (the tests' run); writes only where --out says")
    ap.add_argument("--step-variants", action="store_true",
                    help="also each of bench.steps.step_ab's TUNED variants, at the rows it times them at")
    ap.add_argument("--sweep", help="instead: bench.kernels.u12_linear's sweep of these kernels (e.g. hmma,mma) at "
                                    "the first of --ms, every config compiled; 'knobs': bench.kernels.hmma_knobs' table")
    ap.add_argument("--timed", type=Path, help="with --sweep: a bench.kernels.u12_linear results file whose times to join")
    ap.add_argument("--layouts", default="rows", help="with --sweep: the weight's layouts to compile each config on")
    args = ap.parse_args(argv)
    if args.timed is not None and not args.timed.is_file():
        print(f"bench.kernels.kernel_static --timed: no such file {args.timed}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench.kernels.kernel_static: unset TRITON_INTERPRET (the interpreter compiles no kernel)", file=sys.stderr)
        return 2
    table = SMOKE_SHAPES if args.smoke else SHAPES
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        print(f"bench.kernels.kernel_static --shapes: unknown {unknown}; expected some of {list(SHAPES)}", file=sys.stderr)
        return 2
    names = [s for s in args.shapes.split(",") if s in table]
    only = tuple(args.only.split(","))
    ms = tuple(int(v) for v in args.ms.split(","))
    import triton

    if args.sweep:
        rows = sweep({s: table[s] for s in names}, ms[0], tuple(args.sweep.split(",")), args.timed,
                     layouts=tuple(args.layouts.split(",")))
    else:
        rows = run({s: table[s] for s in names}, ms, only, variants=args.step_variants)

    summary = {
        "target": "sm_90a (H200), compiled by Triton's ptxas without a GPU (kernels/target.py compile_only)",
        "smoke": args.smoke,
        "timed": str(args.timed.resolve().relative_to(harness.ROOT))
        if args.timed and args.timed.resolve().is_relative_to(harness.ROOT) else (str(args.timed) if args.timed else None),
        "issue_budget_per_weight": {k: round(v, 4) for k, v in BUDGET.items()},
    }
    if args.sweep:
        summary["correlations"] = sweep_correlations(rows)
    tag = "triton" + "".join(triton.__version__.split(".")[:2]) + \
        (f"-{args.tag}" if args.tag else "-sweep" if args.sweep else "")
    out = None
    if not args.smoke or args.out is not None:  # a smoke run measures nothing: written only where --out says
        out = harness.write_results("kernel_static", "cpu", rows, args=vars(args), out=args.out, tag=tag, gpu="sm90",
                                    **summary)
    print(f"{'variant or config':30} {'what':10} {'shape':8} {'M':>3} {'kernel':24} {'warps':>5} {'regs':>4} "
          f"{'spill':>5} {'smem':>6} {'prog/SM':>7} {'loop':>5} {'/weight':>7} {'late':>4} {'timed':>9}  loop opcodes")
    for r in rows:
        ops = " ".join(f"{k}:{v}" for k, v in r["loop_opcodes"].items())
        per = r["warp_instructions_per_weight"]
        timed = f"{r['us']:.1f} us" if r.get("us") is not None else ""
        print(f"{r.get('config', r['variant'])[:30]:30} {r['what']:10} {r['shape']:8} {r['m']:>3} {r['kernel'][:24]:24} "
              f"{r['num_warps']:>5} {r['registers']:>4} {r['spill_bytes']:>5} {r['shared_bytes']:>6} "
              f"{r['programs_per_sm']:>7} {r['loop_instructions']:>5} {per if per is not None else '-':>7} "
              f"{r['loop_loads_after_first_mac']:>4} {timed:>9}  {ops}")
    print(f"/weight: the K loop's warp instructions a weight; at the weight-read floor the H200 issues at most "
          f"{BUDGET['u12']:.3f} (u12) and {BUDGET['bf16']:.3f} (bf16). late: its global loads after its first "
          f"multiply-add")
    for c in summary.get("correlations", []):
        rho = ", ".join(f"{k} {v}" for k, v in c["spearman_vs_us"].items())
        print(f"{c['shape']} {c['kernel']} split {c['split_k']}: {c['configs']} timed configs, Spearman with us: {rho}")
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
