"""`ragged-verify`: requests verify different numbers of tokens, packed flat without padding.

Changes the step graph's `schedule` node: ragged=true (and policy "continuous"). Without it the
batched engine pads every request's verify to the longest of the step (each request verifies as
many of its drafts as the longest share, or its tree padded to the budget); with it each request's rows are packed one after
another into one flat token batch (runtime/batch.py `Ragged`, the split-KV kernel's ragged mode),
so the verify forward computes no padding rows (CUDA-graph buckets by token count are the runtime's
`BatchConfig.buckets`).

Lossless: padding or not changes only how many drafts are verified, never what a committed token
is. Chains and trees, of attention targets and hybrid (Gated DeltaNet) ones, ungraphed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program
from .base import Pass, PassResult, register
from .verify_budget import batched_space, set_schedule


@register
@dataclass(frozen=True)
class RaggedVerify(Pass):
    name = "ragged-verify"
    lossless = True
    closes = "padding of verify batches to the longest request"

    def apply(self, program: Program) -> PassResult:
        return set_schedule(program, self.name, trees=True, two_level=True, ragged=True)

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return batched_space(cls, program, [cls()])
