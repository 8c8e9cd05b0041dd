"""The GPU database: datasheet figures and, where we have them, measured ones (gpus.yaml).

`load_gpu("h200")` returns a `GPU` whose every figure comes with where it came from: the model
uses the measured value when the card was measured and the published one otherwise, and
`GPU.source_of(field)` says which: "measured", "published", or "default" (the database's
estimate for a figure nobody published or measured for this card).

`resolve_gpu(name)` is the one place a GPU's name is read: a database name, an alias (gpus.yaml
`aliases`: "a100", "h100"), or a device name as torch reports it ("NVIDIA A100-SXM4-40GB"). The
spec loader, the CLI's --gpu, the cost model and results files' "gpu" keys all go through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..errors import SpecError, UnpricedError

DATABASE = Path(__file__).with_name("gpus.yaml")

# Figures every GPU has; `defaults` in gpus.yaml supplies those an entry leaves out.
_FIELDS = (
    "bandwidth", "bf16_rate", "fp32_rate", "sms", "l2_bytes", "memory_bytes",
    "launch_s", "kernel_latency_s", "host_sync_s", "bw_efficiency", "mm_efficiency", "overlap",
)
# Figures whose default is derived from others when neither measured nor published.
_DERIVED = {
    # an attention program streams about a quarter of one SM's share of the bandwidth (H200: 7.8e9
    # measured against 4.06e12 / 132 = 3.1e10)
    "attention_program_bw": lambda v: 0.25 * v["bandwidth"] / v["sms"],
}


@dataclass(frozen=True)
class GPU:
    """One card as the cost model sees it. Rates in bytes/s and FLOP/s, times in seconds."""

    name: str
    full_name: str
    bandwidth: float  # the floor's bandwidth: measured read bandwidth if measured, else datasheet peak
    bf16_rate: float  # dense bf16 tensor-core rate (measured if measured)
    fp32_rate: float  # plain fp32 rate, for elementwise work
    sms: int
    l2_bytes: float
    memory_bytes: float
    launch_s: float = 0.0  # per kernel launched outside a CUDA graph
    kernel_latency_s: float = 0.0  # per kernel, also inside a CUDA graph
    host_sync_s: float = 0.0  # one device -> host -> device round trip
    bw_efficiency: float = 1.0
    mm_efficiency: float = 1.0
    overlap: float = math.inf  # p-norm exponent joining memory and compute time; inf = max
    attention_program_bw: float = math.inf  # bytes/s one attention program (CTA) streams
    kernel_efficiency: Mapping[str, Any] = field(default_factory=dict)  # kernel -> float | {rows: float}
    sources: Mapping[str, str] = field(default_factory=dict)  # field -> "measured" | "published" | "default"
    note: str = ""
    calibration: tuple[str, ...] = ()  # results files that calibrate this card, from the repository root
    # A host CPU (cost/cpu.py): measured matmul rates (FLOP/s) by weight shape (k, n) and rows, which
    # price a matmul node in place of bf16_rate · mm_efficiency; empty for a GPU.
    matmul_rates: Mapping[tuple[int, int], Mapping[int, float]] = field(default_factory=dict)
    runs_triton: bool = True  # False on a CPU: "triton-*" kernels run as their torch references there

    def matmul_rate(self, rows: int, k: int, n: int) -> float | None:
        """FLOP/s of a [rows, k] x [k, n] matmul from the measured table, or None without a table.

        Read piecewise-linearly in log(rows) and log(n) between measured points (held constant
        outside them), at the measured k nearest in log(k). UnpricedError where the table has no
        shape of this k's neighbourhood (a k more than 2x from every measured one)."""
        if not self.matmul_rates:
            return None
        ks = sorted({kk for kk, _ in self.matmul_rates})
        near = min(ks, key=lambda kk: abs(math.log(kk / k)))
        if abs(math.log(near / k)) > math.log(2.0):
            raise UnpricedError(f"{self.name}: no matmul measured near k={k} (measured k: "
                                f"{', '.join(map(str, ks))}); recalibrate the host with this program's shapes")
        ns = sorted(nn for kk, nn in self.matmul_rates if kk == near)
        return _log_interp(n, [(nn, _log_interp(rows, sorted(self.matmul_rates[(near, nn)].items())))
                               for nn in ns])

    def source_of(self, name: str) -> str:
        return self.sources.get(name, "published")

    def efficiency_of_kernel(self, kernel: str, rows: int = 1) -> float:
        """Bandwidth efficiency of a named kernel relative to the stock path (1.0 when not measured).

        An entry is one number, or a mapping {rows: efficiency} read piecewise-linearly in
        log(rows) and held constant outside the measured rows."""
        entry = self.kernel_efficiency.get(kernel)
        if entry is None:
            return 1.0
        if not isinstance(entry, Mapping):
            return float(entry)
        points = sorted((int(m), float(e)) for m, e in entry.items())
        if rows <= points[0][0]:
            return points[0][1]
        for (m0, e0), (m1, e1) in zip(points, points[1:]):
            if rows <= m1:
                w = math.log(rows / m0) / math.log(m1 / m0)
                return e0 + w * (e1 - e0)
        return points[-1][1]

    def with_(self, **changes: Any) -> "GPU":
        return replace(self, **changes)

    @staticmethod
    def from_entry(name: str, entry: Mapping[str, Any], defaults: Mapping[str, Any]) -> "GPU":
        published = dict(entry.get("published") or {})
        measured = dict(entry.get("measured") or {})
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key in _FIELDS:
            if key in measured:
                values[key], sources[key] = measured[key], "measured"
            elif key in published:
                values[key], sources[key] = published[key], "published"
            elif key in defaults:
                values[key], sources[key] = defaults[key], "default"
            else:
                raise SpecError(f"{DATABASE.name}: gpus.{name} has no {key!r} (nor does defaults)")
        values = {k: (int(v) if k == "sms" else float(v)) for k, v in values.items()}
        for key, derive in _DERIVED.items():
            if key in measured:
                values[key], sources[key] = float(measured[key]), "measured"
            elif key in published:
                values[key], sources[key] = float(published[key]), "published"
            else:
                values[key], sources[key] = derive(values), "default"
        notes = [published.get("source", ""), measured.get("source", "")]
        calibration = entry.get("calibration") or []
        if not isinstance(calibration, list) or not all(isinstance(f, str) for f in calibration):
            raise SpecError(f"{DATABASE.name}: gpus.{name}.calibration: expected a list of results file paths")
        return GPU(
            name=name,
            full_name=str(entry.get("name", name)),
            **values,
            kernel_efficiency={str(k): (dict(v) if isinstance(v, Mapping) else float(v))
                               for k, v in (measured.get("kernel_efficiency") or {}).items()},
            sources=sources,
            note="; ".join(n for n in notes if n),
            calibration=tuple(calibration),
        )


def _log_interp(x: float, points: list[tuple[float, float]]) -> float:
    """The value at x of (x, y) points read piecewise-linearly in log(x), constant outside them."""
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return float(y0 + w * (y1 - y0))
    return float(points[-1][1])


@lru_cache(maxsize=4)
def _database(path: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"{path}: cannot read the GPU database ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise SpecError(f"{path}: expected a mapping with a 'gpus' section")
    return data


def gpu_names(path: str | Path = DATABASE) -> list[str]:
    """The names `load_gpu` knows, in database order."""
    return list(_database(str(path))["gpus"])


def gpu_aliases(path: str | Path = DATABASE) -> dict[str, str]:
    """Other names for the database's cards (gpus.yaml `aliases`): alias -> database name."""
    return {str(k).lower(): str(v) for k, v in (_database(str(path)).get("aliases") or {}).items()}


def _spellings(key: str):
    """`key` as given, then as torch names a device ("nvidia a100-sxm4-40gb"): the vendor words
    dropped, the words joined, the model with each qualifier (a100-40gb, h100-pcie), the model."""
    yield key
    words = key.replace("nvidia", " ").replace("geforce", " ").replace("-", " ").replace("_", " ").split()
    if not words:
        return
    if words[0] == "rtx" and len(words) > 1:
        words = [f"rtx-{words[1]}", *words[2:]]
    yield "-".join(words)
    for qualifier in words[1:]:
        yield f"{words[0]}-{qualifier}"
    yield words[0]


def resolve_gpu(name: str, path: str | Path = DATABASE) -> str:
    """The database name of the GPU called `name` (case-insensitive; database names, aliases and
    torch's device names); SpecError naming the known names and aliases if there is none."""
    known, aliases = gpu_names(path), gpu_aliases(path)
    for spelling in _spellings(str(name).strip().lower()):
        if spelling in known:
            return spelling
        if spelling in aliases:
            return aliases[spelling]
    alias_list = ", ".join(f"{a} = {n}" for a, n in aliases.items())
    raise SpecError(f"unknown GPU {name!r}; expected one of {', '.join(known)} (or an alias: {alias_list})")


def load_gpu(name: str, path: str | Path = DATABASE) -> GPU:
    """The GPU called `name` (see `resolve_gpu`); SpecError if unknown."""
    data = _database(str(path))
    key = resolve_gpu(name, path)
    return GPU.from_entry(key, data["gpus"][key], data.get("defaults") or {})
