"""The grammars of specpilot, shipped as package data (`specpilot.grammar`)."""

from importlib.resources import files


def grammar_text(name: str) -> str:
    """The text of grammar file `name` (e.g. "ir.lark")."""
    return (files(__name__) / name).read_text()
