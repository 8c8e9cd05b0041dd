"""`fused-decoder`: serve the decoder stacks with fused kernels (runtime/fused.py).

Changes the `kernel` of the `rmsnorm`, `rope` and `mlp` nodes of the target graph and of the
drafter's (a PARD drafter's causal LM, or a DFlash drafter's context projection and block layers)
to "triton-fused". The torch backend then runs those stacks with about ten launches a layer:
RMSNorm with the residual add folded in, q|k|v and gate|up each as one GEMM over concatenated
weights (the original projections become views: no memory is doubled), qk-norm + RoPE + KV-cache
write in one kernel, SiLU·mul in one. A DFlash drafter's context K/V take one k|v GEMM (a view of
the q|k|v weight) and the same RoPE kernel without q heads. Triton on a GPU (or under
TRITON_INTERPRET=1), the kernels' torch references elsewhere.

Lossless: the same weights and ops. The fused kernels round where torch rounds; the one numerical
change is the concatenated GEMMs, which a BLAS may block differently from separate ones, so
logits can move by rounding. Token forcing is the judge. Not for hybrid recurrent targets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph, Node, Program
from ..ir.node import FUSED_OPS
from .base import Pass, PassResult, register

KERNEL = "triton-fused"


def _rewrite(_: str, node: Node) -> Node | None:
    if node.op in FUSED_OPS and node.get("kernel") != KERNEL:
        return node.replace(kernel=KERNEL)
    return None


def fusable(graph: Graph) -> bool:
    """A stack of attention layers (causal self-attention, or a DFlash drafter's over target
    context), with no recurrent (Gated DeltaNet) layers."""
    return bool(graph.find("attention")) and not graph.find("gated_deltanet")


def is_fused(graph: Graph) -> bool:
    return bool(graph.find("rmsnorm", lambda node: node.get("kernel") == KERNEL))


@register
@dataclass(frozen=True)
class FusedDecoder(Pass):
    name = "fused-decoder"
    lossless = True
    closes = "small kernels of the decoder layers"

    def apply(self, program: Program) -> PassResult:
        total, done = 0, []
        for level in ("target", "drafter"):
            graph = program.graph(level)
            if not fusable(graph):
                continue
            graph, n = graph.map_nodes(_rewrite)
            if n:
                program, total = program.with_graph(level, graph), total + n
                done.append(level)
        if total == 0:
            return PassResult(program, False, "no unfused attention decoder stack")
        return PassResult(program, True, f"{total} nodes of the {' and '.join(done)} on {KERNEL}")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return [cls()] if cls().apply(program).changed else []
