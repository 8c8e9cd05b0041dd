"""`verify-budget`: capacity-aware verification in the batched engine.

Changes the step graph's `schedule` node: verify_budget=true (and policy "continuous", the batched
engine). The engine then picks, each step, the batch-wide number of drafted tokens to verify that
maximizes expected committed tokens per millisecond under the step-cost table profiled at compile
time (tokens in the verify forward -> ms: verification turns compute-bound as tokens grow), and
splits it across requests by per-position survival from the drafter's confidences
(runtime/batch_control.choose_verify_budget, which two-level verification shares).

Lossless: it chooses only how many of each request's drafts are verified; every committed token is
still the target's argmax over that request's committed prefix. Chain verification, ungraphed, of
attention targets and of hybrid (Gated DeltaNet) ones (what the batched engine runs; the verifier says so otherwise); after
`two-level-verify` the same choice is the batch-wide budget of the first level over every request's
drafted tree, which the first level splits across requests by its scores
(runtime/batch.BatchEngine.keep_batch_wide).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program
from .base import Pass, PassResult, register


def batching_refusal(program: Program, trees: bool = False, two_level: bool = False) -> str:
    """Why the batched engine cannot run this program under a mechanism ("" when it can): the
    mechanisms' shared check. `trees`: the mechanism serves tree verification too; `two_level`: a
    two-level verify (its first level's batch-wide budget is verify-budget's choice over the drafted
    trees' nodes)."""
    verify = program.step.one("verify")[1]
    batch_wide = two_level and verify["mode"] == "two-level"
    if verify["mode"] not in (("chain", "tree") if trees else ("chain",)) and not batch_wide:
        return ("it chooses chain lengths: the batched engine verifies chains here, or two-level trees "
                "(leave out tree-verify)")
    if program.target.find("gated_deltanet") and batch_wide and verify.get("first", "drafter") != "drafter":
        return ("the batched engine's early-exit first levels serve attention targets; this target has Gated "
                "DeltaNet layers (first=drafter, or leave out the batching passes)")
    if program.step.one("schedule")[1].get("graphs"):
        return "the batched engine runs ungraphed steps (leave out cuda-graphs)"
    return ""


def batched_space(cls: type[Pass], program: Program, instances: list[Pass]) -> list[Pass]:
    """A batching mechanism's schedule space: its instances that change `program`, none for a
    deployment served at batch 1 (it runs the batch-1 loops, where nothing these passes set is
    used: a search would measure the same engine again)."""
    if program.step.one("schedule")[1]["batch"] <= 1:
        return []
    return [p for p in instances if p.apply(program).changed]


def set_schedule(program: Program, pass_name: str, trees: bool = False, two_level: bool = False,
                 **attrs) -> PassResult:
    """The schedule node with `attrs` and policy "continuous", or unchanged with the reason."""
    why = batching_refusal(program, trees, two_level)
    if why:
        return PassResult(program, False, f"{pass_name}: {why}")
    name, node = program.step.one("schedule")
    want = {"policy": "continuous", **attrs}
    if all(node.get(k) == v for k, v in want.items()):
        return PassResult(program, False, f"{pass_name}: already set")
    step = program.step.with_node(name, node.replace(**want))
    return PassResult(program.with_graph("step", step), True,
                      ", ".join(f"schedule {k}={v}" for k, v in want.items()))


@register
@dataclass(frozen=True)
class VerifyBudget(Pass):
    name = "verify-budget"
    lossless = True
    closes = "verification past the GPU's capacity at batch"

    def apply(self, program: Program) -> PassResult:
        return set_schedule(program, self.name, two_level=True, verify_budget=True)

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        return batched_space(cls, program, [cls()])
