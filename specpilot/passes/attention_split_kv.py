"""`attention-split-kv`: run attention with the split-KV Triton kernel (short queries, long caches).

Changes the `kernel` of every `attention` node of the target and drafter graphs to
"triton-split-kv" (kernels/attention_split_kv.py): flash-decoding, the cache split across
programs, so that a decode or verify step with 1-64 new tokens draws the GPU's bandwidth instead
of one program per head. Nothing else moves: masks, shapes and the step graph stay as they were.
The torch backend installs the kernel on those layers (GPU, or TRITON_INTERPRET=1); queries
longer than it is built for (prefill) stay with SDPA.

Lossless: the same attention under the same visibility, with fp32 softmax and accumulation.
Logits can still move by rounding, since the kernel sums in another order (and rounds softmax
weights to bf16 before the value product, as flash attention does); token forcing is the judge
of the output tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Node, Program
from .base import Pass, PassResult, register

KERNEL = "triton-split-kv"


def _rewrite(_: str, node: Node) -> Node | None:
    return node.replace(kernel=KERNEL) if node.op == "attention" and node["kernel"] != KERNEL else None


@register
@dataclass(frozen=True)
class AttentionSplitKV(Pass):
    name = "attention-split-kv"
    lossless = True
    closes = "attention over the cache"

    def apply(self, program: Program) -> PassResult:
        total = 0
        for level in ("target", "drafter"):
            graph, n = program.graph(level).map_nodes(_rewrite)
            program, total = program.with_graph(level, graph), total + n
        if total == 0:
            return PassResult(program, False, f"every attention node already runs {KERNEL}")
        return PassResult(program, True, f"{total} attention nodes on {KERNEL}")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return [cls()] if cls().apply(program).changed else []
