"""The cost model's predictions beside the H200 step times measured at Llama-3.1-8B shapes.

    python -m bench.steps.cost_vs_measured   # writes bench/results/cost_vs_measured_h200.json, prints a table

Runs on a CPU: it prices the H200 and reads its results files. Two measured sources:
`step_bench_h200.json` (steps shaped as the IR lowers them, bench.steps.step_bench) is compared with
the UNcalibrated model; the torch rows of `step_times_h200_llama.json` (the runtime's own forward,
bench.steps.step_times) both uncalibrated
and after `update_from_results` on that same file (which only shows the calibration mechanism, not
predictive power); and its fused rows (fused-decoder + attention-split-kv, uncalibrated), with the
kernels a step launches beside those its profile counted.
"""

from __future__ import annotations

import argparse
import json
import sys

from bench import shapes
from specpilot.bench import harness
from specpilot.cost import CostModel, load_gpu, step_time
from specpilot.cost.roofline import FUSED_LINEAR_KERNEL, combine
from specpilot.ir import lower
from specpilot.passes.attention_split_kv import AttentionSplitKV
from specpilot.passes.fused_decoder import FusedDecoder

RESULTS = harness.RESULTS
IR_STEPS, RUNTIME_STEPS = "step_bench_h200.json", "step_times_h200_llama.json"  # the measured sources
STEPS = (("ar", 1), ("verify", 16), ("draft", 16))


def main(argv: list[str] | None = None) -> int:
    args = harness.add_results_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), smoke=False).parse_args(argv)
    program = lower(shapes.config(shapes.LLAMA_8B), shapes.dflash_config(shapes.LLAMA_8B), dtype="bfloat16")
    gpu = load_gpu("h200")
    rows = []

    ir_steps = json.loads((RESULTS / IR_STEPS).read_text())["records"]
    for what, q in STEPS:
        r = next(r for r in ir_steps if r["what"] == what and r["q"] == q and r["batch"] == 1
                 and r["cache_len"] == 512 and r["cuda_graphs"])
        graph = program.drafter if what == "draft" else program.target
        predicted = step_time(graph, gpu, 1, q, 512, cuda_graphs=True).time * 1e3
        rows.append(dict(source=IR_STEPS, model="uncalibrated", what=what, q=q,
                         measured_ms=r["ms"], predicted_ms=predicted))

    runtime_file = json.loads((RESULTS / RUNTIME_STEPS).read_text())
    runtime = {(r["what"], r["q"]): r["ms"] for r in runtime_file["records"]
               if r["shape"] == shapes.LLAMA_8B and r.get("path", "torch") == "torch"}
    raw, calibrated = CostModel("h200"), CostModel("h200")
    calibrated.update_from_results([RESULTS / RUNTIME_STEPS])
    for name, model in (("uncalibrated", raw), ("calibrated on this file", calibrated)):
        for what, q in STEPS:
            predicted = model.step(program, what, q, cache_len=512).time * 1e3
            rows.append(dict(source=RUNTIME_STEPS, model=name, what=what, q=q,
                             measured_ms=runtime[(what, q)], predicted_ms=predicted))
    # the fast path: the fused stacks with split-KV attention, uncalibrated (calibration reads torch rows only)
    fused_program = AttentionSplitKV().apply(FusedDecoder().apply(program).program).program
    fused = {(r["what"], r["q"]): r["ms"] for r in runtime_file["records"] if r["path"] == "fused"}
    profiled = runtime_file["profiles_fused"][shapes.LLAMA_8B]
    # ... priced with fused_linear's measured efficiency (the model), and with the stock GEMM pricing
    stock = gpu.with_(kernel_efficiency={k: v for k, v in gpu.kernel_efficiency.items() if k != FUSED_LINEAR_KERNEL})
    for model, g in (("uncalibrated", gpu), ("uncalibrated, stock GEMM pricing", stock)):
        for what, q in STEPS:
            graph = fused_program.drafter if what == "draft" else fused_program.target
            step = step_time(graph, g, 1, q, 512, cuda_graphs=True, shared=fused_program.target)
            measured_kernels = profiled.get({"ar": "ar", "verify": f"verify-{q}", "draft": "draft"}[what], {}).get("kernels")
            rows.append(dict(source=f"{RUNTIME_STEPS} (fused)", model=model, what=what, q=q,
                             measured_ms=fused[(what, q)], predicted_ms=step.time * 1e3,
                             predicted_kernels=step.kernels, measured_kernels=measured_kernels))
        # trees of 15 nodes (q = 16: on the fused linears), 16 (q = 17: in LINEAR_GAP, on cuBLAS) and 31
        # (q = 32: fused again), those the file measured
        for budget in (b for b in (15, 16, 31) if ("tree-verify", b + 1) in fused):
            q = budget + 1
            tree = step_time(fused_program.target, g, 1, q, 512, cuda_graphs=True)  # a tree changes the step graph only
            rows.append(dict(source=f"{RUNTIME_STEPS} (fused)", model=model, what="tree-verify", q=q,
                             budget=budget, measured_ms=fused[("tree-verify", q)], predicted_ms=tree.time * 1e3))
    for r in rows:
        r["error"] = r["predicted_ms"] / r["measured_ms"] - 1

    fit = fused_linear_fit(fused_program, stock, profiled)

    out = harness.write_run(args, "cost_vs_measured", "cpu", rows, gpu="h200", shape=shapes.LLAMA_8B, cache_len=512,
                            measured_files=[IR_STEPS, RUNTIME_STEPS], fused_linear_fit=fit)
    print(f"-> {out}")
    print(f"{'source':36} {'model':32} {'step':11} {'q':>3} {'measured':>9} {'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r['source']:36} {r['model']:32} {r['what']:11} {r['q']:>3} {r['measured_ms']:9.3f} "
              f"{r['predicted_ms']:9.3f} {100 * r['error']:+6.1f}%")
    for f in fit:
        print(f"fused_linear at {f['rows']:>2} rows: {f['launches']} launches, {f['measured_kernel_ms']:.3f} ms of kernel "
              f"time against {f['stock_priced_ms']:.3f} priced stock: efficiency {f['efficiency']:.3f}")
    return 0


def fused_linear_fit(fused_program, stock, profiled) -> list[dict]:
    """gpus.yaml's triton-fused-linear efficiency: at 1 and 16 rows, the efficiency at which the stock
    pricing of the fused target's layer linears (their memory time over it, plus each launch's
    latency) equals the kernel time the step's profile measured for fused_linear's launches."""
    out = []
    for q, step, kernel in ((1, "ar", "_gemv_kernel"), (16, "verify-16", "_dot_kernel")):
        top = next(t for t in profiled[step]["top"] if t["name"] == kernel)
        costs = [(c, n) for c, n in zip(*(lambda st: (st.costs, st.counts))(
            step_time(fused_program.target, stock, 1, q, 512, cuda_graphs=True))) if c.op == "linear"]

        def total(eff: float) -> float:
            return sum(n * (combine(c.t_memory / (stock.bw_efficiency * eff), c.t_compute, stock.overlap) + c.t_latency)
                       for c, n in costs)

        lo, hi = 0.25, 4.0  # total() falls as eff grows: bisect total(eff) = measured
        measured = top["us"] * 1e-6
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if total(mid) > measured else (lo, mid)
        out.append(dict(rows=q, kernel=kernel, launches=top["count"], measured_kernel_ms=measured * 1e3,
                        stock_priced_ms=total(1.0) * 1e3, efficiency=round(lo, 3)))
    return out


if __name__ == "__main__":
    sys.exit(main())
