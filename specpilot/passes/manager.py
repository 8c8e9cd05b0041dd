"""Run a sequence of passes over a program, checking the IR after each one."""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import Program, verify_program
from .base import Pass


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


def run_passes(program: Program, passes: list[Pass], *, verify: bool = True,
               where: str = "") -> tuple[Program, list[PassRecord]]:
    """Apply `passes` in order. Each first checks its parameters against the deployment's limits
    (PipelineError, prefixed with `where`: the file and field the pipeline came from); the IR is
    verified after each, including that the pass changed only what passes may choose."""
    records = []
    for p in passes:
        p.check(program, where)
        before = program.structural_hash()
        result = p.apply(program)
        if verify:
            verify_program(result.program, after=p.spec(), before=program)
        after = result.program.structural_hash()
        if result.changed != (before != after):
            raise AssertionError(f"pass {p.spec()} reported changed={result.changed} but the hash says otherwise")
        records.append(PassRecord(p.spec(), result.changed, p.lossless, before, after, result.summary))
        program = result.program
    return program, records


def all_lossless(passes: list[Pass]) -> bool:
    return all(p.lossless for p in passes)
