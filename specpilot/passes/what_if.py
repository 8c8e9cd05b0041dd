"""Passes as what-ifs: what the cost model asks of a pass without importing it.

The cost model (specpilot/cost/gaps.py) ranks gaps and searches its ceiling over what-ifs: a pass
as a pipeline element, the gap it closes, and the program it would produce. `what_ifs(program)`
builds them from the registry: every lossless pass that declares `closes`, one what-if for each
instance its `schedule_space(program)` offers (the instances that change this program). The
compiler, above both rooms, hands `what_ifs` to the cost model; the candidate sets (tree budgets,
block sizes, thresholds) are the passes' own schedule spaces, so a search and the cost model try
the same ones.

Plugin passes (plugins.py) are offered the same way once loaded; their what-ifs' programs are
verified (the IR, choices only) before the cost model sees them, and a plugin that raises or
returns an invalid IR is a PluginError naming it. A lossless pass without `closes` is not offered:
the cost model cannot predict it, and `to_measure` lists its instances for a search to measure.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import PipelineError
from ..ir import Program
from .base import REGISTRY, Pass
from .manager import apply_pass, plugin_faults
from .plugins import is_plugin


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
        if is_plugin(type(self.instance)):
            return apply_pass(self.instance, self.before)[0].program
        return self.instance.apply(self.before).program


def what_ifs(program: Program, passes: Collection[str] | None = None) -> list[PassWhatIf]:
    """The what-ifs of every searchable pass (lossless, `closes` declared) on `program`, in registry
    order; `passes` limits them to those pass names."""
    out = []
    for name, cls in REGISTRY.items():
        if not cls.closes or not cls.lossless or (passes is not None and name not in passes):
            continue
        out += [PassWhatIf(instance, program) for instance in _space(cls, program)]
    return out


def to_measure(program: Program, passes: Collection[str] | None = None) -> list[Pass]:
    """The instances of lossless passes that declare no `closes` (the cost model cannot predict
    them) which would change `program`: what a search must build and measure to judge."""
    out = []
    for name, cls in REGISTRY.items():
        if cls.closes or not cls.lossless or (passes is not None and name not in passes):
            continue
        out += _space(cls, program)
    return out


def _space(cls: type[Pass], program: Program) -> list[Pass]:
    with plugin_faults(cls, "raised in schedule_space"):
        space = cls.schedule_space(program)
        if is_plugin(cls):
            bad = [x for x in space if not isinstance(x, Pass)]
            if bad:
                raise TypeError(f"schedule_space gave {bad[0]!r}, expected instances of the pass")
    return [instance for instance in space if _fits(instance, program)]


def _fits(instance: Pass, program: Program) -> bool:
    """Whether the instance's parameters fit the deployment (Pass.check)."""
    try:
        with plugin_faults(type(instance), "raised in check"):
            instance.check(program)
    except PipelineError:
        return False
    return True
