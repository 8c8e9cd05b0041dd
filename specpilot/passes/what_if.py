"""Passes as what-ifs: what the cost model asks of a pass without importing it.

The cost model (specpilot/cost/gaps.py) ranks gaps and searches its ceiling over what-ifs: a pass
as a pipeline element, the gap it closes, and the program it would produce. `what_ifs(program)`
builds them from the registry: every lossless pass that declares `closes`, one what-if for each
instance its `schedule_space(program)` offers (the instances that change this program). The
compiler, above both rooms, hands `what_ifs` to the cost model; the candidate sets (tree budgets,
block sizes, thresholds) are the passes' own schedule spaces, so a search and the cost model try
the same ones.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import PipelineError
from ..ir import Program
from .base import REGISTRY, Pass


@dataclass(frozen=True)
class PassWhatIf:
    """One instance of a pass, asked of one program; the program it produces is computed on demand."""

    instance: Pass
    before: Program = field(repr=False, compare=False)

    @property
    def pass_name(self) -> str:
        return self.instance.name

    @property
    def pipeline(self) -> str:
        return self.instance.spec()

    @property
    def closes(self) -> str:
        return self.instance.closes

    @cached_property
    def program(self) -> Program:
        return self.instance.apply(self.before).program


def what_ifs(program: Program, passes: Collection[str] | None = None) -> list[PassWhatIf]:
    """The what-ifs of every searchable pass (lossless, `closes` declared) on `program`, in registry
    order; `passes` limits them to those pass names."""
    out = []
    for name, cls in REGISTRY.items():
        if not cls.closes or not cls.lossless or (passes is not None and name not in passes):
            continue
        out += [PassWhatIf(instance, program) for instance in cls.schedule_space(program) if _fits(instance, program)]
    return out


def _fits(instance: Pass, program: Program) -> bool:
    """Whether the instance's parameters fit the deployment (Pass.check)."""
    try:
        instance.check(program)
    except PipelineError:
        return False
    return True
