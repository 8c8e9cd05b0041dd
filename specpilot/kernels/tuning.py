"""Lookup in a kernel's TUNED table: the measured shape, else the nearest measured one.

TUNED tables (kernels/fused_linear.py, kernels/u12/dispatch.py and fused.py) hold the best configs a sweep found
on the H200, keyed by (M bucket, N, K, ...) at the shapes it swept: Llama-3.1-8B's layers. Another
model's layers of about that size want about the same tiles: a config is bound by K (the loop a
program runs, its chunk against the row) and by the M bucket and flags (the accumulators a thread
holds), while N sets how many programs there are. So a shape the table lacks takes the config of
the nearest key with the same M bucket and flags and N and K each within 2x of its own (distance:
|log2 N'/N| + |log2 K'/K|, the first in table order on a tie); a shape further from every
measured one (the zoo's hidden size 256, say) gets the kernel's own heuristic. Qwen3-8B's
gate_up (24576 x 4096) and down (4096 x 12288) ran the heuristic's one-row GEMV tiles before this:
its fused AR step 4.57 ms, 1.22x the weight-read floor
(docs/experiments/tried/step_times_h200_qwen-63c1b4f.json), and 4.24 ms, 1.13x, on Llama-3.1-8B's
configs (docs/experiments/tried/step_times_h200_qwen-e85babb.json); its u12 verify(16) 7.35 ms and 5.54.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

C = TypeVar("C")

MAX_RATIO = 2.0  # N and K each within this factor of a measured shape's


def nearest_tuned(table: Mapping[tuple, C], key: tuple) -> C | None:
    """table[key] if there; else the entry whose key shares key[0] (the M bucket) and key[3:]
    (flags), with N = key[1] and K = key[2] each within MAX_RATIO, nearest in log2 N + log2 K;
    None when no entry qualifies."""
    if key in table:
        return table[key]
    m, n, k, *flags = key
    best, best_d = None, math.inf
    limit = math.log2(MAX_RATIO)
    for other, cfg in table.items():
        om, on, ok, *oflags = other
        if om != m or oflags != flags or min(n, k, on, ok) <= 0:
            continue
        dn, dk = abs(math.log2(on / n)), abs(math.log2(ok / k))
        if dn <= limit and dk <= limit and dn + dk < best_d:
            best, best_d = cfg, dn + dk
    return best


@dataclass(frozen=True)
class KernelTuning:
    """The tuned config tables the kernels consult, by name: "fused_linear" (fused_linear.TUNED),
    "u12", "u12_tiles" (u12/dispatch.py's TUNED, TUNED_TILES) and "u12_fused" (u12/fused.py's
    TUNED_FUSED), each key tuple -> config. A kernel called with `tuning` looks up its table there,
    without it in its module's own table: a compiled engine stores the tables it was built with
    (engine_tuning.json) and runs with those, whatever this install's tables say."""

    tables: Mapping[str, Mapping[tuple, Any]]

    def table(self, name: str, default: Mapping[tuple, C]) -> Mapping[tuple, C]:
        """The table `name`, or `default` (the kernel's module table) where this tuning lacks it."""
        return self.tables.get(name, default)

    def to_json(self) -> dict:
        """{table: [{"key": [...], "config": {field: value}}]} in the tables' order."""
        return {name: [{"key": list(key), "config": dataclasses.asdict(cfg)} for key, cfg in table.items()]
                for name, table in self.tables.items()}

    @classmethod
    def from_json(cls, data: object, types: Mapping[str, type], source: str) -> "KernelTuning":
        """The tables `to_json` wrote; `types` names each table's config class. ValueError naming
        `source` and the table and entry that is not what it should be."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected an object of tables ({', '.join(types)}), got {type(data).__name__}")
        tables: dict[str, dict[tuple, Any]] = {}
        for name, rows in data.items():
            if name not in types:
                raise ValueError(f"{source}: table {name!r}: expected one of {', '.join(types)}")
            if not isinstance(rows, list):
                raise ValueError(f"{source}: table {name!r}: expected a list of entries")
            table: dict[tuple, Any] = {}
            for i, row in enumerate(rows):
                try:
                    key = tuple(row["key"])
                    table[key] = types[name](**row["config"])
                except (KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{source}: table {name!r}, entry {i}: expected {{'key': [...], 'config': "
                                     f"{{...}}}} of a {types[name].__name__} ({e})") from None
            tables[name] = table
        return cls(tables)
