"""The DSL (grammar/specpilot.lark): pass pipelines and declarative rewrite rules.

`parse_pipeline("draft-block-size{size=4},my-rules")` gives pass instances; `load_rules(path)`
registers each `pass NAME (lossless|lossy) { rule ... }` of a rules file as a pass. Nothing written
in the DSL is evaluated as Python.
"""

from .pipeline import parse_pipeline
from .rules import (
    And, Attr, Compare, Glob, Has, Member, NodeName, Not, Or, Pattern, Ref, RemoveNode, ReplaceNode,
    Rewrite, RewriteError, Rule, RulePass, RuleSet, SetAttrs, UnsetAttrs, load_rules, parse_rules, rule_pass,
)

__all__ = [
    "And", "Attr", "Compare", "Glob", "Has", "Member", "NodeName", "Not", "Or", "Pattern", "Ref",
    "RemoveNode", "ReplaceNode", "Rewrite", "RewriteError", "Rule", "RulePass", "RuleSet", "SetAttrs",
    "UnsetAttrs", "load_rules", "parse_pipeline", "parse_rules", "rule_pass",
]
