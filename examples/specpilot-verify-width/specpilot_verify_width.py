"""`verify-width{q=N}`: the target checks exactly N tokens a step, whatever the proposal's shape.

Changes the step graph only, and keeps its three nodes agreeing: for a chain, the draft block
(DFlash: N, the anchor and N-1 drafts; PARD: N-1 drafts) and the proposal's budget (N-1); for a
tree, the tree's budget (N-1 nodes besides the anchor); and the verify node's q = N. One knob for
the quantity the GPU prices (a verify of N rows costs about one AR step up to the width where the
matmuls turn compute-bound), whether an earlier pass chose a chain or a tree.

Lossless: greedy acceptance keeps the output equal to AR greedy whatever the width; the width moves
only τ and the verify's cost. Token forcing checks every output token of every compile.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpilot.ir import Program, limits
from specpilot.passes import Pass, PassResult, register

WIDTHS = (2, 4, 8, 12, 16, 24, 32)  # what a search tries (schedule_space)


@register
@dataclass(frozen=True)
class VerifyWidth(Pass):
    name = "verify-width"
    lossless = True
    closes = "verify width off the optimum"  # offered to searches as what-ifs the cost model prices
    q: int = 16

    def __post_init__(self):
        if self.q < 2:
            raise ValueError(f"q must be >= 2 (the anchor and at least one candidate), got {self.q}")

    def check(self, program: Program, where: str = "") -> None:
        lim = limits(program)
        self.out_of_range("q", 2, lim.max_tokens_a_step,
                          "tokens the target checks a step" + ("" if lim.positions is None else f"; {lim.why_tokens()}"),
                          where)

    def apply(self, program: Program) -> PassResult:
        step = program.step
        (draft_name, draft), (propose_name, propose), (verify_name, verify) = (
            step.one("draft"), step.one("propose"), step.one("verify"))
        if verify["q"] == self.q:
            return PassResult(program, False, f"already verifies {self.q} tokens")
        if propose["shape"] == "chain":
            block = self.q if draft["kind"] == "dflash" else self.q - 1
            step = step.with_node(draft_name, draft.replace(block_size=block))
        step = step.with_node(propose_name, propose.replace(budget=self.q - 1))
        step = step.with_node(verify_name, verify.replace(q=self.q))
        return PassResult(program.with_graph("step", step), True,
                          f"verify {verify['q']} -> {self.q} tokens ({propose['shape']})")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        q = program.step.one("verify")[1]["q"]
        return [cls(q=w) for w in WIDTHS if w != q]
