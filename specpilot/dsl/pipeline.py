"""Pass pipelines: `weights-u12{min-numel=1048576},tree-verify{budget=64},cuda-graphs` -> [Pass].

This module also owns the DSL parser that rules files share (grammar/specpilot.lark, one grammar
with the entry points `pipeline` and `rules`), and the one place lark errors become
`DSLSyntaxError("source:line:col: expected ..., got ...")`.
"""

from __future__ import annotations

from functools import lru_cache

import lark
from lark.lexer import PatternStr

from ..errors import DSLSyntaxError, PipelineError
from ..grammar import grammar_text
from ..passes.base import Pass, lookup
from ..ir.text import Literals as IRLiterals

# How the grammar's named terminals read in an error message (string terminals read as themselves).
_READABLE = {
    "PASS_NAME": "a pass name",
    "RULE_NAME": "a rule name",
    "PARAM": "a parameter name",
    "WORD": "a value",
    "OP": "an op name",
    "KEY": "an attribute name",
    "REF": "a $attribute",
    "LEVEL": "a level (step, target, drafter)",
    "CONTRACT": "lossless or lossy",
    "CMP": "a comparison (==, !=, <, <=, >, >=)",
    "SIGNED_INT": "a number",
    "SIGNED_FLOAT": "a number",
    "ESCAPED_STRING": "a string",
    "$END": "end of input",
}


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text("specpilot.lark"), parser="lalr", lexer="contextual",
                     start=["pipeline", "rules"], maybe_placeholders=True, propagate_positions=True)


@lru_cache(maxsize=1)
def _terminal_words() -> dict[str, str]:
    words = dict(_READABLE)
    for t in _parser().terminals:
        if isinstance(t.pattern, PatternStr):
            words[t.name] = repr(t.pattern.value)
    return words


def _expected(names) -> str:
    words = _terminal_words()
    shown = sorted({words.get(n, n) for n in names or ()})
    if not shown:
        return "something else"
    if len(shown) == 1:
        return shown[0]
    return ", ".join(shown[:-1]) + " or " + shown[-1]


def _syntax_error(e: lark.exceptions.UnexpectedInput, source: str) -> DSLSyntaxError:
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        return DSLSyntaxError(f"{source}:{e.line}:{e.column}: expected {_expected(e.allowed)}, got {e.char!r}")
    token = getattr(e, "token", None)
    expected = getattr(e, "accepts", None) or getattr(e, "expected", None)
    if token is None or token.type == "$END":
        # lark places end of input on the last token; the reader wants the spot just after it
        line = getattr(token, "end_line", None) or e.line
        column = getattr(token, "end_column", None) or e.column
        return DSLSyntaxError(f"{source}:{line}:{column}: expected {_expected(expected)}, got end of input")
    return DSLSyntaxError(f"{source}:{e.line}:{e.column}: expected {_expected(expected)}, got {str(token)!r}")


def parse_tree(text: str, start: str, source: str) -> lark.Tree:
    """Parse DSL text from entry point `start` ("pipeline" or "rules")."""
    try:
        return _parser().parse(text, start=start)
    except lark.exceptions.UnexpectedInput as e:
        raise _syntax_error(e, source) from None


def where(source: str, token: lark.Token) -> str:
    """The `file:line:col: ` prefix of a message about `token`."""
    return f"{source}:{token.line}:{token.column}: "


class Literals(IRLiterals):
    """The IR's literals plus the pipeline's bare words (strings) and lists (tuples)."""

    def word(self, items):
        return str(items[0])

    list = IRLiterals.tuple


class _ToPipeline(Literals):
    def __init__(self, source: str, plugins: bool):
        super().__init__()
        self.source, self.plugins = source, plugins

    def param(self, items):
        return items[0], items[1]

    def params(self, items):
        seen = {}
        for key, value in (i for i in items if i is not None):
            if str(key) in seen:
                raise PipelineError(f"{where(self.source, key)}parameter {str(key)!r} is given twice")
            seen[str(key)] = value
        return seen

    def pass_ref(self, items):
        name, params = items
        w = where(self.source, name)
        return lookup(str(name), w, plugins=self.plugins).from_params(params or {}, w)

    def pipeline(self, items):
        return [p for p in items if p is not None]


def parse_pipeline(text: str, source: str = "<pipeline>", *, plugins: bool = False) -> list[Pass]:
    """Parse a pipeline string into pass instances; the empty string is the empty pipeline.

    Syntax errors raise DSLSyntaxError; an unknown pass or a bad parameter raises PipelineError.
    Both messages start with `source:line:col:`. `plugins`: a pass no one registered is looked up
    among the installed plugins and imported (trusted code: for the user's own pipelines, never for
    a pipeline someone else proposed).
    """
    tree = parse_tree(text, "pipeline", source)
    try:
        return _ToPipeline(source, plugins).transform(tree)
    except lark.exceptions.VisitError as e:
        raise e.orig_exc from None


def pass_names(text: str, source: str = "<pipeline>") -> list[str]:
    """The pass names a pipeline string holds, in order, without looking any of them up."""
    return [str(t) for t in parse_tree(text, "pipeline", source).scan_values(lambda v: getattr(v, "type", "") == "PASS_NAME")]
