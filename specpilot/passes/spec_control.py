"""`spec-control{off-below=0.1}`: per-request speculation control in the batched engine.

Changes the step graph's `schedule` node: spec_control=true, spec_off_below (and policy
"continuous"). The engine then keeps each request's running per-position acceptance: its draft
length follows it (no deeper than where the expected survival falls below 2%), a request whose
acceptance drops under `off_below` stops drafting (probed again every few steps), and the whole
batch runs AR steps when, under the step-cost table, no verify budget beats AR at the current
load (runtime/batch_control.SpecControl). Overlapping the next step's drafting with the current
verification is not done.

Lossless: it chooses only whether and how far a request drafts; every committed token is still the
target's argmax over that request's committed prefix. Chain verification of attention and hybrid
targets, ungraphed (as verify-budget).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program
from .base import Pass, PassResult, register
from .verify_budget import batched_space, set_schedule

OFF_BELOW = (0.05, 0.1, 0.2, 0.3)


@register
@dataclass(frozen=True)
class SpecControl(Pass):
    name = "spec-control"
    lossless = True
    closes = "speculation that does not pay at the current load"
    off_below: float = 0.1

    def __post_init__(self):
        if not 0.0 <= self.off_below < 1.0:
            raise ValueError(f"off-below must be in [0, 1): a per-position acceptance rate, got {self.off_below}")

    def apply(self, program: Program) -> PassResult:
        return set_schedule(program, self.name, spec_control=True, spec_off_below=float(self.off_below))

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return batched_space(cls, program, [cls(off_below=v) for v in OFF_BELOW])
