"""`two-level-verify{budget=N, draft-budget=M, topk=K, first=drafter|early-exit|early-exit-drafter|early-exit-split,
exit-layer=L}`:
a cheap first level keeps the N nodes of a drafted tree of M worth verifying; the target verifies
only those.

Changes the step graph only, four nodes together: propose -> a best-first tree of `draft_budget`
nodes from the top-`topk` tokens of each draft position; verify -> mode "two-level" with q = N + 1
(the anchor and the survivors), `first` (the first level) and, for the early-exit level,
`exit_layer` (how many of the target's layers it reads); accept -> "tree-path"; commit -> "compact".
The model graphs are untouched.

First levels (runtime/two_level.py): "drafter" ranks nodes by the drafter's survival product along
their paths (on a best-first tree this is the best-first tree of N nodes: at batch 1 the one-level
tree at budget N; the level exists for budgets shared across a batch); "early-exit" runs the target's
first `exit_layer` layers over the drafted tree and ranks by the early-exit head's path probability;
"early-exit-drafter" by the product of both path probabilities; "early-exit-split" splits the drafter's
mass over each parent's drafted children among them by the early exit's logits for their tokens (no
head over the vocabulary). The second level continues the survivors from layer `exit_layer`.

Lossless by construction: the first level only chooses which nodes the target sees; a node is
accepted only when its token is the target's argmax given its ancestors, so the output equals AR
greedy (token forcing checks it). N, M, K, the level and L move τ and the step's cost only.
Runtime: the torch backend's tree loops with the first level's pruning (eager; not graphed yet); in
the batched engine (policy continuous) every level with a batch-wide budget, split across requests by
the level's scores (with verify-budget, the cost table's choice of its total; runtime/batch.py). The
cost model prices the step (cost/two_level.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Node, Program, limits
from .base import Pass, PassResult, register

FIRST = ("drafter", "early-exit", "early-exit-drafter", "early-exit-split")
EXITS = FIRST[1:]  # first levels that read the target's first exit_layer layers
CANDIDATES = ((16, 64), (16, 32), (32, 128), (32, 64))  # (survivors, drafted)


def _layers(program: Program) -> int:
    return len(program.target.find("attention")) + len(program.target.find("gated_deltanet"))


@register
@dataclass(frozen=True)
class TwoLevelVerify(Pass):
    name = "two-level-verify"
    lossless = True
    # no `closes`: the cost model prices it (cost/two_level.py), but searches are not offered it: on every
    # pair measured it verifies fewer accepted tokens a ms than the best one-level tree (docs/experiments/hybrid-trees.md)
    budget: int = 16
    draft_budget: int = 64
    topk: int = 4
    first: str = "early-exit"
    exit_layer: int = 1

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.draft_budget < self.budget:
            raise ValueError(f"draft-budget must be >= budget (the first level keeps budget of draft-budget nodes), "
                             f"got {self.draft_budget} < {self.budget}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.first not in FIRST:
            raise ValueError(f"first must be one of {', '.join(FIRST)}, got {self.first!r}")

    def check(self, program: Program, where: str = "") -> None:
        lim = limits(program)
        most = lim.max_tokens_a_step
        self.out_of_range("draft_budget", 1, None if most is None else most - 1,
                          "the first level's forward holds the anchor and every drafted node"
                          + ("" if most is None else f"; {lim.why_tokens()}"), where)
        self.out_of_range("topk", 1, lim.vocab, "ranks per draft position, at most the vocabulary", where)
        if self.first in EXITS:
            layers = _layers(program)
            self.out_of_range("exit_layer", 1, layers - 1, f"the early exit reads some of the target's {layers} layers",
                              where)

    def _verify(self) -> dict:
        extra = {"exit_layer": self.exit_layer} if self.first in EXITS else {}
        return {"mode": "two-level", "q": self.budget + 1, "first": self.first, **extra}

    def _rewrite(self, _: str, node: Node) -> Node | None:
        if node.op == "propose":
            return node.replace(shape="tree", budget=self.draft_budget, topk=self.topk)
        if node.op == "verify":
            attrs = {k: v for k, v in node.items() if k not in ("first", "exit_layer")}
            return Node.make("verify", **{**attrs, **self._verify()})
        if node.op == "accept":
            return node.replace(rule="tree-path")
        if node.op == "commit":
            return node.replace(kv="compact")
        return None

    def apply(self, program: Program) -> PassResult:
        step, _ = program.step.map_nodes(self._rewrite)
        out = program.with_graph("step", step)
        if out == program:
            return PassResult(program, False, "two-level verify already set")
        level = self.first + (f" (first {self.exit_layer} layers)" if self.first in EXITS else "")
        return PassResult(out, True, f"draft a tree of {self.draft_budget}, keep {self.budget} by {level}, verify those")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        layers = _layers(program)
        exits = sorted({max(1, layers // 4), max(1, layers // 2)} - {layers}) if layers > 1 else []
        candidates = [cls(budget=n, draft_budget=m, first="drafter") for n, m in CANDIDATES]
        candidates += [cls(budget=n, draft_budget=m, first=f, exit_layer=e) for n, m in CANDIDATES
                       for e in exits for f in EXITS]
        return [c for c in candidates if c.apply(program).changed]
