"""Print a `Program` as text and parse it back; `parse_program(print_program(p)) == p`.

The printed form is canonical (stable node order, sorted attributes, floats by repr), so it is
also what the structural hash is taken over and what engine directories store as `ir.txt`.
"""

from __future__ import annotations

import json
from functools import lru_cache

import lark

from ..errors import DSLSyntaxError
from ..grammar import grammar_text
from .graph import LEVELS, Graph, Program
from .node import Literal, Node


def format_literal(value: Literal) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        return text if any(c in text for c in ".eE") else text + ".0"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(format_literal(v) for v in value) + "]"
    raise TypeError(f"not an IR literal: {value!r}")


def format_attrs(attrs) -> str:
    return "{" + ", ".join(f"{k}={format_literal(v)}" for k, v in attrs) + "}"


def print_graph(graph: Graph) -> str:
    lines = [f"graph {graph.name} {{"]
    for name, node in graph.items():
        args = ", ".join(graph.inputs(name))
        attrs = f" {format_attrs(node.attrs)}" if node.attrs else ""
        lines.append(f"  {name} = {node.op}({args}){attrs}")
    lines.append("}")
    return "\n".join(lines)


def print_program(program: Program) -> str:
    head = "program" + (f" {format_attrs(program.attrs)}" if program.attrs else "")
    return "\n".join([head] + [print_graph(g) for g in program.graphs()]) + "\n"


class Literals(lark.Transformer):
    """IR literals as Python values: shared by the IR parser and the DSL (same literal syntax)."""

    def int(self, items):
        return int(items[0])

    def float(self, items):
        return float(items[0])

    def string(self, items):
        return json.loads(items[0])

    def true(self, _):
        return True

    def false(self, _):
        return False

    def tuple(self, items):
        return tuple(i for i in items if i is not None)


class _ToIR(Literals):
    def attr(self, items):
        return (str(items[0]), items[1])

    def attrs(self, items):
        return tuple(sorted(i for i in items if i is not None))

    def stmt(self, items):
        name, op = str(items[0]), str(items[1])
        rest = [i for i in items[2:] if i is not None]
        attrs = rest[-1] if rest and isinstance(rest[-1], tuple) else ()
        inputs = [str(i) for i in rest if isinstance(i, lark.Token)]
        return name, Node(op, attrs), inputs

    def graph(self, items):
        g = Graph(str(items[0]))
        for name, node, inputs in items[1:]:
            g.add(name, node, inputs)
        return g

    def start(self, items):
        attrs = items[0] if items and isinstance(items[0], tuple) else ()
        graphs = {g.name: g for g in items if isinstance(g, Graph)}
        missing = [lv for lv in LEVELS if lv not in graphs]
        if missing:
            raise ValueError(f"program lacks graph(s): {', '.join(missing)}")
        return Program(**graphs, attrs=attrs)


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text("ir.lark"), parser="lalr")


def parse_program(text: str, source: str = "<ir>") -> Program:
    """Parse IR text; syntax errors become DSLSyntaxError with file, line and column."""
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedInput as e:
        raise DSLSyntaxError(f"{source}:{e.line}:{e.column}: IR syntax error: unexpected input") from None
    try:
        return _ToIR().transform(tree)
    except lark.exceptions.VisitError as e:
        raise DSLSyntaxError(f"{source}: invalid IR: {e.orig_exc}") from None
