"""How the cost model ranks a deployment's candidates against their measured times, on this host.

    OMP_NUM_THREADS=1 python -m bench.agent.predict examples/pipeline.yaml --device cpu --rounds 3 \
        --num-prompts 4 --threads 1
    python -m bench.agent.predict examples/pipeline.yaml --from bench/results/agent_predict_cpu.json --out /tmp/x.json

Measures the pipelines as bench.agent.landscape does (built in one process, timed round-robin with
the stock AR loop beside each, `--rounds` repeats, token-forced), or takes the measured rows of an
earlier agent_predict or agent_landscape file (`--from`: nothing is measured; the file records the
source's commit, arguments and load as `measured`), then predicts each
as the search does (agent.predict.Predictor, engine/AR per token, at the alpha of the first
pipeline's measured τ) on two devices: `cpu`, this host's CPU record (cost/cpu.py, its figures
measured here) and the spec's GPU (what the agent priced CPU trials with before it had a CPU
device). Each prediction raw and calibrated by agent.predict.Calibration (per pass name): `prior`
from the trials listed before it (as a search learns round by round) and `loo` from every other
trial; never from the trial itself. Spearman's rho of each against the measured engine/AR. The load
average before and after is recorded: a loaded host moves one trial's engine/AR by 5 to 10%. On a
CPU the stock AR loop is also profiled (`ar_profile`: aten ops a token, aten::mm's share of the
time) beside the model's AR step (its ops and time).
Writes bench/results/agent_predict_<gpu>[_<tag>].json (agent_predict_cpu.json on a CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.agent import bench_spec
from specpilot.agent.predict import Calibration, Predictor, rank_correlation
from specpilot.agent.proposals import Proposal, Rejection, vet
from specpilot.agent.trial import VALIDATED, TrialJob
from specpilot.bench.harness import add_results_args, write_run
from specpilot.backends.torch_backend import build_engine
from specpilot.compiler import lower_spec, prepare, resolve_models, run_trials_interleaved
from specpilot.cost import CostModel
from specpilot.cost.cpu import cpu_record, matmul_shapes
from specpilot.dsl.pipeline import pass_names
from specpilot.passes.what_if import what_ifs

PIPELINES = (
    "draft-block-size{size=16}", "draft-block-size{size=4}", "draft-block-size{size=6}", "draft-block-size{size=3}",
    "draft-block-size{size=10}", "draft-vocab{size=1024}", "draft-vocab{size=512}", "draft-vocab{size=4096}",
    "draft-block-size{size=4},draft-vocab{size=1024}", "draft-block-size{size=16},fused-decoder",
    "draft-block-size{size=16},cuda-graphs", "draft-block-size{size=16},tree-verify{budget=15, topk=2}",
    "draft-block-size{size=16},tree-verify{budget=48, topk=4}", "draft-block-size{size=16},tree-verify{budget=128, topk=8}",
)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def measured_rows(path: Path) -> list[dict]:
    """The measured rows of an agent_predict or agent_landscape results file."""
    data = json.loads(path.read_text())
    out = []
    for r in data["records"]:
        m = r.get("measured", r)
        rounds = m.get("rounds_relative") or m.get("extra", {}).get("rounds_relative", [])
        out.append({k: m.get(k) for k in ("pipeline", "status", "reason", "relative", "tau", "engine_ms", "ar_ms",
                                          "forcing")} | {"rounds_relative": rounds})
    return out


def measure(spec, pipelines: list[str], device: str, rounds: int) -> list[dict]:
    jobs = [TrialJob(i + 1, spec, p, (), device) for i, p in enumerate(pipelines)]
    return [{"pipeline": r.pipeline, "status": r.status, "reason": r.reason, "relative": r.relative, "tau": r.tau,
             "engine_ms": r.engine_ms, "ar_ms": r.ar_ms, "forcing": r.forcing,
             "rounds_relative": r.extra.get("rounds_relative", [])}
            for r in run_trials_interleaved(jobs, rounds=rounds)]


def predictions(stock, rows: list[dict], device) -> list[dict | None]:
    """Each row's prediction on `device`, engine/AR: `relative` (raw: at the alpha of the first row's
    measured τ, as a search's first round prices), `prior` (what a search learns from the rows
    before it: the alpha measured nearest its draft length, then agent.predict.Calibration of those
    rows' predictions against their measurements), `loo` (the same from every other row) and
    `loo_alpha` (the alphas of every other row, no Calibration). None where the pipeline is refused
    or the model cannot price it."""
    cands = [vet(Proposal(r["pipeline"], "bench"), stock) for r in rows]
    names = [frozenset(pass_names(r["pipeline"])) if r["pipeline"] else frozenset() for r in rows]
    usable = [i for i, (c, r) in enumerate(zip(cands, rows))
              if not isinstance(c, Rejection) and r["status"] == VALIDATED and r["relative"] and r["tau"]]

    def predictor(learned: list[int]) -> Predictor:
        p = Predictor(device, what_ifs)
        if not isinstance(cands[0], Rejection) and rows[0]["tau"]:
            p.learn_tau(cands[0].program, rows[0]["tau"])
        for j in learned:
            p.learn_trial(cands[j].program, rows[j]["tau"])
        return p

    def rel(p: Predictor, i: int) -> float | None:
        got = p.relative(cands[i].program)
        return got[1] if got else None

    start = predictor([])
    out: list[dict | None] = []
    at_the_time: dict[int, float] = {}  # each row's prediction before it was measured (a search's predicted_rel)
    for i, c in enumerate(cands):
        got = None if isinstance(c, Rejection) else start.relative(c.program)
        if got is None:
            out.append(None)
            continue
        e = start.model.predict(c.program, start.workload(c.program))
        row = {"relative": got[1], "t_token_ms": got[0] * 1e3, "t_ar_ms": e.t_ar.value * 1e3,
               "t_draft_ms": e.t_draft.value * 1e3, "t_verify_ms": e.t_verify.value * 1e3,
               "overhead_ms": e.overhead.value * 1e3, "tau": e.tau.value}
        before = [j for j in usable if j < i]
        p = predictor(before)
        at_the_time[i] = rel(p, i)
        cal = Calibration()
        for j in before:
            cal.add(names[j], at_the_time[j], rows[j]["relative"])
        row["prior"] = at_the_time[i] * cal.factor(names[i])
        others = [j for j in usable if j != i]
        p = predictor(others)
        row["loo_alpha"] = rel(p, i)
        cal = Calibration()
        for j in others:
            cal.add(names[j], rel(p, j), rows[j]["relative"])
        row["loo"] = row["loo_alpha"] * cal.factor(names[i])
        row["tau_loo"] = p.model.predict(c.program, p.workload(c.program)).tau.value
        out.append(row)
    return out


def profile_ar(spec, device, tokens: int = 16) -> dict:
    """What a CPU AR token spends its time on: the stock engine's AR loop over the first prompt under
    torch.profiler (aten ops a token, those called from Python, aten::mm's share of self time) and timed without it, beside
    the cost model's AR step on the CPU device (its ops and time)."""
    p = prepare(spec, None, "cpu")
    engine = build_engine(p.stock, p.dirs.target, p.dirs.drafter, p.device, shape=p.dirs.shape)
    prompt = p.prompts[0]
    engine.generate_ar(prompt, 4)
    t0 = time.perf_counter()
    engine.generate_ar(prompt, 4 * tokens)
    wall = (time.perf_counter() - t0) / (4 * tokens)
    with torch.profiler.profile() as prof:
        engine.generate_ar(prompt, tokens)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    top = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    step = CostModel(device).step(p.stock, "ar")
    return {"tokens": tokens, "ms_per_token": wall * 1e3, "aten_ops_per_token": sum(e.count for e in events) / tokens,
            "top_level_ops_per_token": top / tokens,
            "mm_share_of_self_time": mm / total if total else None,
            "model_ops_per_token": step.kernels, "model_ms_per_token": step.time * 1e3,
            "model_op_overhead_ms": step.latency * 1e3,
            "note": "prefill included in the profiled and timed runs (one prompt)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pipeline", type=Path)
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES),
                    help="pass pipelines; the first is the start (its τ sets the predictions' acceptance)")
    ap.add_argument("--from", dest="source", type=Path,
                    help="take the measured rows of this agent_predict or agent_landscape file (measure nothing)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats")
    ap.add_argument("--num-prompts", type=int, help="override the spec's benchmark.num_prompts")
    ap.add_argument("--threads", type=int, default=1)
    add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = bench_spec(args.pipeline, num_prompts=args.num_prompts)
    stock = lower_spec(spec, resolve_models(spec), "float32")
    record = cpu_record(matmul_shapes(stock), "float32")  # measured before the trials, on a quiet host
    before = load_avg()
    rows = measured_rows(args.source) if args.source else measure(spec, args.pipelines, args.device, args.rounds)
    ar = profile_ar(spec, record.device("float32")) if args.device == "cpu" else None
    after = load_avg()
    devices = {"cpu": record.device("float32"), spec.gpu: spec.gpu}
    preds = {name: predictions(stock, rows, dev) for name, dev in devices.items()}
    records, spearman = [], {}
    ok = [i for i, r in enumerate(rows) if r["status"] == VALIDATED and r["relative"]]
    for name, ps in preds.items():
        idx = [i for i in ok if ps[i] is not None]
        measured = [rows[i]["relative"] for i in idx]
        spearman[name] = {key: rank_correlation([ps[i][how] for i in idx], measured)
                          for key, how in (("raw", "relative"), ("prior", "prior"), ("loo_alpha", "loo_alpha"),
                                           ("loo", "loo"))}
        spearman[name]["n"] = len(idx)
    for i, r in enumerate(rows):
        records.append({"kind": "trial", "pipeline": r["pipeline"], "measured": r,
                        "predicted": {name: ps[i] for name, ps in preds.items()}})
        cells = "  ".join(f"{name} {ps[i]['relative']:.3f}/{ps[i]['loo']:.3f}" if ps[i] else f"{name} -"
                          for name, ps in preds.items())
        print(f"{r['pipeline'] or '(empty)':58s} measured {r['relative'] or float('nan'):.3f} τ {r['tau'] or 0:.2f}  "
              f"predicted raw/loo: {cells}", flush=True)
    for name, s in spearman.items():
        print(f"{name}: Spearman raw {s['raw']}, prior {s['prior']}, leave-one-out alpha {s['loo_alpha']}, "
              f"leave-one-out {s['loo']} (n={s['n']})")
    if ar:
        print(f"AR on the CPU: {ar['ms_per_token']:.2f} ms/token, {ar['aten_ops_per_token']:.0f} aten ops a token "
              f"({ar['top_level_ops_per_token']:.0f} called from Python), "
              f"aten::mm {ar['mm_share_of_self_time']:.0%} of self time; the model: {ar['model_ms_per_token']:.2f} ms, "
              f"{ar['model_ops_per_token']} ops ({ar['model_op_overhead_ms']:.2f} ms of op overhead)")
    host = record.host
    source = json.loads(args.source.read_text()) if args.source else {}
    measured = {"from": str(args.source), "commit": source.get("commit"), "date": source.get("date"),
                "args": source.get("args"), "load_before": source.get("load_before"),
                "load_after": source.get("load_after")} if args.source else None
    path = write_run(args, "agent_predict", args.device, records, spearman=spearman, load_before=before,
                     load_after=after, measured_from=str(args.source) if args.source else None, measured=measured,
                     ar_profile=ar,
                     cpu_device={"host": {"cpu": host.cpu, "cores": host.cores, "threads": host.threads,
                                          "torch": host.torch},
                                 "date": record.date, "load": list(record.load), "figures": dict(record.figures),
                                 "matmul_float32": {f"{k}x{n}": rows_ for (k, n), rows_ in
                                                    sorted(record.matmul.get("float32", {}).items())}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
