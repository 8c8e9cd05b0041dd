"""Two-level verification: a cheap first level ranks a drafted tree's nodes and keeps the ones worth
verifying; the target (the second level) verifies only those and alone decides acceptance.

    drafted tree (budget M)  --first level-->  scores per node  --survivors-->  tree of N (<= M)
                                                                      --target verify (tree loop)-->

The first level sees no more than the drafter and a prefix of the target, and never accepts
anything: a survivor is accepted only when its token is the target's argmax given its ancestors,
as in one-level tree verification, so the output equals AR greedy whatever it keeps (lossless by
construction). It moves only τ and the cost of a step.

First levels (`FIRST_LEVELS`), each a node score where higher is worth more:

  drafter      the drafter's own confidence: the survival product of the per-position
               probabilities along the node's path (the tree's `score`, its log). On a best-first
               tree this keeps exactly the best-first tree of N nodes, so at batch 1 it is the
               one-level tree at the second level's budget (a larger drafted tree adds nothing: the
               one-level tree is already built best-first from these confidences); it earns its
               keep when the budget is shared across a batch (`share_budget`), where scores of
               different requests compete.
  early-exit   the target's first `exit_layer` layers over the whole drafted tree (ancestor mask;
               a hybrid target's Gated DeltaNet layers along each path), its final norm and head
               on their output: log p_early(token_i | ancestors) summed along the path. The head
               runs over the nodes that have children only (a leaf's own distribution scores
               nothing).
  early-exit-drafter  both: the sum of the two path log-probabilities (the early exit's view of
               the target weighted by the drafter's own confidence).
  early-exit-split  the drafter's probability mass over a parent's drafted children, split among
               them by the early exit's logits for those children's tokens only (a softmax over the
               siblings): no head over the vocabulary, one dot product a node. A lone child keeps
               the drafter's probability.

Survivors are closed under ancestors (a path product never grows along a path; ties go to the
shallower node), re-indexed in the tree's order (parents first) and padded to N + 1 nodes.

At batch > 1 (runtime/batch.BatchEngine) the same levels score every request's drafted tree in one
packed forward (the trees side by side as a `forest`, one head), the batch keeps its best nodes
(`share_budget`) and the second level continues them from the exit layer as `continue_tree` does.

Layer reuse (`FirstLevel(reuse=True)`, the default): the second level continues the survivors from
layer L instead of recomputing layers 0..L-1. The first level left, per drafted node, its layer
outputs and its K/V of layers < L (a hybrid's Gated DeltaNet layers: its key, update row, decay sum
and conv inputs, pending in the cache); the survivors' rows of these are gathered into the
survivors' order (`continue_tree`) and layers L.. run over the survivors alone under their own
ancestor mask. This is the recompute's value because the survivors are ancestor-closed and a node
of layers < L sees only its ancestors and itself, which are survivors; a padding node (token and
position of the root, seeing only itself) computes exactly as the root, so it takes the root's
rows. The extra cost of the first level is then its head and layers < L over the pruned nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specpilot.runtime.cache import KVCache
from specpilot.runtime.hybrid import HybridCache, HybridTransformer
from specpilot.runtime.model import Transformer, Visibility, slots_below
from specpilot.runtime.tree import Tree, ancestor_mask
from specpilot.runtime.tree_decode import VerifyOut, verify_tree_logits

FIRST_LEVELS = ("drafter", "early-exit", "early-exit-drafter", "early-exit-split")
EXITS = FIRST_LEVELS[1:]  # the first levels that read the target's first layers


def survivors(tree: Tree, scores: torch.Tensor, keep: int) -> list[int]:
    """Node indices of the root and the `keep` best-scoring nodes of `tree` (padding, score -inf or
    hanging from nothing, never kept), closed under ancestors, ascending (the tree's order)."""
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
    return sorted(chosen)


def subtree(tree: Tree, kept: Sequence[int], scores: torch.Tensor) -> Tree:
    """The nodes `kept` of `tree` (ancestor-closed, ascending) as a tree of their own, scored by `scores`."""
    new_index = {old: new for new, old in enumerate(kept)}
    up = tree.parent.tolist()
    parent = [new_index[up[i]] if i else -1 for i in kept]
    pick = torch.tensor(list(kept), dtype=torch.long, device=tree.device)
    return Tree(torch.tensor(parent, dtype=torch.long, device=tree.device), tree.depth[pick], tree.token[pick],
                scores[pick].float())


def prune_tree(tree: Tree, scores: torch.Tensor, keep: int) -> Tree:
    """The root and the `keep` best-scoring nodes of `tree` (`survivors`) as a tree in the tree's
    order, padded to keep + 1 nodes."""
    return subtree(tree, survivors(tree, scores, keep), scores).padded(keep + 1)


def drafter_scores(tree: Tree) -> torch.Tensor:
    """The drafter's confidence of every node: the log survival product along its path."""
    return tree.score


@dataclass(frozen=True)
class ExitForward:
    """The target's first layers over a drafted tree that began at cache length `start`: the
    outputs [1, n, hidden] of layers 0..L-1 (the last is what the second level continues from)."""

    start: int
    layers: tuple[torch.Tensor, ...]


def exit_forward(target: Transformer | HybridTransformer, cache: KVCache | HybridCache, tree: Tree,
                 exit_layer: int) -> ExitForward:
    """Layers 0..exit_layer-1 over the tree after the cache's prefix, under its ancestor mask. Their
    K/V land at slots [length, +n) (a hybrid's Gated DeltaNet layers leave their tree data pending
    in the cache); the cache's length and committed state do not move."""
    layers = len(target.model.layers)
    if not 1 <= exit_layer < layers:
        raise ValueError(f"exit_layer must be in 1..{layers - 1} (the target has {layers} layers), got {exit_layer}")
    anc = ancestor_mask(tree)
    n = tree.size
    positions = (cache.length + tree.depth)[None]
    x = target.embed(tree.token[None])
    if isinstance(target, HybridTransformer):
        cache.begin(n)
        vis = Visibility(anc, cache.length, n, x.device, cache.key_slots(n))
        cos, sin = target.rope(positions)
        _, picked = target.run_layers(x, cache, cos, sin, vis, exit_layer, tuple(range(exit_layer)))
        return ExitForward(cache.length, tuple(picked[i] for i in range(exit_layer)))
    vis = Visibility(anc, cache.length, n, x.device, cache.key_slots(n))
    cos, sin = target.rope(positions, slots_below(cache, n))
    outs, h = [], x
    for i, layer in enumerate(target.model.layers[:exit_layer]):
        h = layer(h, cos, sin, cache, i, vis)
        outs.append(h)
    return ExitForward(cache.length, tuple(outs))


def forest(trees: Sequence[Tree]) -> tuple[Tree, torch.Tensor]:
    """Trees side by side as one (each tree's parent indices shifted by where it starts; its root keeps
    parent -1) and the bool [n] mask of their roots: a batch's first-level scores in one go (a
    path never leaves its tree, so each node scores as in its own tree)."""
    offsets, n = [], 0
    for t in trees:
        offsets.append(n)
        n += t.size
    parent = torch.cat([torch.where(t.parent >= 0, t.parent + o, t.parent) for t, o in zip(trees, offsets)])
    both = Tree(parent, *(torch.cat([getattr(t, f) for t in trees]) for f in ("depth", "token", "score")))
    roots = torch.zeros(n, dtype=torch.bool, device=both.device)
    roots[offsets] = True
    return both, roots


def root_mask(tree: Tree, roots: torch.Tensor | None) -> torch.Tensor:
    if roots is not None:
        return roots
    return torch.arange(tree.size, device=tree.device) == 0


def exit_scores(target: Transformer | HybridTransformer, tree: Tree, hidden: torch.Tensor,
                roots: torch.Tensor | None = None) -> torch.Tensor:
    """Every node's path log-probability under the target's final norm and head applied to `hidden`
    [1, n, H] (an early layer's output): log p(token_i | parent's path) summed along the path. The
    head runs over the rows of nodes with children only; padding nodes score -inf. `roots`: the
    roots of a `forest` (default: node 0)."""
    n = tree.size
    has_parent = tree.parent >= 0
    parents = torch.unique(tree.parent[has_parent])  # sorted; empty for a lone root
    score = torch.zeros(n, dtype=torch.float32, device=tree.device)
    if parents.numel():
        logits = target.head(target.final_norm(hidden[0, parents]))  # [P, V]
        row = torch.zeros(n, dtype=torch.long, device=tree.device)
        row[parents] = torch.arange(parents.numel(), device=tree.device)
        r = row[tree.parent.clamp(min=0)]
        local = logits[r, tree.token] - torch.logsumexp(logits, dim=-1)[r]
        local = torch.where(has_parent, local, torch.zeros_like(local))
        score = ancestor_mask(tree).float() @ local  # summed along each path
    return torch.where(has_parent | root_mask(tree, roots), score, torch.full_like(score, float("-inf")))


def by_parent_logsumexp(values: torch.Tensor, parent: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[n]: at each node the logsumexp of `values` over its children (`real` nodes only; -inf where none)."""
    n = values.shape[0]
    idx, v = parent[real], values[real]
    top = torch.full((n,), float("-inf"), device=values.device).scatter_reduce(0, idx, v, "amax")
    total = torch.zeros(n, device=values.device).index_add_(0, idx, (v - top[idx]).exp())
    return top + total.log()


def split_scores(target: Transformer | HybridTransformer, tree: Tree, hidden: torch.Tensor,
                 roots: torch.Tensor | None = None) -> torch.Tensor:
    """Every node's path score where each step's probability is the drafter's mass over the parent's
    drafted children times the early exit's softmax over those children's tokens (logits from the
    head rows of the children's tokens only, on the parent's normalised `hidden` row [1, n, H]).
    `roots`: the roots of a `forest` (default: node 0)."""
    real = (tree.parent >= 0) & torch.isfinite(tree.score)
    par = tree.parent.clamp(min=0)
    h = target.final_norm(hidden[0])  # [n, H]
    weight = getattr(target.lm_head, "weight", None)
    if weight is not None:  # one head row a node: its token's
        z = (h[par].float() * weight[tree.token].float()).sum(-1)
    else:  # a head without a plain weight (a packed format): the parents' full rows
        z = target.head(h)[par, tree.token]
    local_draft = torch.where(real, tree.score - tree.score[par], torch.zeros_like(tree.score))
    mass = by_parent_logsumexp(local_draft, par, real)  # log of the drafter's mass over each parent's children
    local = torch.where(real, mass[par] + z - by_parent_logsumexp(z, par, real)[par], torch.zeros_like(z))
    score = ancestor_mask(tree).float() @ local
    return torch.where(real | root_mask(tree, roots), score, torch.full_like(score, float("-inf")))


def level_scores(kind: str, target: Transformer | HybridTransformer | None, tree: Tree,
                 hidden: torch.Tensor | None = None, roots: torch.Tensor | None = None) -> torch.Tensor:
    """The first level `kind`'s score of every node of `tree` (or of a `forest`, with its `roots`);
    `hidden` [1, n, H]: the early exit's layer output over the tree (unused by the drafter level)."""
    if kind == "drafter":
        return drafter_scores(tree)
    if kind == "early-exit-split":
        return split_scores(target, tree, hidden, roots)
    scores = exit_scores(target, tree, hidden, roots)
    return scores + drafter_scores(tree) if kind == "early-exit-drafter" else scores



def early_exit_scores(target: Transformer | HybridTransformer, cache: KVCache | HybridCache, tree: Tree,
                      exit_layer: int) -> torch.Tensor:
    """The target's first `exit_layer` layers over the tree after the cache's prefix, then its final
    norm and head: every node scored by the log-probability of its path under these early logits.

    The layers write their K/V at slots [length, +n), which the next forward overwrites; a hybrid
    cache's tree data is dropped; the cache's length and committed state do not move."""
    fwd = exit_forward(target, cache, tree, exit_layer)
    if isinstance(cache, HybridCache):
        cache.rollback(cache.length)  # drop the tree data: the committed state never moved
    return exit_scores(target, tree, fwd.layers[-1])


def continue_tree(target: Transformer | HybridTransformer, cache: KVCache | HybridCache, tree: Tree,
                  fwd: ExitForward, src: torch.Tensor, hidden_layers: tuple[int, ...] = ()) -> VerifyOut:
    """The second level over the survivors `tree` (node j is node src[j] of the tree `fwd` ran over),
    continued from layer L = len(fwd.layers): the survivors' layer-L outputs and their K/V (a hybrid's
    pending tree data) of layers < L are gathered into slots [start, +n), then layers L.. run over
    them alone. Returns what `verify_tree_logits` returns and advances the cache by n, as it does."""
    start, n, depth = fwd.start, tree.size, len(fwd.layers)
    if cache.length != start:
        raise ValueError(f"the second level continues the first level's forward from length {start}, "
                         f"the cache is at {cache.length}")
    src = src.to(tree.device)
    anc = ancestor_mask(tree)
    positions = (start + tree.depth)[None]
    h = fwd.layers[-1][:, src]
    picked = {i: fwd.layers[i][:, src] for i in hidden_layers if i < depth}
    vis = Visibility(anc, start, n, h.device, cache.key_slots(n))
    if isinstance(target, HybridTransformer):
        attention_below = [j for j, layer in enumerate(target.cfg.attention_layers) if layer < depth]
        cache.keep_tree_nodes(src, anc, attention_below)
        cos, sin = target.rope(positions)
        h, more = target.run_layers(h, cache, cos, sin, vis, len(target.model.layers), hidden_layers, first=depth)
        picked.update(more)
    else:
        move_kv(cache, start, src, depth)
        cos, sin = target.rope(positions, slots_below(cache, n))
        for i in range(depth, len(target.model.layers)):
            h = target.model.layers[i](h, cos, sin, cache, i, vis)
            if i in hidden_layers:
                picked[i] = h
    logits = target.head(target.final_norm(h))[0]
    cache.advance(n)
    hidden = torch.cat([picked[i] for i in hidden_layers], dim=-1) if hidden_layers else None
    return logits, hidden, anc


def move_kv(cache: KVCache, start: int, src: torch.Tensor, layers: int) -> None:
    """K/V of layers 0..layers-1 at slots start + src move to slots [start, start + len(src)) (gathered
    first, so overlapping moves are safe); the length does not move."""
    slots = start + src.to(cache.k[0].device)
    end = start + src.shape[0]
    if cache.stacked is not None:  # every layer's k and v in one buffer: one gather, one scatter
        cache.stacked[:, :layers, :, :, start:end] = cache.stacked[:, :layers, :, :, slots]
        return
    for k, v in zip(cache.k[:layers], cache.v[:layers]):
        k[:, :, start:end] = k[:, :, slots]
        v[:, :, start:end] = v[:, :, slots]


class FirstLevel:
    """A first level as the tree loops take it (tree_decode.Pruning): called on each drafted tree with
    the target's cache, it returns the survivors padded to keep + 1 nodes; `verify` is then the
    second level over them (with `reuse`, continued from the early exit's layer; otherwise a full
    tree verify)."""

    def __init__(self, kind: str, keep: int, target: Transformer | HybridTransformer | None = None,
                 exit_layer: int = 0, reuse: bool = True):
        if kind not in FIRST_LEVELS:
            raise ValueError(f"first level must be one of {', '.join(FIRST_LEVELS)}, got {kind!r}")
        if kind in EXITS and target is None:
            raise ValueError(f"the {kind} first level needs the target")
        if keep < 1:
            raise ValueError(f"a first level keeps >= 1 node, got {keep}")
        self.kind, self.keep, self.target, self.exit_layer, self.reuse = kind, keep, target, exit_layer, reuse
        self.pending: tuple[ExitForward, torch.Tensor] | None = None  # the forward and the survivors' sources

    def __call__(self, tree: Tree, cache: KVCache | HybridCache) -> Tree:
        self.pending = None
        if self.kind == "drafter":
            return prune_tree(tree, drafter_scores(tree), self.keep)
        fwd = exit_forward(self.target, cache, tree, self.exit_layer)
        scores = level_scores(self.kind, self.target, tree, fwd.layers[-1])
        kept = survivors(tree, scores, self.keep)
        if self.reuse:  # padding survivors compute as the root: they take its rows
            src = torch.tensor(kept + [0] * (self.keep + 1 - len(kept)), dtype=torch.long, device=tree.device)
            self.pending = (fwd, src)
        elif isinstance(cache, HybridCache):
            cache.rollback(cache.length)  # drop the tree data: the second level recomputes it
        return subtree(tree, kept, scores).padded(self.keep + 1)

    def verify(self, target: Transformer | HybridTransformer, cache: KVCache | HybridCache, tree: Tree,
               hidden_layers: tuple[int, ...] = ()) -> VerifyOut:
        """The second level over the survivors this level returned last (`verify_tree_logits`'s output)."""
        if self.pending is None:
            return verify_tree_logits(target, cache, tree, hidden_layers)
        (fwd, src), self.pending = self.pending, None
        return continue_tree(target, cache, tree, fwd, src, hidden_layers)


def first_level(kind: str, keep: int, target: Transformer | HybridTransformer | None = None,
                exit_layer: int = 0, reuse: bool = True) -> FirstLevel:
    """The pruning a tree loop applies to each drafted tree before the target verifies it."""
    return FirstLevel(kind, keep, target, exit_layer, reuse)


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
