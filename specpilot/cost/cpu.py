"""This host's CPU as a device of the cost model: every figure measured here, cached per host.

    device = cpu_device(program)     # reads the host's record, measuring what it lacks (seconds)
    CostModel(device).predict(program, workload)

A CPU has no entry in gpus.yaml: its figures are measured on the host by a short calibration and
kept in a record under the specpilot cache (`$SPECPILOT_CACHE/cost/cpu/<host>.json`), keyed by the
host: the CPU's model name, its core count, torch's thread count and torch's version (a record of
another key is refused, never reused). The figures and how each is measured:

    bandwidth      bytes/s read by a streaming reduction (`x.sum()`) over `stream_bytes`, best of repeats
    copy_bandwidth bytes/s read and written by `y.copy_(x)` over the same tensor (recorded, not used)
    op_overhead_s  wall time of one tiny op (`a + b` on one-element tensors) called from Python
                   (recorded: the floor of an op's cost)
    step_op_overhead_s  what an op of a real step costs whatever its size: a decode step of the
                   runtime's decoder (runtime/model.py, `STEP_LAYERS` qwen3 layers) at width 16, where
                   no matmul weighs, over the ops the cost model counts for that step (roofline.KERNELS).
                   It holds the Python between the ops and the ops the count leaves out (views, casts,
                   cache writes: a zoo AR step calls about 600 ops from Python where the model counts
                   310); the cost model's kernel_latency
    host_sync_s    one `.item()` of a one-element tensor (a host-side accept)
    fp32_rate      elementwise FLOP/s of `torch.mul` over a 64K-element fp32 tensor (in cache), the
                   op overhead taken out
    matmul         FLOP/s of the linear a CPU engine runs (fp32: runtime/cpu_linear.py's PackedLinear
                   where oneDNN has it, `F.linear` at one row; else `F.linear`) at each weight shape (k, n) the program holds
                   and each row count of `rows`, in the program's dtype, the op overhead taken out; the
                   weight is cycled through copies filling `pool_bytes`, so that a step's weights come from
                   memory as in a decode step, not from a cache that one weight fits in
    matmul_peak    the largest matmul rate measured (prices attention's and MoE's matmuls, and the floor)

On the zoo's models (one thread, fp32) a step is matmul-bound, the matmul rate at few rows far below
the peak, with a large fixed part that does not scale with its rows: the ops and the Python between
them (docs/experiments/agent-cpu.md). The roofline (roofline.py) prices a CPU's ops with these: a
matmul at the rate measured at its shape (read between measured rows and widths), every op
`step_op_overhead_s` (paid with the cuda-graphs pass too: nothing is captured on a CPU), and no
fused-kernel launch counts (`runs_triton` False: their torch references run).

A record that lacks a figure, or holds one that is not a positive number, is refused naming the file
and the field (delete the file to measure again); a program with a weight shape the record lacks is
measured at that shape and the record rewritten (atomically).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import re
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..errors import SpecError
from ..hf.config import ModelConfig
from ..ir import MATMUL_OPS, Program
from ..ir.lower import Shapes, lower_causal_lm
from ..runtime.builtin import cache_root
from ..runtime.cpu_linear import PackedLinear, packed_linear_available
from ..runtime.decode import generate_ar
from ..runtime.model import Transformer
from .gpu import GPU
from .roofline import KERNELS

RECORD_KIND = "cpu-device"
RECORD_VERSION = 3  # a record of another version is measured again (1 had no step_op_overhead_s; 2 timed
# fp32 matmuls by F.linear where the engine now runs runtime/cpu_linear.py's packed linear)
FIGURES = {  # field -> what a record must hold there
    "bandwidth": "read bytes/s of a streaming reduction",
    "copy_bandwidth": "bytes/s read and written by a copy",
    "op_overhead_s": "seconds of one tiny op",
    "step_op_overhead_s": "seconds a counted op of a tiny-width decode step",
    "host_sync_s": "seconds of one .item()",
    "fp32_rate": "elementwise FLOP/s",
    "matmul_peak": "the largest matmul FLOP/s measured",
}
PEAK_SHAPE = (512, 512)  # measured in every new record, whatever the program's shapes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class CPUCalibration:
    """How the host is measured: sizes, rows and timing."""

    stream_bytes: int = 256 << 20  # the streaming reduction's tensor
    pool_bytes: int = 64 << 20  # a matmul's weight copies, cycled (more than a server's L3)
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    min_time_s: float = 0.01  # each timing loop runs at least this long
    repeats: int = 5  # timing loops per figure; the best is kept (the host's capability, not its load)

    def __post_init__(self):
        if self.stream_bytes < 4096 or self.pool_bytes < 0 or not self.rows or min(self.rows) < 1 or self.repeats < 1:
            raise ValueError("CPUCalibration: stream_bytes >= 4096, pool_bytes >= 0, rows >= 1, repeats >= 1")


@dataclass(frozen=True)
class HostKey:
    """What a record is valid for: the CPU model, its cores, torch's threads and torch's version."""

    cpu: str
    cores: int
    threads: int
    torch: str

    def slug(self) -> str:
        name = re.sub(r"[^a-z0-9]+", "-", self.cpu.lower()).strip("-") or "cpu"
        return f"{name}_c{self.cores}_t{self.threads}_torch{re.sub(r'[^0-9a-z.]+', '-', self.torch.lower())}"

    def describe(self) -> str:
        return f"{self.cpu}, {self.cores} cores, {self.threads} torch threads, torch {self.torch}"


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name", else the platform's)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_key() -> HostKey:
    return HostKey(cpu_model_name(), os.cpu_count() or 1, torch.get_num_threads(), torch.__version__.split("+")[0])


@dataclass(frozen=True)
class CPURecord:
    host: HostKey
    figures: Mapping[str, float]
    matmul: Mapping[str, Mapping[tuple[int, int], Mapping[int, float]]]  # dtype -> (k, n) -> rows -> FLOP/s
    date: str = ""
    load: tuple[float, ...] = ()  # the load average (1, 5, 15 min) when measured
    origin: str = ""
    method: str = ""

    def shapes(self, dtype: str) -> set[tuple[int, int]]:
        return set(self.matmul.get(dtype, {}))

    def device(self, dtype: str = "float32") -> GPU:
        """The cost model's device for programs of `dtype`, from this record."""
        f = self.figures
        rates = self.matmul.get(dtype, {})
        if not rates:
            raise SpecError(f"{self.origin or 'the CPU record'}: no matmul measured in {dtype}; "
                            f"expected matmul.{dtype} (measured by cpu_device for a {dtype} program)")
        load = ", ".join(f"{x:.2f}" for x in self.load)
        return GPU(
            name="cpu", full_name=f"CPU: {self.host.describe()}",
            bandwidth=f["bandwidth"], bf16_rate=f["matmul_peak"], fp32_rate=f["fp32_rate"], sms=self.host.cores,
            l2_bytes=0.0, memory_bytes=0.0, launch_s=0.0, kernel_latency_s=f["step_op_overhead_s"],
            host_sync_s=f["host_sync_s"], bw_efficiency=1.0, mm_efficiency=1.0, overlap=math.inf,
            attention_program_bw=math.inf,
            sources={k: "measured" for k in ("bandwidth", "bf16_rate", "fp32_rate", "kernel_latency_s", "host_sync_s")},
            note=f"measured on this host {self.date} (load average {load}): {self.origin}",
            matmul_rates={shape: dict(rows) for shape, rows in rates.items()}, runs_triton=False)

    def to_dict(self) -> dict:
        return {
            "kind": RECORD_KIND, "version": RECORD_VERSION,
            "host": {"cpu": self.host.cpu, "cores": self.host.cores, "threads": self.host.threads,
                     "torch": self.host.torch},
            "date": self.date, "load": list(self.load), "method": self.method,
            "figures": dict(self.figures),
            "matmul": {dtype: [{"k": k, "n": n, "m": m, "flops_per_s": r}
                               for (k, n), rows in sorted(shapes.items()) for m, r in sorted(rows.items())]
                       for dtype, shapes in self.matmul.items()},
        }


def _positive(value: Any, where: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{where}: expected {what} (a positive number), got {value!r}")
    return float(value)


def parse_cpu_record(data: Any, origin: str = "the CPU record") -> CPURecord:
    """A record from its JSON; SpecError naming `origin` and the field for anything missing or wrong."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{origin}: expected a JSON object (a {RECORD_KIND!r} record)")
    if data.get("kind") != RECORD_KIND or data.get("version") != RECORD_VERSION:
        raise SpecError(f"{origin}: kind/version is {data.get('kind')!r}/{data.get('version')!r}; "
                        f"expected {RECORD_KIND!r}/{RECORD_VERSION}")
    host = data.get("host")
    if not isinstance(host, Mapping):
        raise SpecError(f"{origin}: host is missing; expected {{cpu, cores, threads, torch}}")
    for k, kind in (("cpu", str), ("cores", int), ("threads", int), ("torch", str)):
        if not isinstance(host.get(k), kind) or isinstance(host.get(k), bool):
            raise SpecError(f"{origin}: host.{k} is {host.get(k)!r}; expected a {kind.__name__}")
    figures = data.get("figures")
    if not isinstance(figures, Mapping):
        raise SpecError(f"{origin}: figures is missing; expected {', '.join(FIGURES)}")
    values = {}
    for name, what in FIGURES.items():
        if name not in figures:
            raise SpecError(f"{origin}: figures.{name} is missing; expected {what} (a positive number). "
                            f"Delete the file to measure the host again")
        values[name] = _positive(figures[name], f"{origin}: figures.{name}", what)
    matmul = data.get("matmul")
    if not isinstance(matmul, Mapping):
        raise SpecError(f"{origin}: matmul is missing; expected {{dtype: [{{k, n, m, flops_per_s}}, ...]}}")
    tables: dict[str, dict[tuple[int, int], dict[int, float]]] = {}
    for dtype, rows in matmul.items():
        if dtype not in DTYPES or not isinstance(rows, list):
            raise SpecError(f"{origin}: matmul.{dtype}: expected a list under one of {', '.join(DTYPES)}")
        for i, row in enumerate(rows):
            where = f"{origin}: matmul.{dtype}[{i}]"
            if not isinstance(row, Mapping):
                raise SpecError(f"{where}: expected {{k, n, m, flops_per_s}}")
            k, n, m = (int(_positive(row.get(x), f"{where}.{x}", "a size")) for x in ("k", "n", "m"))
            rate = _positive(row.get("flops_per_s"), f"{where}.flops_per_s", "matmul FLOP/s")
            tables.setdefault(dtype, {}).setdefault((k, n), {})[m] = rate
    load = data.get("load") or []
    return CPURecord(HostKey(host["cpu"], host["cores"], host["threads"], host["torch"]), values, tables,
                     str(data.get("date", "")), tuple(float(x) for x in load if isinstance(x, (int, float))),
                     origin, str(data.get("method", "")))


# -- measuring

def _per_call(fn, config: CPUCalibration) -> float:
    """Seconds a call of `fn`, the best of `repeats` loops of at least `min_time_s` each."""
    fn()
    n, t = 1, 0.0
    while True:  # calls a loop
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - t0
        if t >= config.min_time_s or n >= 1 << 20:
            break
        n *= 2 if t <= 0 else max(2, min(16, math.ceil(config.min_time_s / t)))
    best = t / n
    for _ in range(config.repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def measure_figures(config: CPUCalibration) -> dict[str, float]:
    """Every figure but the matmul table (see the module docstring)."""
    small = config.stream_bytes // 4
    x = torch.rand(small)
    y = torch.empty_like(x)
    bw = x.numel() * 4 / _per_call(lambda: x.sum(), config)
    copy = 2 * x.numel() * 4 / _per_call(lambda: y.copy_(x), config)
    del x, y
    a, b = torch.ones(1), torch.ones(1)
    overhead = _per_call(lambda: a + b, config)
    sync = _per_call(lambda: a.item(), config)
    e = torch.rand(1 << 16)
    f = torch.rand(1 << 16)
    out = torch.empty_like(e)
    t = _per_call(lambda: torch.mul(e, f, out=out), config)
    rate = e.numel() / max(t - overhead, 0.1 * t)
    return {"bandwidth": bw, "copy_bandwidth": copy, "op_overhead_s": overhead, "host_sync_s": sync,
            "fp32_rate": rate, "step_op_overhead_s": measure_step_overhead(config)}


STEP_LAYERS = 4  # layers of the reference decoder whose tiny-width steps time the runtime's ops


def measure_step_overhead(config: CPUCalibration, tokens: int = 32) -> float:
    """Seconds a counted op of a decode step costs where no op has work to speak of: the runtime's
    qwen3 decoder (`STEP_LAYERS` layers, width 16, 64 tokens) decoding greedily, its decode time a
    step (the best of `config.repeats` runs) over the ops the cost model counts for that step."""
    cfg = ModelConfig("qwen3", 64, 16, 16, STEP_LAYERS, 2, 1, 8, 1e4, 1e-6, True, True, 4096, None, None)
    model = Transformer(cfg).eval()
    graph = lower_causal_lm("reference", Shapes.of(cfg), "float32")
    counted = sum(KERNELS.get(node.op, 1) for _, node in graph.items())
    prompt = list(range(1, 9))
    generate_ar(model, prompt, max_new_tokens=4, eos_token_id=None)
    best = math.inf
    for _ in range(config.repeats):
        g = generate_ar(model, prompt, max_new_tokens=tokens, eos_token_id=None)
        best = min(best, g.decode_s / max(g.steps, 1))
    return best / counted


def measure_matmuls(shapes: Iterable[tuple[int, int]], dtype: str, overhead: float,
                    config: CPUCalibration) -> dict[tuple[int, int], dict[int, float]]:
    """FLOP/s of the engine's linear ([m, k] by weight [n, k]; module docstring) at each shape and row
    count of `config.rows`, the weight cycled through copies filling `config.pool_bytes`."""
    dt = DTYPES[dtype]
    packed = dt == torch.float32 and packed_linear_available()
    out: dict[tuple[int, int], dict[int, float]] = {}
    for k, n in sorted(set(shapes)):
        size = k * n * torch.tensor([], dtype=dt).element_size()
        weights = [torch.randn(n, k, dtype=dt) for _ in range(max(1, min(64, math.ceil(config.pool_bytes / size))))]
        linears = [PackedLinear(w) if packed else functools.partial(_linear, weight=w) for w in weights]
        del weights
        for m in config.rows:
            x = torch.randn(m, k, dtype=dt)
            it = iter(())

            def call():
                nonlocal it
                linear = next(it, None)
                if linear is None:
                    it = iter(linears)
                    linear = next(it)
                linear(x)

            t = _per_call(call, config)
            out.setdefault((k, n), {})[m] = 2.0 * m * k * n / max(t - overhead, 0.1 * t)
        del linears
    return out


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def matmul_shapes(program: Program) -> set[tuple[int, int]]:
    """The (k, n) weight shapes of the program's matmuls, and of its heads at V/4 and V/16 rows (the
    widths a reduced drafter vocabulary reaches)."""
    out = set()
    for graph in (program.target, program.drafter):
        for _, node in graph.items():
            if node.op in MATMUL_OPS:
                k, n = int(node["in_features"]), int(node.get("vocab_subset") or node["out_features"])
                out.add((k, n))
                if node.op == "lm_head":
                    out |= {(k, max(1, int(node["out_features"]) // d)) for d in (4, 16)}
    return out


def record_path(key: HostKey, root: Path | None = None) -> Path:
    return Path(root or cache_root()) / "cost" / "cpu" / f"{key.slug()}.json"


def _older(path: Path) -> bool:
    """Whether `path` holds a record of an older version than this module writes."""
    try:
        version = json.loads(path.read_text()).get("version")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(version, int) and version < RECORD_VERSION


def load_record(path: Path, key: HostKey) -> CPURecord | None:
    """The record at `path` (None where there is none); SpecError if it is malformed or of another host."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"{path}: cannot read the CPU record ({e}); delete it to measure the host again") from None
    rec = parse_cpu_record(data, str(path))
    if rec.host != key:
        raise SpecError(f"{path}: measured on {rec.host.describe()}; this host is {key.describe()} "
                        f"(delete the file to measure again)")
    return rec


def _write(path: Path, rec: CPURecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(rec.to_dict(), f, indent=1)
    os.replace(tmp, path)


def cpu_record(shapes: Iterable[tuple[int, int]] = (), dtype: str = "float32", *, root: Path | None = None,
               config: CPUCalibration = CPUCalibration(), measure: bool = True) -> CPURecord:
    """This host's record with matmuls measured at `shapes` in `dtype`: read from the cache, what it
    lacks measured and the record rewritten. With `measure` False, SpecError for anything missing."""
    if dtype not in DTYPES:
        raise SpecError(f"the CPU cost model measures {', '.join(DTYPES)} matmuls; got dtype {dtype!r}")
    key = host_key()
    path = record_path(key, root)
    if measure and _older(path):
        path.unlink()  # a record of an older version lacks figures this one measures: measured again
    rec = load_record(path, key)
    shapes = set(shapes)
    missing = shapes - (rec.shapes(dtype) if rec else set())
    if rec is not None and not missing:
        return rec
    if not measure:
        what = "no record" if rec is None else f"no {dtype} matmul at (k, n) = {sorted(missing)}"
        raise SpecError(f"{path}: {what} for {key.describe()}; measure the host first (cpu_record(measure=True))")
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    figures = dict(rec.figures) if rec else measure_figures(config)
    if rec is None:
        missing.add(PEAK_SHAPE)  # a record always has a matmul_peak
    tables = {d: {s: dict(r) for s, r in t.items()} for d, t in (rec.matmul if rec else {}).items()}
    tables.setdefault(dtype, {}).update(measure_matmuls(missing, dtype, figures["op_overhead_s"], config))
    figures["matmul_peak"] = max(r for t in tables.values() for rows in t.values() for r in rows.values())
    rec = CPURecord(key, figures, tables, datetime.now(timezone.utc).isoformat(timespec="seconds"), tuple(load),
                    str(path), "cost/cpu.py: best of repeated timing loops (module docstring)")
    _write(path, rec)
    return parse_cpu_record(rec.to_dict(), str(path))


def cpu_device(program: Program, *, root: Path | None = None, config: CPUCalibration = CPUCalibration(),
               measure: bool = True) -> GPU:
    """The cost model's device for `program` on this host's CPU (cpu_record at the program's shapes)."""
    dtype = str(program.attr("dtype", "float32"))
    return cpu_record(matmul_shapes(program), dtype, root=root, config=config, measure=measure).device(dtype)
