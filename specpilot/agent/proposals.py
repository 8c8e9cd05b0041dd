"""Proposals are data: pipeline strings and rules texts, vetted before anything is built.

`vet(proposal, stock)` takes a proposal through what any user's pipeline goes through, and more:

1. size limits (a proposal is a line of passes and a few rules, not a program);
2. rules texts parsed by the DSL (`dsl.parse_rules`: data, never Python); a rules pass that would
   take a name a built-in, a plugin or another source holds is refused, so is a lossy one;
3. the pipeline string parsed by the DSL with `plugins=False`: a proposal never imports a plugin,
   it may name only passes already registered (built in, the user's rules and plugins, rules that
   proposals brought);
4. every pass lossless by contract (the search never tries a lossy one);
5. the passes run over the stock program with the IR verifier after each (`passes.run_passes`):
   a rule that edits what describes the checkpoint (a weight's name, a shape, an edge) or leaves a
   choice no backend runs is refused here;
6. the contract check: a pipeline declared lossless may not store a weight in fewer bits of
   mantissa than its checkpoint dtype (a lower-precision weight swap), except in a format whose
   round trip is bit-exact (u12 of bf16).

Anything refused becomes a `Rejection` with its reason; the search records it and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..dsl import parse_pipeline, parse_rules
from ..dsl.rules import load_rules
from ..errors import SpecpilotError
from ..ir import MATMUL_OPS, IRError, Program
from ..passes import REGISTRY, Pass, pipeline_string, run_passes
from ..passes.plugins import origin_of

MAX_PIPELINE_CHARS = 2000
MAX_RULES_CHARS = 8000
MAX_RULES = 4

MANTISSA_BITS = {"float32": 24, "float16": 11, "bfloat16": 8}
EXACT_FORMATS = {("bfloat16", "u12")}  # (checkpoint dtype, format) pairs whose round trip is bit-exact


@dataclass(frozen=True)
class Proposal:
    pipeline: str
    proposer: str  # "schedule-space", "memory", "llm", ...
    rules: tuple[tuple[str, str], ...] = ()  # (source, text)
    note: str = ""
    family: str = ""  # the direction it tries ("+tree-verify", "~draft-block-size", "-cuda-graphs", "memory", "llm")


@dataclass(frozen=True)
class Candidate:
    proposal: Proposal
    passes: tuple[Pass, ...]
    program: Program

    @property
    def pipeline(self) -> str:
        return pipeline_string(list(self.passes))

    @cached_property
    def ir_hash(self) -> str:
        return self.program.structural_hash()


@dataclass(frozen=True)
class Rejection:
    proposal: Proposal
    reason: str


def precision_problems(stock: Program, program: Program) -> list[str]:
    """Matmul weights `program` stores in a format with fewer mantissa bits than their checkpoint
    dtype (or float16 for bfloat16's range), unless the pair's round trip is exact."""
    out = []
    for level in ("target", "drafter"):
        for name, node in program.graph(level).items():
            if node.op not in MATMUL_OPS:
                continue
            dtype, fmt = str(node["dtype"]), str(node["format"])
            if fmt == dtype or (dtype, fmt) in EXACT_FORMATS or fmt not in MANTISSA_BITS:
                continue
            if MANTISSA_BITS[fmt] < MANTISSA_BITS.get(dtype, 0) or (dtype, fmt) == ("bfloat16", "float16"):
                out.append(f"{level}/{name}: weight stored as {fmt} from a {dtype} checkpoint")
    return out


def _rules_problem(source: str, text: str) -> str | None:
    """Why a proposal's rules text cannot be loaded, or None (then it is registered)."""
    if len(text) > MAX_RULES_CHARS:
        return f"rules text of {len(text)} characters (at most {MAX_RULES_CHARS})"
    classes = parse_rules(text, source)
    for cls in classes:
        if not cls.lossless:
            return f"rules pass {cls.name!r} is declared lossy: the search tries lossless passes only"
        held = REGISTRY.get(cls.name)
        if held is not None and getattr(held, "source", None) != source:
            return f"rules pass {cls.name!r} would take a name {origin_of(held)} holds"
    load_rules(text, source=source)
    return None


def vet(proposal: Proposal, stock: Program) -> Candidate | Rejection:
    """The proposal as a candidate (its passes parsed, run and verified over `stock`), or why not."""
    if not isinstance(proposal.pipeline, str) or len(proposal.pipeline) > MAX_PIPELINE_CHARS:
        return Rejection(proposal, f"pipeline of more than {MAX_PIPELINE_CHARS} characters")
    if len(proposal.rules) > MAX_RULES:
        return Rejection(proposal, f"{len(proposal.rules)} rules texts (at most {MAX_RULES})")
    try:
        for source, text in proposal.rules:
            problem = _rules_problem(source, text)
            if problem:
                return Rejection(proposal, problem)
        passes = parse_pipeline(proposal.pipeline, source=f"proposal ({proposal.proposer})", plugins=False)
        lossy = [p.spec() for p in passes if not p.lossless]
        if lossy:
            return Rejection(proposal, f"lossy pass {lossy[0]}: the search tries lossless passes only")
        program, _ = run_passes(stock, passes, where=f"proposal ({proposal.proposer}): ")
    except (SpecpilotError, IRError) as e:
        return Rejection(proposal, f"{type(e).__name__}: {e}")
    problems = precision_problems(stock, program)
    if problems:
        return Rejection(proposal, "contract: declared lossless but lowers precision: " + "; ".join(problems[:3]))
    return Candidate(proposal, tuple(passes), program)
