"""Gaps between the current pipeline and its ceiling, each named by the pass that would close it.

The cost model sits below the passes and imports none: what a pass would do is asked of the pass
through a narrow interface. The caller hands `predict` a provider of what-ifs (`WhatIfs`: program
-> what-ifs, the compiler passes `specpilot.passes.what_if.what_ifs`); a `WhatIf` is a pass as a
pipeline element, the gap it closes in words, and the program it would produce. Without a provider
there are no what-ifs: no pass gaps, and the ceiling is the program itself at its floor.

Gaps are a greedy waterfall in time per output token: at each stage every what-if of a pass not yet
taken is costed on top of those taken, the one that saves the most is taken, until none saves
anything. What is left between that program and the ceiling is kernels running below the roofline,
which no pass closes yet (`remainder_gap`). The savings add up to current - ceiling per token.

The ceiling (`search_ceiling`) is the fastest program at the floor (every op at bytes / bandwidth
or FLOPs / rate) the what-ifs reach, found stage by stage, one pass a stage: the passes the starting
program offers, those with the fewest what-ifs first (ties in the provider's order), then any pass
the best program so far offers that no stage searched. At a stage each program of the beam stays as
it is and is also extended by each what-if of that pass it offers; the `beam` fastest at the floor,
distinct in time, go on. With the built-in passes the one-choice passes
(split-KV, CUDA graphs, fused decoder) and the two u12 thresholds come first, so the beam holds
every combination of them when the block sizes and then the tree budgets are searched; the search
is exhaustive over a stage whenever the beam holds every program the stage makes. Seeds (the
waterfall's last program) start in the beam, so the ceiling is never slower than what the waterfall
reached.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from ..ir import Node, Program

NO_PASS = ""
CEILING_BEAM = 24  # programs kept per stage of the ceiling search (see the module docstring)


@dataclass(frozen=True)
class Gap:
    """One reason the pipeline is slower than its ceiling, in seconds per output token (predicted)."""

    what: str  # the shortfall, in words
    pass_name: str  # the pass that closes it ("" where no pass does yet)
    pipeline: str  # the pass as a pipeline element, with its parameters
    saving: float  # seconds per output token the pass saves at this point of the waterfall
    fraction: float  # of the current time per output token
    detail: str = ""
    source: str = "predicted"


class WhatIf(Protocol):
    """A pass asked of one program: what the cost model needs to know of it, and no more."""

    @property
    def pass_name(self) -> str: ...  # the pass's registered name ("tree-verify")

    @property
    def pipeline(self) -> str: ...  # the pass as a pipeline element ("tree-verify{budget=64, topk=4}")

    @property
    def closes(self) -> str: ...  # the gap it closes, in words

    @property
    def program(self) -> Program: ...  # the program the pass would produce


class WhatIfs(Protocol):
    """A provider of what-ifs: those `program` offers, limited to the pass names in `passes`."""

    def __call__(self, program: Program, passes: Collection[str] | None = None) -> Sequence[WhatIf]: ...


def no_what_ifs(program: Program, passes: Collection[str] | None = None) -> list[WhatIf]:
    """The provider of a cost model asked without passes: nothing to try."""
    return []


def step_ops(program: Program) -> dict[str, Node]:
    """The step graph's nodes by op (each op appears once in a valid step graph)."""
    return {node.op: node for _, node in program.step.dag.nodes(data="node")}


def draft_positions(program: Program) -> int:
    """Tokens the drafter proposes per block (DFlash: block_size - 1 after the anchor; PARD: k)."""
    draft = step_ops(program)["draft"]
    return draft["block_size"] - 1 if draft["kind"] == "dflash" else draft["block_size"]


def rank_gaps(program: Program, t_token: Callable[[Program], float],
              what_ifs: WhatIfs) -> tuple[list[Gap], Program]:
    """The greedy waterfall from `program`: the pass gaps in the order taken, and the program reached.

    `t_token(program)` is the model's time per output token. Each pass is taken at most once (a
    pass with parameters, such as tree-verify, with its best instance at that stage)."""
    base = t_token(program)
    current, now = program, base
    taken: set[str] = set()
    gaps: list[Gap] = []
    while True:
        best: tuple[float, WhatIf] | None = None
        for w in what_ifs(current):
            if w.pass_name in taken:
                continue
            t = t_token(w.program)
            if now - t > 1e-12 and (best is None or t < best[0]):
                best = (t, w)
        if best is None:
            break
        t, w = best
        gaps.append(Gap(w.closes, w.pass_name, w.pipeline, now - t, (now - t) / base if base else 0.0))
        taken.add(w.pass_name)
        current, now = w.program, t
    return gaps, current


def remainder_gap(t_reached: float, ceiling_t_token: float, base: float) -> Gap | None:
    """What the best program found still loses to the ceiling: kernels below the roofline."""
    rest = t_reached - ceiling_t_token
    if rest <= 1e-12:
        return None
    return Gap("kernels below the roofline (efficiency, per-kernel latency)", NO_PASS, "", rest,
               rest / base if base else 0.0, "what the best pipeline found still loses to every op at its floor")


@dataclass(frozen=True)
class Reached:
    """A program the ceiling search reached: its time per token at the floor and the pipeline elements taken."""

    t_token: float
    program: Program
    pipeline: tuple[str, ...] = ()


def search_ceiling(program: Program, t_floor: Callable[[Program], float], what_ifs: WhatIfs, *,
                   seeds: Iterable[Reached] = (), beam: int = CEILING_BEAM) -> Reached:
    """The fastest program at the floor the what-ifs reach from `program` (module docstring)."""
    def best(rs: list[Reached]) -> Reached:
        return min(rs, key=lambda r: (r.t_token, len(r.pipeline)))

    offered = what_ifs(program)
    frontier = [Reached(t_floor(program), program), *seeds]
    searched: set[str] = set()
    while True:
        counts = Counter(w.pass_name for w in offered if w.pass_name not in searched)
        if not counts:
            return best(frontier)
        for stage in sorted(counts, key=lambda name: counts[name]):  # stable: ties keep the provider's order
            candidates = list(frontier)
            for r in frontier:
                options = ([w for w in offered if w.pass_name == stage] if r.program is program
                           else what_ifs(r.program, (stage,)))
                candidates += [Reached(t_floor(w.program), w.program, r.pipeline + (w.pipeline,)) for w in options]
            candidates.sort(key=lambda r: (r.t_token, len(r.pipeline)))
            frontier = []
            for r in candidates:
                if not any(math.isclose(r.t_token, kept.t_token, rel_tol=1e-12) for kept in frontier):
                    frontier.append(r)
                if len(frontier) == beam:
                    break
            searched.add(stage)
        program = best(frontier).program  # passes the best program offers that no stage searched yet
        offered = what_ifs(program)


def pipeline_string(gaps: Iterable[Gap]) -> str:
    """The passes of a gap list as one pipeline string (what a search would try)."""
    return ",".join(g.pipeline for g in gaps if g.pass_name)
