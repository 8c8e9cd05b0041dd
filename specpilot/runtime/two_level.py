"""Two-level verification: a cheap first level ranks a drafted tree's nodes and keeps the ones worth
verifying; the target (the second level) verifies only those and alone decides acceptance.

    drafted tree (budget M)  --first level-->  scores per node  --prune_tree-->  survivors (N <= M)
                                                                      --target verify (tree loop)-->

The first level sees no more than the drafter and a prefix of the target, and never accepts
anything: a survivor is accepted only when its token is the target's argmax given its ancestors,
as in one-level tree verification, so the output equals AR greedy whatever it keeps (lossless by
construction). It moves only τ and the cost of a step.

First levels (`FIRST_LEVELS`), each a node score where higher is worth more:

  drafter      the drafter's own confidence: the survival product of the per-position
               probabilities along the node's path (the tree's `score`, its log). On a best-first
               tree this keeps exactly the best-first tree of N nodes, so at batch 1 it is the
               one-level tree at the second level's budget; it earns its keep when the budget is
               shared across a batch (`share_budget`), where scores of different requests compete.
  early-exit   the target's first `exit_layer` layers over the whole drafted tree (ancestor mask;
               a hybrid target's Gated DeltaNet layers along each path), its final norm and head
               on their output: log p_early(token_i | ancestors) summed along the path.
  early-exit-drafter  both: the sum of the two path log-probabilities (the early exit's view of
               the target weighted by the drafter's own confidence).

Survivors are closed under ancestors (a path product never grows along a path; ties go to the
shallower node), re-indexed in the tree's order (parents first) and padded to N + 1 nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specpilot.runtime.cache import KVCache
from specpilot.runtime.hybrid import HybridCache, HybridTransformer
from specpilot.runtime.model import Transformer, Visibility, slots_below
from specpilot.runtime.tree import Tree, ancestor_mask

FIRST_LEVELS = ("drafter", "early-exit", "early-exit-drafter")
EXITS = ("early-exit", "early-exit-drafter")  # the first levels that read the target's first layers


def prune_tree(tree: Tree, scores: torch.Tensor, keep: int) -> Tree:
    """The root and the `keep` best-scoring nodes of `tree` (padding, score -inf or hanging from
    nothing, never kept), closed under ancestors, in the tree's order, padded to keep + 1 nodes."""
    if keep < 1:
        raise ValueError(f"a first level keeps >= 1 node, got {keep}")
    score, up, depth = scores.float().tolist(), tree.parent.tolist(), tree.depth.tolist()  # one host read each
    rank = lambda i: (-score[i], depth[i], i)  # noqa: E731
    real = [i for i in range(1, tree.size) if up[i] >= 0 and score[i] != float("-inf")]
    chosen = set(sorted(real, key=rank)[:keep]) | {0}
    for i in list(chosen):  # close under ancestors (path products already are; a guard for other scores)
        while up[i] >= 0:
            i = up[i]
            chosen.add(i)
    while len(chosen) > keep + 1:  # closing added ancestors: drop the worst leaves
        leaves = [i for i in chosen if i and not any(up[j] == i for j in chosen)]
        chosen.discard(max(leaves, key=rank))
    kept = sorted(chosen)
    new_index = {old: new for new, old in enumerate(kept)}
    parent = [new_index[up[i]] if i else -1 for i in kept]
    pick = torch.tensor(kept, dtype=torch.long, device=tree.device)
    pruned = Tree(torch.tensor(parent, dtype=torch.long, device=tree.device), tree.depth[pick], tree.token[pick],
                  scores[pick].float())
    return pruned.padded(keep + 1)


def drafter_scores(tree: Tree) -> torch.Tensor:
    """The drafter's confidence of every node: the log survival product along its path."""
    return tree.score


def early_exit_scores(target: Transformer | HybridTransformer, cache: KVCache | HybridCache, tree: Tree,
                      exit_layer: int) -> torch.Tensor:
    """The target's first `exit_layer` layers over the tree after the cache's prefix, then its final
    norm and head: every node scored by the log-probability of its path under these early logits.

    The layers write their K/V at slots [length, +n) and a hybrid cache's tree data, which the
    second level's verify overwrites; the cache's length and committed state do not move."""
    layers = len(target.model.layers)
    if not 1 <= exit_layer < layers:
        raise ValueError(f"exit_layer must be in 1..{layers - 1} (the target has {layers} layers), got {exit_layer}")
    anc = ancestor_mask(tree)
    n = tree.size
    positions = (cache.length + tree.depth)[None]
    x = target.embed(tree.token[None])
    if isinstance(target, HybridTransformer):
        cache.begin(n)
        vis = Visibility(anc, cache.length, n, x.device)
        cos, sin = target.rope(positions)
        h, _ = target.run_layers(x, cache, cos, sin, vis, exit_layer)
        cache.rollback(cache.length)  # drop the tree data: the committed state never moved
    else:
        vis = Visibility(anc, cache.length, n, x.device, cache.key_slots(n))
        cos, sin = target.rope(positions, slots_below(cache, n))
        h = x
        for i, layer in enumerate(target.model.layers[:exit_layer]):
            h = layer(h, cos, sin, cache, i, vis)
    logp = torch.log_softmax(target.head(target.final_norm(h))[0], dim=-1)  # [n, V]
    local = logp[tree.parent.clamp(min=0), tree.token]  # log p(token_i | parent's path)
    local = torch.where(tree.parent >= 0, local, torch.zeros_like(local))
    score = anc.float() @ local  # summed along each path
    return torch.where((tree.parent >= 0) | (torch.arange(n, device=tree.device) == 0), score,
                       torch.full_like(score, float("-inf")))


Prune = Callable[[Tree, KVCache], Tree]


def first_level(kind: str, keep: int, target: Transformer | HybridTransformer | None = None,
                exit_layer: int = 0) -> Prune:
    """The pruning a tree loop applies to each drafted tree before the target verifies it."""
    if kind == "drafter":
        return lambda tree, cache: prune_tree(tree, drafter_scores(tree), keep)
    if kind in EXITS:
        if target is None:
            raise ValueError(f"the {kind} first level needs the target")
        with_drafter = kind == "early-exit-drafter"

        def prune(tree: Tree, cache: KVCache) -> Tree:
            scores = early_exit_scores(target, cache, tree, exit_layer)
            return prune_tree(tree, scores + drafter_scores(tree) if with_drafter else scores, keep)

        return prune
    raise ValueError(f"first level must be one of {', '.join(FIRST_LEVELS)}, got {kind!r}")


def share_budget(scores: Sequence[torch.Tensor], total: int) -> list[int]:
    """A batch-wide first-level budget: how many nodes each request keeps when `total` verify slots
    go to the best-scoring nodes of all requests together (scores as from a first level; -inf
    never kept). Every request keeps at least its root, which the total does not count."""
    if total < 0:
        raise ValueError(f"a batch's budget must be >= 0, got {total}")
    flat = [(float(s), r) for r, row in enumerate(scores) for s in row.tolist()[1:] if s != float("-inf")]
    flat.sort(key=lambda x: -x[0])
    counts = [0] * len(scores)
    for _, r in flat[:total]:
        counts[r] += 1
    return counts
