"""Run a sequence of passes over a program, checking the IR after each one."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import PluginError
from ..ir import IRError, Program, verify_program
from .base import Pass, PassResult
from .plugins import is_plugin, origin_of, plugin_fault


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its spec, whether it changed the program, and the hashes around it."""

    spec: str
    changed: bool
    lossless: bool
    before: str
    after: str
    summary: str


def pipeline_string(passes: list[Pass]) -> str:
    """The canonical pipeline string: it reproduces the compilation exactly."""
    return ",".join(p.spec() for p in passes)


@contextmanager
def plugin_faults(cls: type[Pass], doing: str, where: str = ""):
    """A plugin pass's exception as one PluginError naming the plugin and the pass; a built-in's as it is."""
    try:
        yield
    except Exception as e:
        fault = plugin_fault(cls, doing, e, where)
        if fault is None:
            raise
        raise fault from None


def apply_pass(p: Pass, program: Program, *, verify: bool = True, where: str = "") -> tuple[PassResult, str, str]:
    """`p.apply(program)`, verified (the IR, and that the pass changed only choices) and checked
    against the `changed` it reports; with the structural hashes before and after. A plugin's pass
    is always verified, and whatever it does wrong is a PluginError naming the plugin and the pass."""
    cls, plugin = type(p), is_plugin(type(p))
    before = program.structural_hash()
    with plugin_faults(cls, "raised in apply", where):
        result = p.apply(program)
    if plugin and not (isinstance(result, PassResult) and isinstance(result.program, Program)):
        raise PluginError(f"{where}{origin_of(cls)}: pass {p.name!r} returned {type(result).__name__}, expected a "
                          f"PassResult holding a Program")
    if plugin and program.structural_hash() != before:
        raise PluginError(f"{where}{origin_of(cls)}: pass {p.name!r} changed the program it was given in place "
                          f"(a pass returns a new program: Program.with_graph, Graph.with_node)")
    if verify or plugin:
        try:
            verify_program(result.program, after=p.spec(), before=program)
        except IRError as e:
            if plugin:
                problems = str(e).split(": ", 1)[-1]  # past "invalid IR after <spec>"
                raise PluginError(f"{where}{origin_of(cls)}: pass {p.name!r} returned an invalid IR: {problems}") from None
            raise
    after = result.program.structural_hash()
    if result.changed != (before != after):
        message = f"pass {p.spec()} reported changed={result.changed} but the hash says otherwise"
        if plugin:
            raise PluginError(f"{where}{origin_of(cls)}: {message}")
        raise AssertionError(message)
    return result, before, after


def run_passes(program: Program, passes: list[Pass], *, verify: bool = True,
               where: str = "") -> tuple[Program, list[PassRecord]]:
    """Apply `passes` in order. Each first checks its parameters against the deployment's limits
    (PipelineError, prefixed with `where`: the file and field the pipeline came from); the IR is
    verified after each, including that the pass changed only what passes may choose."""
    records = []
    for p in passes:
        with plugin_faults(type(p), "raised in check", where):
            p.check(program, where)
        result, before, after = apply_pass(p, program, verify=verify, where=where)
        records.append(PassRecord(p.spec(), result.changed, p.lossless, before, after, result.summary))
        program = result.program
    return program, records


def all_lossless(passes: list[Pass]) -> bool:
    return all(p.lossless for p in passes)
