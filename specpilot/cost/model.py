"""The cost model: where a decode step's time goes, what speedup that gives, and how far it is from
the ceiling. `CostModel(gpu).predict(program, workload) -> Estimate`; `update(records)` calibrates.

One speculative step of the program is draft (the drafter graph at the block size) + verify (the
target graph at the verify length q) + overhead (proposal, acceptance, commit: the step graph's
own work, host round trips included); one AR step is the baseline target at q = 1. Then

    τ        = E[accepted + 1] from the acceptance model (chain of q-1 tokens, or best-first tree)
    speedup  = τ · t_AR / (t_draft + t_verify + overhead)
    t_token  = (t_draft + t_verify + overhead) / τ        (per request; gaps are ranked in it)

The AR baseline is the strongest plain decoder we have on the same GPU: the target with its
weights in the checkpoint dtype (weight-format passes speed up the engine, not the baseline),
under CUDA graphs, with the program's attention kernel. The ceiling is the fastest program the
passes' what-ifs reach (given by the caller, gaps.py) with every op at its floor (bytes / measured
bandwidth or FLOPs / measured rate, no latency, no launches, no host round trips); its speedup is
against the same predicted t_AR. Every figure of an `Estimate` says whether it is "measured" (a
benchmark record of exactly this step, or acceptance measured on this shape) or "predicted".

Calibration records (JSON). A results file is a list of records, or an object whose "records" list
holds them ("rows" is read the same way, as bench/steps/step_times.py writes it); the object's keys
"gpu", "shape", "ir_hash", "drafter" and "cuda_graphs" are defaults for its records, the others
("commit", "versions", "method", ...) are provenance. "gpu" may be a device name as torch reports
it ("NVIDIA H200"). Keys a record may have:

    kernel:      {"kind": "kernel", "kernel": "triton-u12", "gpu": "h200", "M": 16, "efficiency": 0.57}
                 (bandwidth relative to the stock bf16 path; rows of bench/kernels/u12_linear.py are read as such)
    step:        {"kind": "step", "what": "ar" | "verify" | "draft", "ms": 4.61, "gpu": "h200",
                  "shape": "llama-3.1-8b", "q": 16, "batch": 1, "cache_len": 512,
                  "cuda_graphs": true, "ir_hash": "<Program.structural_hash()>"}
    acceptance:  {"kind": "acceptance", "shape": "llama-3.1-8b", "drafter": "dflash",
                  "histogram": [n0, n1, ..., nK]       # steps that accepted n drafted tokens
                  | "tau": 6.2, "k": 15,               # or a τ over chains of k drafted tokens
                  "topk": [[p11, p12, ...], ...]}       # optional per-position rank probabilities

A record without "kind" is recognized by its keys (a step by "what" and "ms", a u12_linear row by
"u12_us", an acceptance record by "histogram"); anything else is provenance and skipped.
`q` defaults to 1 for "ar" and is required otherwise; batch 1, cache_len 512, cuda_graphs true.
"ms" is the median step time. A step record with "ir_hash" calibrates only the program with that
structural hash; one with a "shape" alone is taken to describe whatever program of that shape is
predicted (see `shape_name`), so record the hash when passes changed weights or kernels. For each
step kind the model keeps the geometric mean of measured / predicted over the records that match;
a kind with no record borrows the mean over all kinds on that GPU. The factor scales that step's
predicted time (never the floor or the ceiling); a record of exactly the predicted step is
reported instead of the prediction, tagged "measured".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import SpecError
from ..hf.known import name_of
from ..ir import MATMUL_OPS, Graph, Node, Program
from .acceptance import AcceptanceModel
from .gaps import (
    Gap, Reached, WhatIfs, draft_positions, no_what_ifs, rank_gaps, remainder_gap, search_ceiling, step_ops,
)
from .gpu import GPU, load_gpu, resolve_gpu
from .two_level import tau_two_level, two_level_verify
from .roofline import (
    ACT_BYTES, U12_ESCAPE_RATE, GraphPlan, NodeCost, StepEstimate, at_floor, combine, step_time,
)

DEFAULT_ALPHA = 0.8  # per-position acceptance assumed when nothing is measured or given
REPOSITORY = Path(__file__).resolve().parents[2]  # where gpus.yaml's calibration paths start (the checkout)
DEFAULT_CACHE_LEN = 512
WHATS = ("ar", "draft", "verify")
TREE_WIDTH = 8  # ranks per position a tree may use when the proposal names no top-k

# -- inputs and outputs

@dataclass(frozen=True)
class Workload:
    """The serving regime a prediction is for."""

    batch: int | None = None  # None: the step graph's schedule batch
    cache_len: int = DEFAULT_CACHE_LEN  # tokens in the KV cache when the step runs
    cuda_graphs: bool | None = None  # default when the program has no "cuda_graphs" attribute
    tau: float | None = None  # τ of the program's chain as stated in the spec (counts the bonus token)
    acceptance: AcceptanceModel | None = None  # wins over tau and over measured records
    escape_rate: float = U12_ESCAPE_RATE


@dataclass(frozen=True)
class Figure:
    """One number of an estimate, with where it came from ("predicted" or "measured")."""

    value: float
    source: str = "predicted"
    floor: float | None = None  # the same step with every op at its floor (bytes / bandwidth)
    note: str = ""


@dataclass(frozen=True)
class SpecStep:
    """The model's breakdown of one speculative step and its AR baseline (seconds)."""

    ar: StepEstimate
    draft: StepEstimate
    verify: StepEstimate
    overhead_rows: tuple[NodeCost, ...]
    tau: float

    @property
    def overhead(self) -> float:
        return sum(r.time for r in self.overhead_rows)

    @property
    def t_spec(self) -> float:
        return self.draft.time + self.verify.time + self.overhead

    @property
    def t_token(self) -> float:
        return self.t_spec / self.tau

    @property
    def speedup(self) -> float:
        return self.tau * self.ar.time / self.t_spec


@dataclass(frozen=True)
class Ceiling:
    """Every op at its floor and the best candidate set found (all predicted)."""

    t_ar: float  # the AR baseline at its floor
    t_draft: float
    t_verify: float
    overhead: float
    tau: float
    speedup: float  # against the predicted AR baseline (the same t_AR as the current speedup)
    speedup_at_floor_ar: float  # against the AR baseline at its floor too
    t_token: float
    block_size: int
    proposal: str  # "chain" or "tree{budget=N, topk=K}"
    pipeline: str = ""  # the what-ifs that reach it, as a pipeline string ("" : the program as it is)


@dataclass(frozen=True)
class Estimate:
    gpu: str
    shape: str
    program_hash: str
    workload: Workload
    t_ar: Figure
    t_draft: Figure
    t_verify: Figure
    overhead: Figure
    tau: Figure
    speedup: Figure
    t_token: Figure
    ceiling: Ceiling
    gaps: tuple[Gap, ...]
    steps: SpecStep = field(repr=False)
    calibration: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    calibrated_by: tuple[str, ...] = ()  # the results files read

    def figures(self) -> list[tuple[str, Figure]]:
        return [("t_ar", self.t_ar), ("t_draft", self.t_draft), ("t_verify", self.t_verify),
                ("overhead", self.overhead), ("tau", self.tau), ("speedup", self.speedup),
                ("t_token", self.t_token)]

    def to_dict(self) -> dict:
        """A JSON-ready summary (seconds; each figure with its source)."""
        return {
            "gpu": self.gpu, "shape": self.shape, "program_hash": self.program_hash,
            "figures": {k: {"value": f.value, "source": f.source, "floor": f.floor, "note": f.note}
                        for k, f in self.figures()},
            "ceiling": {k: getattr(self.ceiling, k) for k in Ceiling.__dataclass_fields__},
            "gaps": [{"what": g.what, "pass": g.pass_name, "pipeline": g.pipeline, "saving_s": g.saving,
                      "fraction": g.fraction, "source": g.source} for g in self.gaps],
            "calibration": dict(self.calibration),
            "calibrated_by": list(self.calibrated_by),
            "notes": list(self.notes),
        }


# -- records

@dataclass(frozen=True)
class StepRecord:
    what: str
    ms: float
    gpu: str
    q: int = 1
    batch: int = 1
    cache_len: int = DEFAULT_CACHE_LEN
    cuda_graphs: bool = True
    shape: str = ""
    ir_hash: str = ""
    origin: str = ""  # file the record came from

    def matches(self, program: Program, program_hash: str | None = None) -> bool:
        if self.ir_hash:
            return self.ir_hash == (program_hash or program.structural_hash())
        return bool(self.shape) and self.shape == shape_name(program)


@dataclass(frozen=True)
class AcceptanceRecord:
    shape: str
    model: AcceptanceModel
    drafter: str = ""
    origin: str = ""


@dataclass(frozen=True)
class KernelRecord:
    """A kernel's bandwidth efficiency relative to the stock bf16 path at M rows."""

    kernel: str
    gpu: str
    m: int
    efficiency: float
    origin: str = ""
    date: str = ""  # when measured (the results file's ISO "date"): the newest measurement at M wins


def _kind(d: Mapping[str, Any]) -> str | None:
    """A record's kind: given, or recognized by its keys (rows of bench/ scripts carry none)."""
    if "kind" in d:
        return str(d["kind"])
    if "u12_us" in d and "cublas_us" in d:
        return "u12-linear"  # a row of bench/kernels/u12_linear.py
    if "what" in d and "ms" in d:
        return "step"
    if "histogram" in d:
        return "acceptance"
    return None


def _record(d: Mapping[str, Any], origin: str, index: int) -> StepRecord | AcceptanceRecord | KernelRecord | None:
    where = f"{origin or 'records'}[{index}]"
    kind = _kind(d)

    def need(key):
        if key not in d:
            raise SpecError(f"{where}: a {kind!r} record needs {key!r}")
        return d[key]

    if kind == "step":
        what = need("what")
        if what not in WHATS:
            raise SpecError(f"{where}: what={what!r}; expected one of {', '.join(WHATS)}")
        q = int(d.get("q", 1)) if what == "ar" else int(need("q"))
        if not (d.get("shape") or d.get("ir_hash")):
            raise SpecError(f"{where}: a step record needs 'shape' or 'ir_hash'")
        return StepRecord(what=what, ms=float(need("ms")), gpu=str(need("gpu")).lower(), q=q,
                          batch=int(d.get("batch", 1)), cache_len=int(d.get("cache_len", DEFAULT_CACHE_LEN)),
                          cuda_graphs=bool(d.get("cuda_graphs", True)), shape=str(d.get("shape", "")),
                          ir_hash=str(d.get("ir_hash", "")), origin=origin)
    if kind == "acceptance":
        shape = str(need("shape"))
        note = f"measured: {origin}" if origin else "measured"
        if "histogram" in d:
            model = AcceptanceModel.from_histogram(d["histogram"], d.get("topk"), "measured", note)
        elif "tau" in d:
            model = AcceptanceModel.from_tau(float(d["tau"]), int(need("k")), "measured", note)
        else:
            raise SpecError(f"{where}: an acceptance record needs 'histogram' or 'tau' (with 'k')")
        return AcceptanceRecord(shape, model, str(d.get("drafter", "")), origin)
    if kind == "kernel":
        return KernelRecord(str(need("kernel")), str(need("gpu")), int(need("M")), float(need("efficiency")), origin,
                            date=str(d.get("date", "")))
    if kind == "u12-linear":  # achieved bandwidth of u12_linear over that of cuBLAS on the bf16 weight
        eff = float(d["cublas_us"]) / float(d["u12_us"]) * float(need("u12_bytes")) / float(need("bf16_bytes"))
        return KernelRecord("triton-u12", str(need("gpu")), int(need("M")), eff, origin, date=str(d.get("date", "")))
    return None  # other kinds (speedups, statistics, ...) are not calibration input


def parse_records(data: Any, origin: str = "") -> list[StepRecord | AcceptanceRecord | KernelRecord]:
    """Records from the JSON of one results file (a list, or an object with "records")."""
    defaults: dict = {}
    if isinstance(data, Mapping):
        defaults = {k: v for k, v in data.items() if k in ("gpu", "shape", "ir_hash", "drafter", "cuda_graphs", "date")}
        if "gpu" not in defaults and isinstance(data.get("device"), str):
            defaults["gpu"] = data["device"]
        data = data.get("records", data.get("rows", []))
    if not isinstance(data, list):
        raise SpecError(f"{origin or 'records'}: expected a list of records or an object with 'records'")
    out = []
    for i, d in enumerate(data):
        if not isinstance(d, Mapping):
            raise SpecError(f"{origin or 'records'}[{i}]: a record is a JSON object, got {type(d).__name__}")
        if d.get("path", "torch") != "torch" or d.get("what") == "tree-verify":
            continue  # the fused path's and tree steps: kernel choices this model does not tell apart yet
        rec = _record({**defaults, **d}, origin, i)
        if rec is not None:
            out.append(rec)
    return out


def shape_name(program: Program) -> str:
    """The name results files use for the program's target ("llama-3.1-8b"), or a generic one."""
    if program.attr("shape"):
        return str(program.attr("shape"))
    t = program.target
    layers = len(t.find("attention"))
    embed = t.node(t.find("embed")[0]) if t.find("embed") else None
    mlp = t.node(t.find("mlp")[0]) if t.find("mlp") else None
    family = str(program.attr("family", "?"))
    key = (family, layers, embed["dim"] if embed else 0, mlp["dim"] if mlp else 0, embed["vocab"] if embed else 0)
    return name_of(*key) or f"{family}-{layers}x{key[2]}-v{key[4]}"


# -- evaluation

def stock_target(target: Graph) -> Graph:
    """The AR baseline's target: weights back in their dtype, stock matmul kernels."""
    def fn(_, node: Node):
        if node.op in MATMUL_OPS and (node["format"] != node["dtype"] or node["kernel"] != "torch"):
            return node.replace(format=node["dtype"], kernel="torch")
        return None

    return target.map_nodes(fn)[0]


class _Evaluator:
    """Costs programs under one workload, caching each (graph, q, mode) it has costed."""

    def __init__(self, gpu: GPU, workload: Workload, acceptance: AcceptanceModel, factors: Mapping[str, float],
                 baseline: Graph):
        self.gpu, self.workload, self.acceptance, self.factors = gpu, workload, acceptance, factors
        self.baseline = baseline  # the AR baseline's target graph, fixed for every variant costed
        self._plans: dict[tuple, tuple[Graph, Graph | None, GraphPlan]] = {}
        self._steps: dict[tuple, StepEstimate] = {}
        self._info: dict[int, tuple[Graph, tuple[int, int]]] = {}
        self._taus: dict[tuple, float] = {}

    def plan(self, graph: Graph, shared: Graph | None = None) -> GraphPlan:
        key = (id(graph), id(shared))
        hit = self._plans.get(key)
        if hit is None or hit[0] is not graph or hit[1] is not shared:
            hit = self._plans[key] = (graph, shared, GraphPlan.of(graph, shared))
        return hit[2]

    def info(self, target: Graph) -> tuple[int, int]:
        hit = self._info.get(id(target))
        if hit is None or hit[0] is not target:
            hit = self._info[id(target)] = (target, target_info(target))
        return hit[1]

    def step(self, graph: Graph, what: str, *, q: int, batch: int, cuda_graphs: bool, dtype: str,
             cache_len: int | None = None, floor: bool = False, shared: Graph | None = None) -> StepEstimate:
        cache_len = self.workload.cache_len if cache_len is None else cache_len
        key = (id(graph), id(shared), what, q, batch, cache_len, cuda_graphs, dtype, floor)
        hit = self._steps.get(key)
        if hit is None:
            est = step_time(self.plan(graph, shared), self.gpu, batch, q, cache_len, dtype=dtype, cuda_graphs=cuda_graphs,
                            escape_rate=self.workload.escape_rate, what=what)
            hit = at_floor(est) if floor else est.scaled(self.factors.get(what, 1.0))
            self._steps[key] = hit
        return hit

    def batch(self, program: Program) -> int:
        if self.workload.batch:
            return self.workload.batch
        schedule = step_ops(program).get("schedule")
        return schedule["batch"] if schedule is not None else 1

    def cuda_graphs(self, program: Program) -> bool:
        """Graphed steps: the step graph says so (the cuda-graphs pass), else the program or workload."""
        schedule = program.step.find("schedule")
        if schedule and program.step.node(schedule[0]).get("graphs"):
            return True
        return bool(program.attr("cuda_graphs", bool(self.workload.cuda_graphs)))

    def tau(self, program: Program) -> float:
        ops = step_ops(program)
        propose, verify = ops["propose"], ops["verify"]
        if verify["mode"] == "two-level":  # between the one-level trees of the kept and the drafted nodes
            depth, width = draft_positions(program), propose.get("topk", TREE_WIDTH)
            kept, drafted = (self.tree_tau(b, depth, width) for b in (verify["q"] - 1, propose["budget"]))
            return tau_two_level(kept, drafted, verify["first"])
        if propose["shape"] == "tree":
            key = ("tree", propose["budget"], draft_positions(program), propose.get("topk", TREE_WIDTH))
        else:
            key = ("chain", min(verify["q"] - 1, draft_positions(program)))
        if key not in self._taus:
            self._taus[key] = (self.acceptance.tau_tree(*key[1:]) if key[0] == "tree"
                               else self.acceptance.tau_chain(key[1]))
        return self._taus[key]

    def tree_tau(self, budget: int, depth: int, width: int) -> float:
        key = ("tree", budget, depth, width)
        if key not in self._taus:
            self._taus[key] = self.acceptance.tau_tree(budget, depth, width)
        return self._taus[key]

    def spec(self, program: Program, floor: bool = False) -> SpecStep:
        dtype = str(program.attr("dtype", "bfloat16"))
        batch, graphs = self.batch(program), self.cuda_graphs(program)
        ops = step_ops(program)
        draft, verify = ops["draft"], ops["verify"]
        ar = self.step(self.baseline, "ar", q=1, batch=batch, cuda_graphs=True, dtype=dtype, floor=floor)
        d = self.step(program.drafter, "draft", q=draft["block_size"], batch=batch, cuda_graphs=graphs, dtype=dtype,
                      floor=floor, shared=program.target)
        v = self.step(program.target, "verify", q=verify["q"], batch=batch, cuda_graphs=graphs, dtype=dtype,
                      floor=floor)
        if verify["mode"] == "two-level":  # the first level's layers over the drafted tree, the rest over the kept
            drafted = self.step(program.target, "verify", q=ops["propose"]["budget"] + 1, batch=batch,
                                cuda_graphs=graphs, dtype=dtype, floor=floor)
            v = two_level_verify(drafted, v, verify["first"], verify.get("exit_layer", 0))
        tau = self.tau(program)
        rows = overhead_rows(program, self.gpu, batch=batch, tau=tau, cuda_graphs=graphs, dtype=dtype,
                             info=self.info(program.target))
        if floor:
            rows = tuple(replace(r, t_kernel=r.t_floor, t_latency=0.0, t_launch=0.0, efficiency=1.0) for r in rows)
        return SpecStep(ar, d, v, rows, tau)


def target_info(target: Graph) -> tuple[int, int]:
    """(vocabulary, K and V elements a token adds to the cache over all layers) of a target graph."""
    vocab = max((target.node(n)["out_features"] for n in target.find("lm_head")), default=0)
    kv = sum(2 * target.node(n)["kv_heads"] * target.node(n)["head_dim"] for n in target.find("attention"))
    return vocab, kv


def overhead_rows(program: Program, gpu: GPU, *, batch: int, tau: float, cuda_graphs: bool,
                  dtype: str = "bfloat16", info: tuple[int, int] | None = None) -> tuple[NodeCost, ...]:
    """The step graph's own work: building a tree proposal, acceptance, KV compaction.

    `info` is `target_info(program.target)`, passed by callers that cost many variants."""
    a = ACT_BYTES[dtype]
    vocab, kv_per_token = info or target_info(program.target)
    ops = step_ops(program)
    propose, accept, commit, verify = ops["propose"], ops["accept"], ops["commit"], ops["verify"]
    rows: list[NodeCost] = []
    if propose["shape"] == "tree":  # top-k over the drafter's logits, then the tree and its mask
        rows.append(NodeCost("propose", "propose", batch * draft_positions(program), kernels=2,
                             act_bytes=batch * draft_positions(program) * vocab * a + batch * verify["q"] ** 2))
    if verify["mode"] == "two-level":  # the first level's scores go to the host, which picks the survivors
        rows.append(NodeCost("prune", "prune", batch, kernels=1, act_bytes=batch * propose["budget"] * 4))
    rows.append(NodeCost("accept", "accept", batch, kernels=1, act_bytes=batch * verify["q"] * 8 * 2))
    if commit["kv"] == "compact":  # move the accepted path's K and V rows into place, every layer
        rows.append(NodeCost("commit", "commit", batch, kernels=1, kv_bytes=2 * batch * tau * kv_per_token * a))
    out = []
    for r in rows:
        t_mem = r.bytes / gpu.bandwidth
        latency = r.kernels * gpu.kernel_latency_s
        host = gpu.host_sync_s if (r.op == "accept" and accept["on"] == "host") or r.op == "prune" else 0.0
        out.append(replace(r, t_memory=t_mem, efficiency=gpu.bw_efficiency, t_latency=latency + host,
                           t_kernel=combine(t_mem / gpu.bw_efficiency, 0.0, gpu.overlap) + latency + host,
                           t_launch=0.0 if cuda_graphs else r.kernels * gpu.launch_s))
    return tuple(out)


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


# -- the model

class CostModel:
    """Roofline step model + acceptance model for one GPU, calibrated by benchmark records."""

    def __init__(self, gpu: GPU | str):
        self.gpu = load_gpu(gpu) if isinstance(gpu, str) else gpu
        self.step_records: list[StepRecord] = []
        self.acceptance_records: list[AcceptanceRecord] = []
        self._bound: list[tuple[StepRecord, float]] = []  # (record, measured / predicted) fixed at update
        self.calibrated_by: list[str] = []  # names of the results files read by update_from_results

    # -- calibration
    def update(self, records: Iterable[StepRecord | AcceptanceRecord | KernelRecord | Mapping],
               program: Program | None = None) -> int:
        """Take benchmark records (objects or dicts); returns how many concern this GPU.

        With `program`, step records that name no "ir_hash" are taken to measure that program,
        and their ratio to the prediction is fixed now (it then calibrates every program).
        Kernel records replace the database's efficiency of that kernel at the rows they measure: at
        each M the mean of the newest records (by "date"; undated ones count as oldest; each shape
        alike); the database's figures at other rows stay."""
        taken = 0
        kernels: dict[str, dict[int, list[KernelRecord]]] = {}
        for i, rec in enumerate(records):
            if isinstance(rec, Mapping):
                rec = _record(rec, "", i)
                if rec is None:
                    continue
            if isinstance(rec, AcceptanceRecord):
                self.acceptance_records.append(rec)
                taken += 1
                continue
            if isinstance(rec, KernelRecord):
                if gpu_key(rec.gpu) == self.gpu.name:
                    kernels.setdefault(rec.kernel, {}).setdefault(rec.m, []).append(rec)
                    taken += 1
                continue
            if gpu_key(rec.gpu) != self.gpu.name:
                continue
            self.step_records.append(rec)
            taken += 1
            if program is not None and (not rec.ir_hash or rec.ir_hash == program.structural_hash()):
                self._bound.append((rec, rec.ms * 1e-3 / self._raw(program, rec)))
        if kernels:
            table = dict(self.gpu.kernel_efficiency)
            for kernel, per_m in kernels.items():
                old = table.get(kernel, {})
                entry = dict(old) if isinstance(old, Mapping) else {}  # one number: measured rows replace it
                for m, recs in per_m.items():
                    newest = max(r.date for r in recs)
                    recs = [r for r in recs if r.date == newest]
                    entry[m] = sum(r.efficiency for r in recs) / len(recs)
                table[kernel] = entry
            self.gpu = self.gpu.with_(kernel_efficiency=table, sources={**self.gpu.sources, "kernel_efficiency": "measured"})
        return taken

    def update_from_results(self, paths: Iterable[str | Path], program: Program | None = None) -> int:
        """`update` from results files (JSON, see the module docstring); directories are globbed for *.json."""
        taken = 0
        kernel_records: list[KernelRecord] = []  # taken together: the newest file at each M wins
        for path in paths:
            path = Path(path)
            files = sorted(path.glob("*.json")) if path.is_dir() else [path]
            for f in files:
                self.calibrated_by.append(f.name)  # results files are named uniquely; no machine path
                try:
                    data = json.loads(f.read_bytes().decode("utf-8"))
                except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
                    raise SpecError(f"{f}: cannot read results ({e})") from None
                records = parse_records(data, str(f))
                kernel_records += [r for r in records if isinstance(r, KernelRecord)]
                taken += self.update([r for r in records if not isinstance(r, KernelRecord)], program)
        return taken + self.update(kernel_records, program)

    def step(self, program: Program, what: str, q: int = 1, *, batch: int = 1, cache_len: int = DEFAULT_CACHE_LEN,
             cuda_graphs: bool = True, calibrated: bool = True) -> StepEstimate:
        """One step of `program` ("ar": the baseline target, "verify": the target, "draft": the drafter),
        scaled by this GPU's calibration factor for that kind unless `calibrated` is False."""
        if what not in WHATS:
            raise ValueError(f"what={what!r}; expected one of {', '.join(WHATS)}")
        dtype = str(program.attr("dtype", "bfloat16"))
        graph = {"ar": stock_target(program.target), "verify": program.target, "draft": program.drafter}[what]
        est = step_time(graph, self.gpu, batch, q, cache_len, dtype=dtype, cuda_graphs=cuda_graphs, what=what,
                        shared=program.target if what == "draft" else None)
        return est.scaled(self.calibration(program)[what]) if calibrated else est

    def _raw(self, program: Program, rec: StepRecord) -> float:
        """The uncalibrated prediction of a record's step on `program`."""
        return self.step(program, rec.what, rec.q, batch=rec.batch, cache_len=rec.cache_len,
                         cuda_graphs=rec.cuda_graphs, calibrated=False).raw_time

    def _matching(self, program: Program, program_hash: str) -> list[StepRecord]:
        bound = {id(r) for r, _ in self._bound}
        return [r for r in self.step_records if id(r) not in bound and r.matches(program, program_hash)]

    def calibration(self, program: Program | None = None, program_hash: str | None = None) -> dict[str, float]:
        """measured / predicted per step kind on this GPU (1.0 where nothing was measured)."""
        ratios: dict[str, list[float]] = {w: [] for w in WHATS}
        for rec, ratio in self._bound:
            ratios[rec.what].append(ratio)
        if program is not None:
            program_hash = program_hash or program.structural_hash()
            for rec in self._matching(program, program_hash):
                ratios[rec.what].append(rec.ms * 1e-3 / self._raw(program, rec))
        pooled = [x for xs in ratios.values() for x in xs]
        return {w: _geomean(xs) if xs else (_geomean(pooled) if pooled else 1.0) for w, xs in ratios.items()}

    def acceptance_for(self, program: Program, workload: Workload) -> tuple[AcceptanceModel, str]:
        """The acceptance model a prediction uses, and a note on where it came from."""
        if workload.acceptance is not None:
            return workload.acceptance, workload.acceptance.note or "acceptance given with the workload"
        k = draft_positions(program)
        if workload.tau is not None:
            m = AcceptanceModel.from_tau(workload.tau, k, source="predicted",
                                         note=f"τ={workload.tau:g} from the spec, geometric over {k} positions")
            return m, m.note
        draft = step_ops(program)["draft"]
        shape = shape_name(program)
        for rec in reversed(self.acceptance_records):
            if rec.shape == shape and (not rec.drafter or rec.drafter == draft["kind"]):
                return rec.model, rec.model.note
        m = AcceptanceModel.geometric(DEFAULT_ALPHA, k, "predicted", f"no acceptance data: alpha={DEFAULT_ALPHA} assumed")
        return m, m.note

    def _measured(self, program: Program, program_hash: str, what: str, step: StepEstimate) -> StepRecord | None:
        hits = [r for r in self.step_records
                if r.what == what and r.q == step.q and r.batch == step.batch and r.cache_len == step.cache_len
                and r.cuda_graphs == step.cuda_graphs and r.matches(program, program_hash)]
        if not hits:
            return None
        hits.sort(key=lambda r: r.ms)
        return hits[len(hits) // 2]

    # -- prediction
    def predict(self, program: Program, workload: Workload | None = None,
                what_ifs: WhatIfs = no_what_ifs) -> Estimate:
        """The estimate for `program`; `what_ifs` offers the passes' effects for the gaps and the
        ceiling (see gaps.py; without it there are no pass gaps and the ceiling is `program` at its floor)."""
        w = workload or Workload()
        program_hash = program.structural_hash()
        acceptance, acc_note = self.acceptance_for(program, w)
        factors = self.calibration(program, program_hash)
        ev = _Evaluator(self.gpu, w, acceptance, factors, stock_target(program.target))
        now = ev.spec(program)
        floor = ev.spec(program, floor=True)
        taken, reached = rank_gaps(program, lambda p: ev.spec(p).t_token, what_ifs)
        seed = Reached(ev.spec(reached, floor=True).t_token, reached, tuple(g.pipeline for g in taken))
        ceiling = self._ceiling(program, ev, now, what_ifs, seed)
        rest = remainder_gap(ev.spec(reached).t_token, ceiling.t_token, now.t_token)
        gaps = sorted([*taken, *([rest] if rest else [])], key=lambda g: -g.saving)

        figs: dict[str, Figure] = {}
        for what, step, fl in (("ar", now.ar, floor.ar), ("draft", now.draft, floor.draft),
                               ("verify", now.verify, floor.verify)):
            rec = self._measured(program, program_hash, what, step)
            if rec is not None:
                figs[what] = Figure(rec.ms * 1e-3, "measured", fl.time, f"bench: {rec.origin or 'record'}")
            else:
                note = f"calibrated x{factors[what]:.3f}" if abs(factors[what] - 1.0) > 1e-9 else ""
                figs[what] = Figure(step.time, "predicted", fl.time, note)
        t_spec = figs["draft"].value + figs["verify"].value + now.overhead
        from_measured = any(f.source == "measured" for f in figs.values())
        mixed = "from measured step times" if from_measured else ""
        tau = Figure(now.tau, acceptance.source if acceptance.source == "measured" else "predicted", note=acc_note)
        notes = []
        if self.gpu.source_of("bandwidth") != "measured":
            notes.append(f"{self.gpu.name}: bandwidth and rates are datasheet figures (not measured on this card)")
        return Estimate(
            gpu=self.gpu.name, shape=shape_name(program), program_hash=program_hash, workload=w,
            t_ar=figs["ar"], t_draft=figs["draft"], t_verify=figs["verify"],
            overhead=Figure(now.overhead, "predicted", floor.overhead),
            tau=tau,
            speedup=Figure(now.tau * figs["ar"].value / t_spec, "predicted", note=mixed),
            t_token=Figure(t_spec / now.tau, "predicted", floor.t_token, mixed),
            ceiling=ceiling, gaps=tuple(gaps), steps=now, calibration=factors, notes=tuple(notes),
            calibrated_by=tuple(self.calibrated_by),
        )

    def _ceiling(self, program: Program, ev: _Evaluator, now: SpecStep, what_ifs: WhatIfs, seed: Reached) -> Ceiling:
        """Every op at its floor, over the programs the what-ifs reach (gaps.search_ceiling); `seed`,
        the waterfall's last program, starts in the beam."""
        best = search_ceiling(program, lambda p: ev.spec(p, floor=True).t_token, what_ifs, seeds=[seed])
        s = ev.spec(best.program, floor=True)
        ops = step_ops(best.program)
        propose = ops["propose"]
        proposal = "chain" if propose["shape"] == "chain" else \
            f"tree{{budget={propose['budget']}, topk={propose.get('topk', TREE_WIDTH)}}}"
        return Ceiling(t_ar=s.ar.time, t_draft=s.draft.time, t_verify=s.verify.time, overhead=s.overhead, tau=s.tau,
                       speedup=s.tau * now.ar.time / s.t_spec, speedup_at_floor_ar=s.speedup, t_token=s.t_token,
                       block_size=ops["draft"]["block_size"], proposal=proposal, pipeline=",".join(best.pipeline))


def gpu_key(name: str) -> str:
    """The database name of a GPU as a record names it ("h200", "NVIDIA H200"), or the name itself
    lower-cased where the database has no such card (its records then calibrate nothing)."""
    try:
        return resolve_gpu(name)
    except SpecError:
        return name.lower()


def calibration_files(gpu: GPU, root: Path = REPOSITORY) -> list[Path]:
    """The results files gpus.yaml lists for `gpu` (its `calibration`), under `root`: these and no
    others calibrate it by default, so a file added to or moved within bench/results changes no
    prediction until the list names it. A listed file that is missing is a SpecError naming it (the
    list must follow a rename); where none of the listed folders exists (the package installed
    without its repository) there is nothing to read."""
    files = [root / name for name in gpu.calibration]
    if not any(f.parent.is_dir() for f in files):
        return []
    missing = [name for name, f in zip(gpu.calibration, files) if not f.is_file()]
    if missing:
        raise SpecError(f"gpus.yaml: gpus.{gpu.name}.calibration names {missing[0]}, which is not in {root} "
                        f"(renamed or moved? the list must name the file)")
    return files


def explain(program: Program, gpu_name: str, workload: Workload | None = None,
            results: Iterable[str | Path] | None = None, what_ifs: WhatIfs = no_what_ifs) -> Estimate:
    """What `specpilot explain` shows: the estimate for `program` on `gpu_name`, its gaps and ceiling
    over the what-ifs offered, calibrated by the results files or folders given, or by default by
    the files gpus.yaml lists for the GPU (`calibration_files`); `results=()` for none."""
    model = CostModel(gpu_name)
    files = calibration_files(model.gpu) if results is None else list(results)
    if files:
        model.update_from_results(files)
    return model.predict(program, workload, what_ifs)
