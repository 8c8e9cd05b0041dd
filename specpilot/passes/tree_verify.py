"""`tree-verify{budget=N, topk=K}`: verify a best-first tree of candidates instead of the chain.

Changes the step graph only, four nodes together: propose -> shape "tree" with `budget` nodes
built from the top-`topk` tokens of each draft position; verify -> mode "tree" (a "two-level"
verify stays two-level) with q = budget + 1 (the anchor and every node); accept -> rule
"tree-path"; commit -> kv "compact". The draft node is untouched: the drafter still proposes one
block (its positions bound the tree's depth). The model graphs are untouched too: the target's
attention runs under the ancestor mask only in verify, which the verify node already says.

Lossless: a node is accepted only when its token is the target's argmax given its ancestors at
their sequence positions, so the output equals AR greedy; budget and top-k move only τ and the
verify cost. Runtime: specpilot.runtime.tree_decode (torch backend, CPU and GPU). Hybrid targets
(Gated DeltaNet layers) verify trees too: their recurrence runs along each node's ancestor chain and
commits the accepted path's state only (runtime/hybrid_tree.py); graphed steps stay attention-only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Node, Program, limits
from .base import Pass, PassResult, register

CANDIDATE_BUDGETS = (15, 16, 31, 32, 64, 128)  # 31: q = 32, the most rows the fused stacks serve (cost/roofline.py linear_serves)
CANDIDATE_TOPK = (2, 4, 8)


@register
@dataclass(frozen=True)
class TreeVerify(Pass):
    name = "tree-verify"
    lossless = True
    closes = "τ below what the candidates allow"
    budget: int = 64
    topk: int = 4

    def __post_init__(self):
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")

    def check(self, program: Program, where: str = "") -> None:
        lim = limits(program)
        most = lim.max_tokens_a_step
        self.out_of_range("budget", 1, None if most is None else most - 1,
                          "the verify holds the anchor and every node" + ("" if most is None else f"; {lim.why_tokens()}"),
                          where)
        self.out_of_range("topk", 1, lim.vocab, "ranks per draft position, at most the vocabulary", where)

    def _rewrite(self, _: str, node: Node) -> Node | None:
        if node.op == "propose":
            return node.replace(shape="tree", budget=self.budget, topk=self.topk)
        if node.op == "verify":
            return node.replace(mode=node["mode"] if node["mode"] != "chain" else "tree", q=self.budget + 1)
        if node.op == "accept":  # where acceptance runs (host, or device under cuda-graphs) stays
            return node.replace(rule="tree-path")
        if node.op == "commit":
            return node.replace(kv="compact")
        return None

    def apply(self, program: Program) -> PassResult:
        propose = program.step.one("propose")[1]
        step, n = program.step.map_nodes(self._rewrite)
        if n == 0:
            return PassResult(program, False, "tree already set")
        was = " ".join(f"{k}={v}" for k, v in propose.items())
        return PassResult(program.with_graph("step", step), True,
                          f"propose {was} -> tree budget={self.budget} topk={self.topk}")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        candidates = [cls(budget=b, topk=k) for b in CANDIDATE_BUDGETS for k in CANDIDATE_TOPK]
        return [c for c in candidates if c.apply(program).changed]
