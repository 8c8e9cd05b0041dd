"""The IR verifier: every pass must leave a program that passes it (the pass manager runs it).

It checks the op schemas (known ops, required attributes, allowed values), that each graph is a
DAG of the right level, the matmul shapes along edges, and the step graph's internal agreement
(the verify length matches what the proposer emits; acceptance and commit fit the verify mode).
"""

from __future__ import annotations

import networkx as nx

from ..errors import SpecpilotError
from .graph import Graph, Program
from .node import MATMUL_OPS, OPS, Node


class IRError(SpecpilotError):
    """A program breaks an IR invariant (after lowering, parsing or a pass)."""


def _check_value(allowed, value) -> bool:
    if isinstance(allowed, set):
        return value in allowed
    if allowed is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if allowed is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, allowed)


def _node_problems(graph: Graph, name: str, node: Node, level: str) -> list[str]:
    where = f"{graph.name}/{name}"
    schema = OPS.get(node.op)
    if schema is None:
        return [f"{where}: unknown op {node.op!r}"]
    if schema.level != level:
        return [f"{where}: op {node.op!r} belongs in a {schema.level} graph"]
    problems = []
    for key in schema.required:
        if key not in node:
            problems.append(f"{where}: {node.op} needs attribute {key!r}")
    for key, value in node.items():
        allowed = schema.allowed(key)
        if allowed is None:
            problems.append(f"{where}: {node.op} has no attribute {key!r}")
        elif not _check_value(allowed, value):
            want = sorted(allowed) if isinstance(allowed, set) else allowed.__name__
            problems.append(f"{where}: {key}={value!r} not allowed (expected {want})")
    return problems


def _out_dim(node: Node) -> int | None:
    if node.op in ("embed", "rmsnorm", "mlp"):
        return node["dim"]
    if node.op in MATMUL_OPS:
        return node["out_features"]
    if node.op == "attention":
        return node["heads"] * node["head_dim"]
    if node.op == "input" and "dim" in node:
        return node["dim"]
    return None


def _model_problems(graph: Graph) -> list[str]:
    problems = []
    for name, node in graph.items():
        if node.op not in MATMUL_OPS:
            continue
        for src in graph.inputs(name):
            dim = _out_dim(graph.node(src))
            if dim is not None and dim != node["in_features"]:
                problems.append(
                    f"{graph.name}/{name}: in_features={node['in_features']} but input {src} gives {dim}"
                )
    return problems


_VERIFY_FOR = {"chain": {"chain"}, "tree": {"tree", "two-level"}}
_ACCEPT_FOR = {"chain": "greedy-prefix", "tree": "tree-path", "two-level": "tree-path"}
_COMMIT_FOR = {"chain": "rollback", "tree": "compact", "two-level": "compact"}


def expected_verify_length(draft: Node, propose: Node) -> int:
    """Tokens the target sees per verify: the anchor token plus every candidate."""
    if propose["shape"] == "tree":
        return propose["budget"] + 1
    # DFlash drafts block_size-1 tokens after the anchor; PARD drafts block_size (= k) tokens.
    return draft["block_size"] if draft["kind"] == "dflash" else draft["block_size"] + 1


def _step_problems(step: Graph) -> list[str]:
    problems = []
    for op in ("draft", "propose", "verify", "accept", "commit"):
        if len(step.find(op)) != 1:
            problems.append(f"step: needs exactly one {op!r} node, has {len(step.find(op))}")
    if problems:
        return problems
    draft, propose, verify = step.one("draft")[1], step.one("propose")[1], step.one("verify")[1]
    accept, commit = step.one("accept")[1], step.one("commit")[1]
    if draft["block_size"] < 2 and draft["kind"] == "dflash":
        problems.append(f"step/draft: block_size={draft['block_size']} must be >= 2 for dflash")
    if draft["block_size"] < 1:
        problems.append(f"step/draft: block_size={draft['block_size']} must be >= 1")
    if verify["mode"] not in _VERIFY_FOR[propose["shape"]]:
        problems.append(f"step/verify: mode {verify['mode']!r} cannot verify a {propose['shape']} proposal")
    want_q = expected_verify_length(draft, propose)
    if verify["q"] != want_q:
        problems.append(f"step/verify: q={verify['q']} but the proposal needs q={want_q}")
    schedule = step.find("schedule")
    if schedule and step.node(schedule[0]).get("graphs"):
        if verify["mode"] not in ("chain", "tree") or accept["on"] != "device":
            problems.append("step/schedule: graphs=true needs chain or tree verification and accept on the device "
                            f"(verify mode {verify['mode']!r}, accept on {accept['on']!r})")
    if accept["rule"] != _ACCEPT_FOR[verify["mode"]]:
        problems.append(f"step/accept: rule {accept['rule']!r} does not fit verify mode {verify['mode']!r}")
    if commit["kv"] != _COMMIT_FOR[verify["mode"]]:
        problems.append(f"step/commit: kv {commit['kv']!r} does not fit verify mode {verify['mode']!r}")
    return problems


def program_problems(program: Program) -> list[str]:
    problems = []
    for graph in program.graphs():
        if not nx.is_directed_acyclic_graph(graph.dag):
            problems.append(f"{graph.name}: graph has a cycle")
            continue
        level = "step" if graph.name == "step" else "model"
        for name, node in graph.items():
            problems += _node_problems(graph, name, node, level)
    if problems:
        return problems
    problems += _step_problems(program.step)
    problems += _model_problems(program.target) + _model_problems(program.drafter)
    t_vocab = {program.target.node(n)["vocab"] for n in program.target.find("embed")}
    d_heads = {program.drafter.node(n)["out_features"] for n in program.drafter.find("lm_head")}
    if d_heads and t_vocab and d_heads != t_vocab:
        problems.append(f"drafter: lm_head vocabulary {sorted(d_heads)} differs from the target's {sorted(t_vocab)}")
    return problems


def verify_program(program: Program, after: str = "") -> Program:
    """Raise IRError listing every broken invariant; return the program unchanged otherwise."""
    problems = program_problems(program)
    if problems:
        ctx = f" after {after}" if after else ""
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise IRError(f"invalid IR{ctx}: {shown}")
    return program
