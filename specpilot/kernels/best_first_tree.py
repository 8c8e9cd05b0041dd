"""The best-first candidate tree of a parallel drafter, built on the device in one launch.

`best_first_tree(logp, ids, anchor, budget)`: logp, ids [D, K] are the drafter's top-K
log-probabilities (descending per row) and tokens at D positions; anchor is a 1-element device
tensor (the last committed token). Returns parent, depth, token [budget + 1] (int64) and score
[budget + 1] (float32). A batch of trees: logp, ids [B, D, K] and anchor [B] give [B, budget + 1]
each, one program a tree (the batched engine's graphed tree step). Per tree: node 0 is the anchor,
nodes 1.. the `budget` highest-scoring paths of the top-K lattice in the order a heap pops them,
padding (a lattice smaller than the budget) hanging from nothing (parent -1, depth 0, the anchor's
token, score -inf), as the reference's host heap builds it (and the runtime's own,
`runtime.tree.best_first_tree`).

One program holds the frontier in registers: each of the `budget` rounds pops the best entry (the
first slot among equal scores, i.e. the earliest pushed, as the heap's push counter breaks ties),
appends it as a node, and pushes its next sibling and its first child into the next two slots
(an impossible push is a -inf slot, so the order of the others is kept). Scores add in float64,
as the reference's Python floats do, so both pick the same tree. No host sync and a grid of one
program a tree: the tree step of a graphed decode loop captures it (runtime/graph_decode.py, and
runtime/batch.py's GraphedVerify for a batch).
"""

from __future__ import annotations

import heapq
import itertools
import math

import torch
import triton
import triton.language as tl

from .registry import KernelSpec, register


@triton.jit
def _best_first_kernel(
    logp_ptr, ids_ptr, anchor_ptr, parent_ptr, depth_ptr, token_ptr, score_ptr,
    D, K,
    BUDGET: tl.constexpr, FRONT: tl.constexpr, NODES: tl.constexpr,
):
    tree = tl.program_id(0).to(tl.int64)
    logp_ptr += tree * D * K
    ids_ptr += tree * D * K
    anchor_ptr += tree
    parent_ptr += tree * (BUDGET + 1)
    depth_ptr += tree * (BUDGET + 1)
    token_ptr += tree * (BUDGET + 1)
    score_ptr += tree * (BUDGET + 1)
    slots = tl.arange(0, FRONT)
    nodes = tl.arange(0, NODES)
    neg_inf = float("-inf")
    anchor = tl.load(anchor_ptr)
    # frontier: score (float64), parent node, depth, rank; slot 0 = the root's first child
    first = tl.load(logp_ptr).to(tl.float64)
    f_score = tl.where(slots == 0, first, tl.full([FRONT], neg_inf, tl.float64))
    f_parent = tl.zeros([FRONT], tl.int32)
    f_depth = tl.where(slots == 0, 1, 0)
    f_rank = tl.zeros([FRONT], tl.int32)
    # nodes: the root, then padding until popped
    n_parent = tl.full([NODES], -1, tl.int32)
    n_depth = tl.zeros([NODES], tl.int32)
    n_token = tl.zeros([NODES], tl.int64) + anchor
    n_score = tl.where(nodes == 0, 0.0, tl.full([NODES], neg_inf, tl.float64))
    for i in range(BUDGET):
        best = tl.argmax(f_score, 0, tie_break_left=True)
        at = slots == best
        score = tl.max(f_score, 0)
        live = tl.where(score > neg_inf, 1, 0)  # int flags: the interpreter's & rejects a scalar int1 here
        parent = tl.sum(tl.where(at, f_parent, 0), 0)
        depth = tl.sum(tl.where(at, f_depth, 0), 0)
        rank = tl.sum(tl.where(at, f_rank, 0), 0)
        token = tl.load(ids_ptr + (depth - 1) * K + rank, mask=live != 0, other=0)
        here = nodes == tl.where(live != 0, i + 1, -1)
        n_parent = tl.where(here, parent, n_parent)
        n_depth = tl.where(here, depth, n_depth)
        n_token = tl.where(here, token, n_token)
        n_score = tl.where(here, score, n_score)
        f_score = tl.where(at, neg_inf, f_score)
        # next sibling: same parent, rank + 1
        parent_score = tl.sum(tl.where(nodes == parent, n_score, 0.0), 0)
        sib_ok = live * tl.where(rank + 1 < K, 1, 0) != 0
        sib = parent_score + tl.load(logp_ptr + (depth - 1) * K + rank + 1, mask=sib_ok, other=0.0).to(tl.float64)
        s1 = slots == 2 * i + 1
        f_score = tl.where(s1, tl.where(sib_ok, sib, neg_inf), f_score)
        f_parent = tl.where(s1, parent, f_parent)
        f_depth = tl.where(s1, depth, f_depth)
        f_rank = tl.where(s1, rank + 1, f_rank)
        # first child: this node, one deeper, rank 0
        child_ok = live * tl.where(depth + 1 <= D, 1, 0) != 0
        child = score + tl.load(logp_ptr + depth * K, mask=child_ok, other=0.0).to(tl.float64)
        s2 = slots == 2 * i + 2
        f_score = tl.where(s2, tl.where(child_ok, child, neg_inf), f_score)
        f_parent = tl.where(s2, i + 1, f_parent)
        f_depth = tl.where(s2, depth + 1, f_depth)
        f_rank = tl.where(s2, 0, f_rank)
    keep = nodes < BUDGET + 1
    tl.store(parent_ptr + nodes, n_parent.to(tl.int64), mask=keep)
    tl.store(depth_ptr + nodes, n_depth.to(tl.int64), mask=keep)
    tl.store(token_ptr + nodes, n_token, mask=keep)
    tl.store(score_ptr + nodes, n_score.to(tl.float32), mask=keep)


def best_first_tree(logp: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, budget: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parent, depth, token, score), each [budget + 1] (a batch: [B, budget + 1]); see the module
    docstring."""
    batched = logp.dim() == 3
    if logp.dim() not in (2, 3) or logp.shape != ids.shape or logp.shape[-2] < 1:
        raise ValueError(f"best_first_tree: logp and ids must be [D, K] or [B, D, K] with D >= 1, got "
                         f"{list(logp.shape)}, {list(ids.shape)}")
    if budget < 1:
        raise ValueError(f"best_first_tree: budget must be >= 1, got {budget}")
    b, d, k = logp.shape if batched else (1, *logp.shape)
    if batched and anchor.numel() != b:
        raise ValueError(f"best_first_tree: a batch of {b} trees needs {b} anchors, got {anchor.numel()}")
    logp, ids = logp.float().contiguous(), ids.long().contiguous()
    anchor = anchor.reshape(-1)[:b].long().contiguous()
    n = budget + 1
    parent = torch.empty(b, n, dtype=torch.long, device=logp.device)
    depth, token = torch.empty_like(parent), torch.empty_like(parent)
    score = torch.empty(b, n, dtype=torch.float32, device=logp.device)
    _best_first_kernel[(b,)](
        logp, ids, anchor, parent, depth, token, score, d, k,
        BUDGET=budget, FRONT=triton.next_power_of_2(2 * budget + 1), NODES=triton.next_power_of_2(n),
    )
    out = (parent, depth, token, score)
    return out if batched else tuple(t[0] for t in out)


def best_first_tree_reference(logp: torch.Tensor, ids: torch.Tensor, anchor: torch.Tensor, budget: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same tree by a heap on the host: pop the best frontier path (ties: the earlier push),
    then push its next sibling and its first child; padding hangs from nothing (parent -1). A batch
    ([B, D, K], anchor [B]): each tree so, stacked."""
    if logp.dim() == 3:
        trees = [best_first_tree_reference(lp, i, a, budget) for lp, i, a in zip(logp, ids, anchor.reshape(-1))]
        return tuple(torch.stack(parts) for parts in zip(*trees))
    lp, tok = logp.float().cpu().tolist(), ids.long().cpu().tolist()
    d, k = len(lp), len(lp[0]) if lp else 0
    root = int(anchor.reshape(-1)[0])
    parent, depth, token, score = [-1], [0], [root], [0.0]
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, push order, parent, depth, rank)
    order = itertools.count()

    def push(up: int, depth_: int, rank: int) -> None:
        if depth_ <= d and rank < k:
            heapq.heappush(frontier, (-(score[up] + lp[depth_ - 1][rank]), next(order), up, depth_, rank))

    push(0, 1, 0)
    while frontier and len(parent) <= budget:
        neg, _, up, depth_, rank = heapq.heappop(frontier)
        parent.append(up), depth.append(depth_), token.append(tok[depth_ - 1][rank]), score.append(-neg)
        push(up, depth_, rank + 1)  # next sibling
        push(len(parent) - 1, depth_ + 1, 0)  # first child
    pad = budget + 1 - len(parent)
    parent, depth, token, score = parent + [-1] * pad, depth + [0] * pad, token + [root] * pad, score + [-math.inf] * pad
    as_long = dict(dtype=torch.long, device=logp.device)
    return (torch.tensor(parent, **as_long), torch.tensor(depth, **as_long), torch.tensor(token, **as_long),
            torch.tensor(score, dtype=torch.float32, device=logp.device))


# --- registry entry -------------------------------------------------------------------------


def _make_inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    d, k, vocab = case["D"], case["K"], 50
    logits = torch.randn(d, vocab, generator=g) * case["spread"]
    if case.get("ties"):  # equal scores everywhere: the push order alone decides
        logits = torch.zeros(d, vocab)
    logp, ids = torch.log_softmax(logits, -1).topk(k, -1)
    anchor = torch.tensor([7])
    if case.get("B"):  # a batch of trees: each its own logits and anchor
        logits = torch.randn(case["B"], d, vocab, generator=g) * case["spread"]
        logp, ids = torch.log_softmax(logits, -1).topk(k, -1)
        anchor = torch.arange(case["B"]) + 7
    return logp.to(device), ids.to(device), anchor.to(device), case["budget"]


def _run(logp, ids, anchor, budget):
    return torch.stack([t.double() for t in best_first_tree(logp, ids, anchor, budget)])


def _reference(logp, ids, anchor, budget):
    return torch.stack([t.double() for t in best_first_tree_reference(logp, ids, anchor, budget)])


def _plant(inputs):
    logp, ids, anchor, budget = inputs
    ids = ids.clone()
    ids[..., 0, 0] += 1  # the best first token changes: the kernel's tree must show it
    return logp, ids, anchor, budget


register(KernelSpec(
    name="best_first_tree",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        dict(D=5, K=3, budget=7, spread=2.0),
        dict(D=15, K=4, budget=16, spread=1.0),
        dict(D=3, K=2, budget=20, spread=3.0),  # the lattice (14 nodes) is smaller than the budget
        dict(D=7, K=1, budget=5, spread=1.0),  # a chain
        dict(D=4, K=3, budget=11, spread=1.0, ties=True),
        dict(D=5, K=3, budget=9, spread=2.0, B=3),  # three trees, one program each
    ],
    tolerance={torch.float64: (0.0, 0.0)},
    corrupt=_plant,
    description="best-first candidate tree from the drafter's top-k, one program",
))
