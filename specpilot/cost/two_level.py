"""Pricing a two-level verify step (passes/two_level_verify.py, runtime/two_level.py).

A two-level step drafts a tree of M nodes; a first level keeps N of them; the target verifies the N.
Its verify costs

    t_verify = first level: the target's embed and layers 0..L-1 over M + 1 rows
                            (+ its final norm and head over those rows for early-exit / early-exit-drafter,
                             which read the head over the vocabulary; early-exit-split reads one head row a node)
             + second level: layers L.. , the final norm, head and argmax over N + 1 rows
                             (the survivors continue from layer L: no layer is computed twice)

and the drafter first level costs nothing on the target (at batch 1 it keeps the one-level tree of N).
The choice of survivors is made on the host: one round trip (an overhead row of the model).

τ is measured against the one-level tree of N (the drafter's own ranking, best-first) and the tree of M
(a perfect first level: when the accepted path is in the drafted tree, it keeps it):

    τ = τ(N) + reach · (τ(M) − τ(N))

`REACH` is each first level's measured fraction of that gap, negative where it ranks worse than the
drafter's own confidences: the mean over budgets 16/32 and drafted 2N/4N of the zoo pairs at exit
layer 2 of 8 (8 HumanEval prompts), the smaller of the two pairs' (bench/results/two_level_cpu.json:
early-exit-drafter +0.67 on the attention pair, -0.51 on the hybrid; early-exit-split +0.36, -1.09;
early-exit, bench/results/hybrid_tree_cpu_zoo-*.json at 16 of 64: +0.37, -0.80). The drafter level
keeps the one-level tree of N at batch 1: 0.
"""

from __future__ import annotations

import re
from dataclasses import replace

from .roofline import NodeCost, StepEstimate

# fraction of τ(M) − τ(N) each first level reaches (see the module docstring)
REACH = {"drafter": 0.0, "early-exit": -0.80, "early-exit-drafter": -0.51, "early-exit-split": -1.09}
HEAD_OPS = ("rmsnorm", "lm_head")  # what an early exit's head reads after its layers (the final norm, the head)
_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a target graph's node belongs to ("layers.3.q_proj" -> 3), None outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def reach(first: str) -> float:
    if first not in REACH:
        raise ValueError(f"first level must be one of {', '.join(REACH)}, got {first!r}")
    return REACH[first]


def tau_two_level(tau_kept: float, tau_drafted: float, first: str) -> float:
    """τ of a two-level step from the one-level trees of its N (kept) and M (drafted) nodes."""
    return tau_kept + reach(first) * (tau_drafted - tau_kept)


def first_level_rows(drafted: StepEstimate, exit_layer: int, head: bool) -> list[NodeCost]:
    """The first level's rows of the target costed at the drafted tree's rows: everything before the
    layers (input, embed), layers < exit_layer and, with `head`, the final norm and the head."""
    out = []
    for r in drafted.rows:
        i = layer_of(r.name)
        if (i is not None and i < exit_layer) or (i is None and r.op in ("input", "embed")) or \
                (head and i is None and r.op in HEAD_OPS):
            out.append(replace(r, name=f"first/{r.name}"))
    return out


def second_level_rows(kept: StepEstimate, exit_layer: int) -> list[NodeCost]:
    """The second level's rows at the survivors' rows: layers >= exit_layer and what follows them."""
    return [r for r in kept.rows
            if (layer_of(r.name) is not None and layer_of(r.name) >= exit_layer)
            or (layer_of(r.name) is None and r.op not in ("input", "embed"))]


def two_level_verify(drafted: StepEstimate, kept: StepEstimate, first: str, exit_layer: int) -> StepEstimate:
    """One estimate of a two-level verify from the target costed at M + 1 rows (`drafted`) and at N + 1
    rows (`kept`), both from the same calibration (their `scale` is the verify factor). The drafter first
    level is `kept` itself."""
    reach(first)
    if first == "drafter":
        return kept
    rows = first_level_rows(drafted, exit_layer, head=first != "early-exit-split") + second_level_rows(kept, exit_layer)
    return StepEstimate(what=kept.what, graph=kept.graph, batch=kept.batch, q=kept.q, cache_len=kept.cache_len,
                        cuda_graphs=kept.cuda_graphs, costs=tuple(rows), counts=(1,) * len(rows),
                        layout=tuple((r.name, i) for i, r in enumerate(rows)), scale=kept.scale)
