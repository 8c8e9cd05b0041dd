"""`cuda-graphs`: run every speculative step as one CUDA graph replay, accepting on the device.

Changes the step graph: `accept` moves to the device (argmax, prefix match and bonus as tensor
ops; per step only the accepted count crosses to the host) and `schedule` gets graphs=true. The
torch backend then decodes with runtime/graph_decode.py: device-length KV caches, static shapes,
the drafter's forward, the verify forward and the acceptance captured once per runner and
replayed; the prefill stays eager. On a CPU the same step code runs without capture.

Lossless: the same forwards on the same inputs, the same greedy rule. Chains and best-first trees
(the tree built on the device by kernels/best_first_tree.py, static node budget, KV compaction by
device indices); hybrid (Gated DeltaNet) targets too, their states selected and committed by device
indices (runtime/hybrid.py), but not sparse MoE targets (the routed experts are read on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Node, Program
from .base import Pass, PassResult, register


def _rewrite(_: str, node: Node) -> Node | None:
    if node.op == "accept" and node["on"] != "device":
        return node.replace(on="device")
    if node.op == "schedule" and not node.get("graphs"):
        return node.replace(graphs=True)
    return None


@register
@dataclass(frozen=True)
class CudaGraphs(Pass):
    name = "cuda-graphs"
    lossless = True
    closes = "launch overhead and host round trips"

    def apply(self, program: Program) -> PassResult:
        verify = program.step.one("verify")[1]
        if verify["mode"] not in ("chain", "tree"):
            return PassResult(program, False, f"verify mode {verify['mode']!r}: graphed steps verify chains and trees")
        if program.target.find("moe"):
            return PassResult(program, False, "sparse MoE target: its layers read the routed experts on the host")
        step, n = program.step.map_nodes(_rewrite)
        if n == 0:
            return PassResult(program, False, "steps are already graphed")
        return PassResult(program.with_graph("step", step), True, "accept on the device; each step one CUDA graph")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return [cls()] if cls().apply(program).changed else []
