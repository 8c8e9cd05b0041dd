"""A deployment's fingerprint: what the memory keys trials by, and how near two deployments are.

The fingerprint is read from the stock program (the deployment lowered, no passes): the target's
family and shape (layers, hidden size, vocabulary), the drafter's kind and shape, where it is
measured (the GPU's name, or "cpu"), the dtype and the batch regime. Two deployments are near when
few of these differ; the weights say which differences matter most for whether a mechanism
transfers (a GPU or dtype changes what is fast more than a drafter's depth does).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..cost import shape_name
from ..ir import MATMUL_OPS, Program

# How much each difference counts in `distance` (0: the same deployment).
WEIGHTS = {"device": 4.0, "dtype": 3.0, "batch": 3.0, "target_family": 2.0, "target_shape": 2.0,
           "drafter_kind": 1.0, "drafter_shape": 1.0}


@dataclass(frozen=True)
class Fingerprint:
    target_family: str  # "qwen3", "llama", a known shape's name ...
    target_shape: str  # "L4-d256-v4096"
    drafter_kind: str  # dflash, pard
    drafter_shape: str  # "L2-d256-b16"
    device: str  # the GPU's database name, or "cpu"
    dtype: str
    batch: str  # the batch regime: "b1", or "b2-32" for a range

    @property
    def key(self) -> str:
        return "|".join(asdict(self).values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Fingerprint":
        return Fingerprint(**json.loads(text))

    def distance(self, other: "Fingerprint") -> float:
        return sum(w for k, w in WEIGHTS.items() if getattr(self, k) != getattr(other, k))


def _shape(graph, with_block: int | None = None) -> str:
    layers = {name.split(".")[1] for name, _ in graph.items() if name.startswith("layers.")}
    dims = [n["in_features"] for _, n in graph.items() if n.op in MATMUL_OPS]
    vocab = [n["vocab"] for _, n in graph.items() if n.op == "embed"]
    text = f"L{len(layers)}-d{max(dims) if dims else 0}-v{vocab[0] if vocab else 0}"
    return text + (f"-b{with_block}" if with_block is not None else "")


def fingerprint(stock: Program, device: str, batch_sizes: tuple[int, ...] = (1,)) -> Fingerprint:
    """The fingerprint of a deployment from its stock program; `device` is where trials are
    measured ("cpu", or the GPU's name)."""
    draft = stock.step.one("draft")[1]
    name = shape_name(stock)
    batch = f"b{batch_sizes[0]}" if len(batch_sizes) == 1 else f"b{min(batch_sizes)}-{max(batch_sizes)}"
    return Fingerprint(target_family=name.split("-")[0], target_shape=f"{name}-{_shape(stock.target)}", drafter_kind=draft["kind"],
                       drafter_shape=_shape(stock.drafter, draft["block_size"]), device=device,
                       dtype=str(stock.attr("dtype")), batch=batch)
