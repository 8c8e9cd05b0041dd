"""Where candidate pipelines come from. Each proposer returns `Proposal`s: data, vetted later.

- `schedule_space_proposals`: every registered lossless pass's `schedule_space` over the current
  program (the what-ifs the cost model prices, and the instances only measuring can judge), each
  placed in the current pipeline: replacing the instance of the same pass (a parameter change),
  else appended, and also put first; plus the current pipeline with each of its passes dropped.
- `memory_proposals`: the mechanisms the memory validated on the nearest fingerprints: each such
  pipeline as it was, and its passes the current pipeline lacks added to it, together and each alone.
- the LLM proposer is in llm.py.
"""

from __future__ import annotations

from ..dsl.pipeline import pass_names
from ..errors import SpecpilotError
from ..ir import Program
from ..passes import Pass, pipeline_string
from ..passes.what_if import to_measure, what_ifs
from .memory import Memory
from .fingerprint import Fingerprint
from .proposals import Proposal

SCHEDULE = "schedule-space"
MEMORY = "memory"


def _pipeline(passes: list[Pass]) -> str:
    return pipeline_string(passes)


def schedule_space_proposals(current: list[Pass], program: Program) -> list[Proposal]:
    instances = [w.instance for w in what_ifs(program)] + list(to_measure(program))
    out: list[Proposal] = []
    for inst in instances:
        same = [i for i, p in enumerate(current) if p.name == inst.name]
        if same:
            placed = list(current)
            placed[same[0]] = inst
            out.append(Proposal(_pipeline(placed), SCHEDULE, note=f"{inst.spec()} in place of {current[same[0]].spec()}",
                                family=f"~{inst.name}"))
            continue
        out.append(Proposal(_pipeline(current + [inst]), SCHEDULE, note=f"{inst.spec()} appended",
                            family=f"+{inst.name}"))
        if current:
            out.append(Proposal(_pipeline([inst] + current), SCHEDULE, note=f"{inst.spec()} first",
                                family=f"+{inst.name}"))
    for i, p in enumerate(current):
        out.append(Proposal(_pipeline(current[:i] + current[i + 1:]), SCHEDULE, note=f"{p.spec()} dropped",
                            family=f"-{p.name}"))
    return out


def _elements(pipeline: str) -> list[str]:
    """The pipeline's elements as text (a pass with its parameters), split at top-level commas."""
    depth, start, out = 0, 0, []
    for i, ch in enumerate(pipeline):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(pipeline[start:i].strip())
            start = i + 1
    if pipeline[start:].strip():
        out.append(pipeline[start:].strip())
    return out


def memory_proposals(memory: Memory, fp: Fingerprint, current: list[Pass], limit: int = 8) -> list[Proposal]:
    out: list[Proposal] = []
    have = {p.name for p in current}
    for m in memory.mechanisms(fp, limit=limit):
        note = f"validated on {m.fingerprint.key} (distance {m.distance:g}, {m.relative:.3f} of AR)"
        out.append(Proposal(m.pipeline, MEMORY, m.rules, note, family=MEMORY))
        try:
            names = pass_names(m.pipeline)
        except SpecpilotError:
            continue
        extra = [e for e, n in zip(_elements(m.pipeline), names) if n not in have]
        if extra and current:
            out.append(Proposal(",".join([_pipeline(current)] + extra), MEMORY, m.rules, note + "; added to the current",
                                family=MEMORY))
        if len(extra) > 1:  # each alone too: a parameter of the other deployment (its block size) may not carry over
            for e in extra:
                out.append(Proposal(",".join(([_pipeline(current)] if current else []) + [e]), MEMORY, m.rules,
                                    note + f"; {e} alone added to the current", family=MEMORY))
    return out
