"""`draft-block-size{size=N}`: how many tokens the drafter proposes per step.

Changes the step graph only: the draft node's block size, the chain proposal's budget and the
verify length that follows from them. Lossless: greedy acceptance keeps the output equal to AR
greedy whatever the block; the block moves only τ and the verify cost.
For DFlash, `size` counts the anchor token (size-1 drafts); for PARD it is k (k drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program, limits
from ..ir.verify import expected_verify_length
from .base import Pass, PassResult, register

# every block up to 16 (released DFlash drafters are trained at 16; τ moves most below it), then 24 and 32
CANDIDATE_SIZES = (*range(1, 17), 24, 32)


@register
@dataclass(frozen=True)
class DraftBlockSize(Pass):
    name = "draft-block-size"
    lossless = True
    closes = "block size off the optimum"
    size: int = 16

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")

    def check(self, program: Program, where: str = "") -> None:
        dflash = program.step.one("draft")[1]["kind"] == "dflash"
        lim = limits(program)
        most = lim.max_tokens_a_step  # a DFlash verify holds the block; a PARD one the k drafts and the last token
        hi = None if most is None else most - (0 if dflash else 1)
        why = "a DFlash block is the anchor and at least one draft" if dflash else "PARD drafts k >= 1 tokens"
        self.out_of_range("size", 2 if dflash else 1, hi, why + ("" if most is None else f"; {lim.why_tokens()}"), where)

    def apply(self, program: Program) -> PassResult:
        step = program.step
        draft_name, draft = step.one("draft")
        if draft["block_size"] == self.size:
            return PassResult(program, False, "block size already set")
        propose_name, propose = step.one("propose")
        verify_name, verify = step.one("verify")
        new_draft = draft.replace(block_size=self.size)
        g = step.with_node(draft_name, new_draft)
        if propose["shape"] == "chain":
            budget = self.size - 1 if draft["kind"] == "dflash" else self.size
            new_propose = propose.replace(budget=budget)
            g = g.with_node(propose_name, new_propose)
            g = g.with_node(verify_name, verify.replace(q=expected_verify_length(new_draft, new_propose)))
        summary = f"block size {draft['block_size']} -> {self.size}"
        return PassResult(program.with_graph("step", g), True, summary)

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        draft = program.step.one("draft")[1]
        low = 2 if draft["kind"] == "dflash" else 1
        return [cls(size=s) for s in CANDIDATE_SIZES if s >= low and s != draft["block_size"]]
