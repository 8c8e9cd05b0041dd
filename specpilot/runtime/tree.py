"""Candidate trees for tree verification: building, the ancestor mask, acceptance, KV compaction.

A parallel drafter gives, for each draft position d = 1..D after the anchor, a distribution over
the next token; its top-k at every position hold many more good candidates than the top-1 chain.
A `Tree` arranges candidates so the target can check them all in one forward:

    node 0        the anchor: the last committed token (depth 0, parent -1);
    node i > 0    a candidate token at depth d >= 1 whose parent (depth d-1) precedes it.

Siblings carry distinct tokens, so at most one root path can match the target.

Building (`best_first_tree`, the DDTree/Sequoia-style expansion): a node at depth d that takes
the rank-r token of position d has score = its parent's score + log p_d(rank r), i.e. the log of
the product of the per-position probabilities along its path (positions taken as independent,
which is what one non-causal draft pass gives). The tree of a budget of N nodes holds the N
highest-scoring paths of the top-k lattice (every path of depth <= D whose every step takes one
of the top-k tokens of its position). Because a child never scores above its parent and a
lower rank never above a higher one, a lazy best-first search finds them: pop the best frontier
node, add it, then push its first child (rank 0 at the next depth) and its next sibling (rank
r+1 under the same parent). Nodes come out in non-increasing score order, so parents precede
children. Ties go to the node pushed first. Fixed shapes to compare against: `chain_tree`
(top-1 at every depth) and `kary_tree` (breadth-first, every node gets the top-k children of the
next position, until the budget is spent).

Verification (tree_decode.verify_tree) runs the tree's tokens at positions prefix + depth under
`ancestor_mask` (a node sees the cached prefix, its ancestors and itself). `accept_tree` keeps
the longest root path whose every token equals the target's argmax at its parent; the target's
argmax at the path's last node is the bonus. `compact_kv` moves the path's K/V into contiguous
slots so the cache holds exactly the accepted tokens.

Static shapes: `Tree.padded(n)` appends nodes that can never be accepted (parent -1, depth 0,
score -inf), so a verify forward always sees budget + 1 nodes (what the IR's verify q says).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specpilot.runtime.cache import KVCache


@dataclass(frozen=True)
class Tree:
    """Candidate tree as [n] tensors on one device; node 0 is the anchor."""

    parent: torch.Tensor  # int64; -1 for the root and for padding
    depth: torch.Tensor  # int64; 0 for the root and for padding
    token: torch.Tensor  # int64
    score: torch.Tensor  # float32; log-probability of the path (root 0, padding -inf)

    @property
    def size(self) -> int:
        return self.parent.shape[0]

    @property
    def device(self) -> torch.device:
        return self.parent.device

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.size else 0

    def to(self, device: torch.device | str) -> Tree:
        return Tree(*(t.to(device) for t in (self.parent, self.depth, self.token, self.score)))

    def padded(self, n: int) -> Tree:
        """The tree with n nodes: the extra ones hang from nothing, so they are never accepted."""
        extra = n - self.size
        if extra < 0:
            raise ValueError(f"cannot pad a tree of {self.size} nodes to {n}")
        if extra == 0:
            return self

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.cat([t, t.new_full((extra,), value)])

        return Tree(pad(self.parent, -1), pad(self.depth, 0), pad(self.token, int(self.token[0])),
                    pad(self.score, float("-inf")))

    @staticmethod
    def from_lists(parent: Sequence[int], depth: Sequence[int], token: Sequence[int],
                   score: Sequence[float] | None = None, device: torch.device | str = "cpu") -> Tree:
        score = [0.0] * len(parent) if score is None else score
        ints = [torch.tensor(list(xs), dtype=torch.long, device=device) for xs in (parent, depth, token)]
        return Tree(*ints, torch.tensor(list(score), dtype=torch.float32, device=device))


def draft_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [D, V] -> (log-probabilities [D, k] in descending order, token ids [D, k])."""
    k = min(topk, logits.shape[-1])
    return torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)


def _tree(anchor: int, nodes: list[tuple[int, int, int, float]], device: torch.device | str) -> Tree:
    """The root (the anchor) followed by `nodes`, each (parent, depth, token, score)."""
    parent, depth, token, score = zip((-1, 0, anchor, 0.0), *nodes)
    return Tree.from_lists(parent, depth, token, score, device)


def best_first_tree(logp: torch.Tensor, ids: torch.Tensor, anchor: int, *, budget: int) -> Tree:
    """The `budget` highest-scoring paths of the top-k lattice (module docstring), plus the root.

    logp, ids: [D, k] from `draft_topk` (each row in descending order). Fewer than `budget` nodes
    only when the lattice is smaller (sum of k^d for d = 1..D).
    """
    _check_budget(budget)
    lp, tok = logp.tolist(), ids.tolist()
    positions, k = len(lp), len(lp[0]) if lp else 0
    nodes: list[tuple[int, int, int, float]] = []
    # frontier entries: (-score, push order, parent node, depth, rank)
    frontier: list[tuple[float, int, int, int, int]] = []
    pushed = 0

    def push(parent: int, parent_score: float, depth: int, rank: int) -> None:
        nonlocal pushed
        if depth <= positions and rank < k:
            heapq.heappush(frontier, (-(parent_score + lp[depth - 1][rank]), pushed, parent, depth, rank))
            pushed += 1

    push(0, 0.0, 1, 0)
    while frontier and len(nodes) < budget:
        neg, _, parent, depth, rank = heapq.heappop(frontier)
        nodes.append((parent, depth, tok[depth - 1][rank], -neg))
        index = len(nodes)
        parent_score = nodes[parent - 1][3] if parent else 0.0
        push(parent, parent_score, depth, rank + 1)  # next sibling
        push(index, -neg, depth + 1, 0)  # first child
    return _tree(anchor, nodes, logp.device)


def best_first_size(budget: int, positions: int, topk: int) -> int:
    """Nodes (the root excluded) `best_first_tree` gives over `positions` rows of top-`topk`: the
    budget, or the whole lattice (sum of topk^d for d = 1..positions) when that is smaller."""
    return min(budget, sum(topk ** d for d in range(1, positions + 1)))


def chain_tree(logp: torch.Tensor, ids: torch.Tensor, anchor: int, *, budget: int) -> Tree:
    """The top-1 chain, min(budget, D) nodes deep: what chain verification checks."""
    _check_budget(budget)
    lp, tok = logp[:, 0].tolist(), ids[:, 0].tolist()
    nodes, score = [], 0.0
    for d in range(min(budget, len(lp))):
        score += lp[d]
        nodes.append((d, d + 1, tok[d], score))
    return _tree(anchor, nodes, logp.device)


def kary_tree(logp: torch.Tensor, ids: torch.Tensor, anchor: int, *, budget: int) -> Tree:
    """Breadth-first: each node gets the top-k tokens of the next position as children, until
    `budget` nodes (a full k-ary tree when the budget is sum of k^d)."""
    _check_budget(budget)
    lp, tok = logp.tolist(), ids.tolist()
    nodes: list[tuple[int, int, int, float]] = []
    level = [(0, 0.0)]  # (node index, score) at the current depth
    for d in range(len(lp)):
        nxt = []
        for parent, parent_score in level:
            for r in range(len(lp[d])):
                if len(nodes) == budget:
                    return _tree(anchor, nodes, logp.device)
                nodes.append((parent, d + 1, tok[d][r], parent_score + lp[d][r]))
                nxt.append((len(nodes), nodes[-1][3]))
        level = nxt
    return _tree(anchor, nodes, logp.device)


TreeBuilder = Callable[..., Tree]
TREE_SHAPES: dict[str, TreeBuilder] = {"best-first": best_first_tree, "chain": chain_tree, "k-ary": kary_tree}


def _check_budget(budget: int) -> None:
    if budget < 1:
        raise ValueError(f"a tree budget must be >= 1 node, got {budget}")


def ancestor_mask(tree: Tree) -> torch.Tensor:
    """Bool [n, n]: mask[i, j] is True when node j is node i or one of its ancestors.

    One gather per depth level (max_depth of them), no host loop over nodes."""
    n = tree.size
    rows = torch.arange(n, device=tree.device)
    mask = torch.zeros(n, n, dtype=torch.bool, device=tree.device)
    mask[rows, rows] = True
    cur = tree.parent.clone()
    for _ in range(tree.max_depth):
        live = cur >= 0
        mask[rows[live], cur[live]] = True
        cur = torch.where(live, tree.parent[cur.clamp(min=0)], cur)
    return mask


def accept_tree(tree: Tree, target_argmax: torch.Tensor | Sequence[int],
                ancestors: torch.Tensor | None = None) -> tuple[list[int], int]:
    """(accepted path as node indices from the root, bonus token).

    A node is accepted when its token equals the target's argmax at its parent and its parent is
    accepted (the root always is). Siblings differ, so the accepted nodes form one root path; the
    deepest one ends it and the target's argmax there is the bonus. Vectorised over nodes (no walk),
    so it runs where the tensors are; `ancestors` is `ancestor_mask(tree)` if already built.
    """
    argmax = torch.as_tensor(target_argmax, dtype=torch.long, device=tree.device)
    anc = ancestor_mask(tree) if ancestors is None else ancestors
    has_parent = tree.parent >= 0
    ok = has_parent & (tree.token == argmax[tree.parent.clamp(min=0)])
    ok[0] = True
    accepted = ~(anc & ~ok[None, :]).any(dim=1)  # every node on the way from the root matches
    deepest = torch.where(accepted, tree.depth, -1).argmax()
    path_mask = anc[deepest]
    path = torch.nonzero(path_mask).flatten()
    path = path[tree.depth[path].argsort()]
    path_list = path.tolist()
    return path_list, int(argmax[path_list[-1]])


def compact_kv(cache: KVCache, start: int, path_slots: torch.Tensor | Sequence[int]) -> None:
    """Move the K/V at `path_slots` (absolute slots, ascending, each >= its destination) to slots
    [start, start + len) in every layer, and set the cache length to start + len."""
    src = torch.as_tensor(path_slots, dtype=torch.long, device=cache.k[0].device if cache.k else "cpu")
    n = src.shape[0]
    if start + n > cache.max_len:
        raise ValueError(f"KV cache overflow: compacting to slot {start + n}, capacity is {cache.max_len}")
    if bool((src != torch.arange(start, start + n, device=src.device)).any()):
        for k, v in zip(cache.k, cache.v):
            k[:, :, start : start + n] = k[:, :, src]  # the gather copies first: overlapping moves are safe
            v[:, :, start : start + n] = v[:, :, src]
    cache.length = start + n


def best_first_tree_padded(logp: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, budget: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`best_first_tree` (a heap on the host) as a graphed loop's tree builder takes it: the anchor
    a 1-element tensor, the tree padded to budget + 1 nodes, returned as (parent, depth, token,
    score) on logp's device; a batch (logp, ids [B, D, K], anchor [B]) gives [B, budget + 1] each.
    A backend may install a device builder of the same signature."""
    if logp.dim() == 3:
        trees = [best_first_tree_padded(lp, i, a, budget) for lp, i, a in zip(logp, ids, anchor.reshape(-1))]
        return tuple(torch.stack(parts) for parts in zip(*trees))
    tree = best_first_tree(logp.float().cpu(), ids.long().cpu(), int(anchor.reshape(-1)[0]), budget=budget)
    tree = tree.padded(budget + 1).to(logp.device)
    return tree.parent, tree.depth, tree.token, tree.score
