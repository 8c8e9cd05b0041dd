"""Declarative rewrite rules: the rule objects, the rewrite engine, and rules files as passes.

A rule is data: `Rule(name, levels, pattern, action)`. A `Pattern` matches a node by op, by a
predicate over its attributes and name, and optionally by patterns for its inputs; an action
rewrites the matched node (`SetAttrs`, `UnsetAttrs`, `ReplaceNode`) or bypasses it
(`RemoveNode`). A `RuleSet` runs its rules in order, each as one sweep over each graph it names,
in topological order; a node is rewritten at most once per rule, and every rewrite counts as a
hit of its rule. The same objects serve rules written in Python and rules parsed from a file.

Rules files (grammar/specpilot.lark, entry point `rules`) declare passes:

    # a comment
    pass lm-head-bf16 (lossy) "Store the lm_head weight in bfloat16." {
      rule lm-head-bf16:
        on target, drafter                  # optional; default: where the matched ops live
        match lm_head where format == "float32" and out_features >= 256
        set format = "bfloat16"
    }

Patterns:   `OP`, `OP|OP`, `*` (any op); then optionally the inputs by position,
            `linear(rmsnorm)`, `add(*, linear where format == "u12")`; then `where PREDICATE`.
Predicates: `KEY == value` (also != < <= > >=), `KEY in [v, ...]`, `KEY not in [...]`,
            `KEY ~ "glob"`, `name ~ "layers.*.mlp"` (the node's name; fnmatch), `has KEY`,
            `and`, `or`, `not`, parentheses. A test of an attribute the node lacks is false;
            values of different kinds (number, string, bool, list) are never equal or ordered.
Actions:    `set KEY = value, ...`; `unset KEY, ...`; `replace with OP {KEY = value, ...}` (new op
            and attributes, same inputs and users); `remove` (a node with exactly one input:
            its users read that input instead). A value is an IR literal or `$KEY`, the matched
            node's own attribute.

Nothing is evaluated as Python: predicates are interpreted from these objects, attribute names are
only ever looked up among a node's attributes, and comparisons go through a fixed table.
"""

from __future__ import annotations

import fnmatch
import operator
from collections import Counter
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import ClassVar, Union

import lark

from ..errors import DSLSyntaxError, PipelineError, SpecpilotError
from ..ir import LEVELS, OPS, Graph, IRError, Node, Program, fact_problems, program_problems
from ..ir.node import Literal
from ..passes.base import REGISTRY, Pass, PassResult, register
from ..passes.plugins import BUILT_IN, origin_of
from .pipeline import Literals, parse_tree, where


class RewriteError(IRError):
    """A rule matched a node it cannot rewrite (e.g. `remove` on a node with two inputs)."""


_MISSING = object()


# ----------------------------------------------------------------------------- operands, subjects


@dataclass(frozen=True)
class Ref:
    """`$key`: the matched node's attribute `key`."""

    key: str

    def __str__(self) -> str:
        return f"${self.key}"


Operand = Union[Literal, Ref]


def _resolve(operand: Operand, node: Node):
    return node.get(operand.key, _MISSING) if isinstance(operand, Ref) else operand


@dataclass(frozen=True)
class Attr:
    """An attribute of the node under test."""

    key: str

    def read(self, name: str, node: Node):
        return node.get(self.key, _MISSING)


@dataclass(frozen=True)
class NodeName:
    """The name of the node under test (`name` in the DSL)."""

    def read(self, name: str, node: Node):
        return name


Subject = Union[Attr, NodeName]


# ----------------------------------------------------------------------------- predicates


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__  # str, tuple


def _equal(a, b) -> bool:
    if _kind(a) != _kind(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _ordered(test):
    def compare(a, b) -> bool:
        return _kind(a) == _kind(b) and _kind(a) in ("number", "str") and test(a, b)

    return compare


_COMPARISONS = {
    "==": _equal,
    "!=": lambda a, b: not _equal(a, b),
    "<": _ordered(operator.lt),
    "<=": _ordered(operator.le),
    ">": _ordered(operator.gt),
    ">=": _ordered(operator.ge),
}


@dataclass(frozen=True)
class Compare:
    subject: Subject
    op: str  # one of _COMPARISONS
    operand: Operand

    def __post_init__(self):
        if self.op not in _COMPARISONS:
            raise ValueError(f"unknown comparison {self.op!r} (expected one of {', '.join(_COMPARISONS)})")

    def holds(self, name: str, node: Node) -> bool:
        a, b = self.subject.read(name, node), _resolve(self.operand, node)
        return a is not _MISSING and b is not _MISSING and _COMPARISONS[self.op](a, b)


@dataclass(frozen=True)
class Glob:
    subject: Subject
    pattern: str

    def holds(self, name: str, node: Node) -> bool:
        value = self.subject.read(name, node)
        return isinstance(value, str) and fnmatch.fnmatchcase(value, self.pattern)


@dataclass(frozen=True)
class Member:
    subject: Subject
    values: tuple
    negated: bool = False

    def holds(self, name: str, node: Node) -> bool:
        value = self.subject.read(name, node)
        if value is _MISSING:
            return False
        return any(_equal(value, v) for v in self.values) != self.negated


@dataclass(frozen=True)
class Has:
    key: str

    def holds(self, name: str, node: Node) -> bool:
        return self.key in node


@dataclass(frozen=True)
class And:
    parts: tuple

    def holds(self, name: str, node: Node) -> bool:
        return all(p.holds(name, node) for p in self.parts)


@dataclass(frozen=True)
class Or:
    parts: tuple

    def holds(self, name: str, node: Node) -> bool:
        return any(p.holds(name, node) for p in self.parts)


@dataclass(frozen=True)
class Not:
    part: object

    def holds(self, name: str, node: Node) -> bool:
        return not self.part.holds(name, node)


Predicate = Union[Compare, Glob, Member, Has, And, Or, Not]


# ----------------------------------------------------------------------------- patterns


@dataclass(frozen=True)
class Pattern:
    """Nodes whose op is one of `ops` (any if empty), for which `predicate` holds, and whose
    inputs match `inputs` position by position (None: any inputs; (): no inputs)."""

    ops: tuple[str, ...] = ()
    predicate: Predicate | None = None
    inputs: tuple["Pattern", ...] | None = None

    def matches(self, graph: Graph, name: str) -> bool:
        node = graph.node(name)
        if self.ops and node.op not in self.ops:
            return False
        if self.predicate is not None and not self.predicate.holds(name, node):
            return False
        if self.inputs is None:
            return True
        srcs = graph.inputs(name)
        return len(srcs) == len(self.inputs) and all(p.matches(graph, s) for p, s in zip(self.inputs, srcs))

    def all_ops(self) -> set[str]:
        ops = set(self.ops)
        for p in self.inputs or ():
            ops |= p.all_ops()
        return ops


# ----------------------------------------------------------------------------- actions
# Each action edits `graph` in place: the rule set's own fresh copy, never the caller's graph.


def _assigned(assigns, node: Node, context: str) -> dict:
    values = {}
    for key, operand in assigns:
        value = _resolve(operand, node)
        if value is _MISSING:
            raise RewriteError(f"{context}: the node has no attribute {operand.key!r} (read as {operand})")
        values[key] = value
    return values


def _put(graph: Graph, name: str, new: Node) -> bool:
    if new == graph.node(name):
        return False
    graph.dag.nodes[name]["node"] = new
    return True


@dataclass(frozen=True)
class SetAttrs:
    """Set attributes of the matched node (adding any it lacks)."""

    assigns: tuple[tuple[str, Operand], ...]

    def rewrite(self, graph: Graph, name: str, context: str) -> bool:
        node = graph.node(name)
        return _put(graph, name, node.replace(**_assigned(self.assigns, node, context)))


@dataclass(frozen=True)
class UnsetAttrs:
    """Drop attributes of the matched node (those it lacks are ignored)."""

    keys: tuple[str, ...]

    def rewrite(self, graph: Graph, name: str, context: str) -> bool:
        node = graph.node(name)
        return _put(graph, name, Node(node.op, tuple((k, v) for k, v in node.attrs if k not in self.keys)))


@dataclass(frozen=True)
class ReplaceNode:
    """Replace the matched node by a node of op `op` with exactly these attributes; it keeps the
    name, the inputs and the users."""

    op: str
    assigns: tuple[tuple[str, Operand], ...]

    def rewrite(self, graph: Graph, name: str, context: str) -> bool:
        return _put(graph, name, Node.make(self.op, **_assigned(self.assigns, graph.node(name), context)))


@dataclass(frozen=True)
class RemoveNode:
    """Bypass the matched node: it must have exactly one input, which its users then read in its
    place (at the same input position)."""

    def rewrite(self, graph: Graph, name: str, context: str) -> bool:
        srcs = graph.inputs(name)
        if len(srcs) != 1:
            raise RewriteError(f"{context}: remove needs a node with exactly one input, it has {len(srcs)}")
        (src,) = srcs
        for user in graph.users(name):
            if graph.dag.has_edge(src, user):
                raise RewriteError(f"{context}: its user {user!r} already reads {src!r}")
        graph.bypass(name)
        return True


Action = Union[SetAttrs, UnsetAttrs, ReplaceNode, RemoveNode]


# ----------------------------------------------------------------------------- rules and rule sets


def _fits(op: str, level: str) -> bool:
    return OPS[op].level == ("step" if level == "step" else "model")


@dataclass(frozen=True)
class Rule:
    """Rewrite nodes of the graphs `levels` that match `pattern` with `action`.

    `where` is the rule's place in its file (`file:line:col`), for messages; it is part of the
    rule's identity so that a rules file edited in place reloads with fresh positions."""

    name: str
    levels: tuple[str, ...]
    pattern: Pattern
    action: Action
    where: str = ""

    def __post_init__(self):
        bad = [lv for lv in self.levels if lv not in LEVELS]
        if bad or not self.levels:
            raise ValueError(f"rule {self.name!r}: levels must be among {', '.join(LEVELS)}, got {list(self.levels)}")
        ops = self.pattern.all_ops()
        if isinstance(self.action, ReplaceNode):
            ops.add(self.action.op)
        unknown = sorted(op for op in ops if op not in OPS)
        if unknown:
            raise ValueError(f"rule {self.name!r}: unknown op(s) {', '.join(map(repr, unknown))}")
        for op in sorted(self.pattern.all_ops()):
            if not any(_fits(op, lv) for lv in self.levels):
                raise ValueError(f"rule {self.name!r}: op {op!r} is never in the {'/'.join(self.levels)} graph(s)")
        if isinstance(self.action, ReplaceNode):
            bad = [lv for lv in self.levels if not _fits(self.action.op, lv)]
            if bad:
                raise ValueError(f"rule {self.name!r}: op {self.action.op!r} cannot be placed in the "
                                 f"{'/'.join(bad)} graph(s); name the levels with `on`")

    def sweep(self, graph: Graph, hits: Counter) -> None:
        """Rewrite `graph` in place: one pass over its nodes as they stood before the sweep."""
        for name in graph.names():
            if name in graph and self.pattern.matches(graph, name):
                context = f"{self.where + ': ' if self.where else ''}rule {self.name!r} on {graph.name}/{name}"
                if self.action.rewrite(graph, name, context):
                    hits[self.name] += 1


def default_levels(pattern: Pattern) -> tuple[str, ...]:
    """The levels a rule without `on` runs on: those where its pattern's ops live (all for `*`)."""
    if not pattern.ops:
        return LEVELS
    return tuple(lv for lv in LEVELS if any(_fits(op, lv) for op in pattern.ops))


@dataclass(frozen=True)
class Rewrite:
    """What a rule set did: the new program, whether it differs from the old one, and the hits
    (rewrites) per rule, every rule listed."""

    program: Program
    changed: bool
    hits: dict[str, int]

    def summary(self) -> str:
        if not any(self.hits.values()):
            return "no rule matched"
        text = ", ".join(f"{name}: {n} rewrite{'s' * (n != 1)}" for name, n in self.hits.items() if n)
        return text if self.changed else text + " (no net change)"


@dataclass(frozen=True)
class RuleSet:
    """Rules applied in order, each as a single sweep (no fixpoint): deterministic and bounded."""

    rules: tuple[Rule, ...] = ()

    def __add__(self, other: "RuleSet") -> "RuleSet":
        return RuleSet(self.rules + other.rules)

    def run(self, program: Program) -> Rewrite:
        hits = Counter({r.name: 0 for r in self.rules})
        graphs = {}
        for rule in self.rules:
            for level in rule.levels:
                if level not in graphs:
                    graphs[level] = program.graph(level).copy()
                rule.sweep(graphs[level], hits)
        changed = False
        for level, graph in graphs.items():
            if graph != program.graph(level):  # hits that cancel out leave the program as it was
                program, changed = program.with_graph(level, graph), True
        return Rewrite(program, changed, dict(hits))


# ----------------------------------------------------------------------------- rule sets as passes


class RulePass(Pass):
    """A pass made of a rule set (from a rules file, or `rule_pass` in Python); no parameters.

    A frozen dataclass without fields of its own. Its subclasses are made with `type()`, not by
    the dataclass decorator (which generates code with `exec`): loading rules runs no code."""

    rules: ClassVar[RuleSet] = RuleSet()
    source: ClassVar[str] = ""

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def apply(self, program: Program) -> PassResult:
        result = self.rules.run(program)
        return PassResult(result.program, result.changed, result.summary())

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        """[cls()] if the rules change this program, leave it valid and change only choices, else []."""
        try:
            result = cls.rules.run(program)
        except RewriteError:
            return []
        valid = not program_problems(result.program) and not fact_problems(program, result.program)
        return [cls()] if result.changed and valid else []


def _class_name(pass_name: str) -> str:
    return "".join(part.capitalize() for part in pass_name.split("-")) + "Rules"


def _same(a: type[Pass], b: type[Pass]) -> bool:
    return (a.rules, a.lossless, a.source, a.__doc__) == (b.rules, b.lossless, b.source, b.__doc__)


def _make_pass(name: str, rules: RuleSet, lossless: bool, doc: str, source: str) -> type[RulePass]:
    namespace = {"name": name, "lossless": lossless, "rules": rules, "source": source,
                 "__doc__": doc or f"Rules pass {name!r} from {source}.", "__module__": __name__}
    return type(_class_name(name), (RulePass,), namespace)


def _install(classes: list[type[RulePass]], at: dict[str, str]) -> list[type[Pass]]:
    """Register rule passes; the same definitions loaded again give back the classes already
    registered, a changed definition from the same source replaces its old class."""
    for cls in classes:
        old = REGISTRY.get(cls.name)
        if old is not None and not (issubclass(old, RulePass) and old.source == cls.source):
            origin = (f"the rules in {old.source}" if issubclass(old, RulePass)
                      else "a built-in pass" if origin_of(old) == BUILT_IN else f"the {origin_of(old)} pass")
            raise PipelineError(f"{at[cls.name]}pass {cls.name!r} is already defined by {origin}")
    installed = []
    for cls in classes:
        old = REGISTRY.get(cls.name)
        if old is not None and _same(old, cls):
            installed.append(old)
            continue
        REGISTRY.pop(cls.name, None)
        installed.append(register(cls))
    return installed


def rule_pass(name: str, rules: RuleSet, *, lossless: bool, doc: str = "", source: str = "<python>") -> type[Pass]:
    """Register rules written in Python as a pass, exactly as a rules file would."""
    return _install([_make_pass(name, rules, lossless, doc, source)], {name: f"{source}: "})[0]


# ----------------------------------------------------------------------------- rules files


class _ToRules(Literals):
    """Parse tree -> rule objects. Checks what the grammar cannot: known ops, levels, names."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def _fail(self, token, message: str):
        raise DSLSyntaxError(f"{where(self.source, token)}{message}")

    # -- predicates
    def attr(self, items):
        return Attr(str(items[0]))

    def node_name(self, _):
        return NodeName()

    def ref(self, items):
        return Ref(str(items[0])[1:])

    def compare(self, items):
        subject, op, operand = items
        return Compare(subject, str(op), operand)

    def glob(self, items):
        return Glob(items[0], self.string([items[1]]))

    def member(self, items):
        return Member(items[0], items[1])

    def not_member(self, items):
        return Member(items[0], items[1], negated=True)

    def has(self, items):
        return Has(str(items[0]))

    def any_of(self, items):
        return Or(tuple(p for i in items for p in (i.parts if isinstance(i, Or) else (i,))))

    def all_of(self, items):
        return And(tuple(p for i in items for p in (i.parts if isinstance(i, And) else (i,))))

    def negate(self, items):
        return Not(items[0])

    # -- patterns
    def op_set(self, items):
        for token in items:
            if str(token) not in OPS:
                self._fail(token, f"unknown op {str(token)!r} (ops: {', '.join(sorted(OPS))})")
        return tuple(dict.fromkeys(str(t) for t in items))

    def any_op(self, _):
        return ()

    def inputs(self, items):
        return tuple(i for i in items if i is not None)

    def pattern(self, items):
        ops, inputs, predicate = items
        return Pattern(ops, predicate, inputs)

    # -- actions
    def assign(self, items):
        return items[0], items[1]

    def _assigns(self, items):
        seen = {}
        for key, value in (i for i in items if i is not None):
            if str(key) in seen:
                self._fail(key, f"attribute {str(key)!r} is assigned twice")
            seen[str(key)] = value
        return tuple(seen.items())

    def set_attrs(self, items):
        return SetAttrs(self._assigns(items))

    def unset_attrs(self, items):
        return UnsetAttrs(tuple(dict.fromkeys(str(k) for k in items)))

    def replace_node(self, items):
        op = items[0]
        if str(op) not in OPS:
            self._fail(op, f"unknown op {str(op)!r} (ops: {', '.join(sorted(OPS))})")
        return ReplaceNode(str(op), self._assigns(items[1:]))

    def remove_node(self, _):
        return RemoveNode()

    # -- rules and passes
    def levels(self, items):
        named = {str(t) for t in items}
        return tuple(lv for lv in LEVELS if lv in named)

    def rule_def(self, items):
        name, levels, pattern, action = items
        try:
            return Rule(str(name), levels or default_levels(pattern), pattern, action,
                        where=f"{self.source}:{name.line}:{name.column}")
        except ValueError as e:
            self._fail(name, str(e))

    def pass_def(self, items):
        name, contract, doc, *rules = items
        seen = set()
        for rule in rules:
            if rule.name in seen:
                raise DSLSyntaxError(f"{rule.where}: rule {rule.name!r} is defined twice in pass {str(name)!r}")
            seen.add(rule.name)
        text = self.string([doc]) if doc is not None else ""
        return name, _make_pass(str(name), RuleSet(tuple(rules)), str(contract) == "lossless", text, self.source)

    def rules(self, items):
        seen = {}
        for token, cls in items:
            if cls.name in seen:
                self._fail(token, f"pass {cls.name!r} is defined twice")
            seen[cls.name] = (token, cls)
        return list(seen.values())


def _parse(text: str, source: str) -> list[tuple[lark.Token, type[RulePass]]]:
    tree = parse_tree(text, "rules", source)
    try:
        return _ToRules(source).transform(tree)
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, SpecpilotError):
            raise e.orig_exc from None
        raise


def parse_rules(text: str, source: str = "<rules>") -> list[type[RulePass]]:
    """Parse a rules file into pass classes without registering them."""
    return [cls for _, cls in _parse(text, source)]


def load_rules(path_or_text: str | Path, source: str | None = None) -> list[type[Pass]]:
    """Parse a rules file (a path, or the text itself) and register each of its passes.

    A `Path`, or a one-line string without `{`, is read as a file name. Loading the same rules
    again is idempotent; a pass name already taken by a built-in pass, or by another rules
    source, raises PipelineError naming this file. Errors carry `source:line:col`.
    """
    is_path = isinstance(path_or_text, Path) or (
        "\n" not in path_or_text and "{" not in path_or_text and path_or_text.strip() != "")
    if is_path:
        path = Path(path_or_text)
        source = source or str(path)
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise PipelineError(f"{source}: not UTF-8 text (byte {e.start}); expected a rules file") from None
        except OSError as e:
            raise PipelineError(f"{source}: cannot read rules file ({e.strerror or e})") from None
    else:
        text, source = path_or_text, source or "<rules>"
    parsed = _parse(text, source)
    return _install([cls for _, cls in parsed], {cls.name: where(source, token) for token, cls in parsed})
