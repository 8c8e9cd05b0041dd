"""The IR containers: `Graph` (one level, a DAG of named nodes) and `Program` (the deployment).

A `Graph` wraps a `networkx.DiGraph`; each vertex carries a frozen `Node` and each edge the
position of its input. Passes treat graphs as values: every edit returns a new graph.
A `Program` holds the three graphs of a deployment: the step graph and the target and drafter
model graphs. Its structural hash is the hash of its canonical text (see `specpilot.ir.text`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import networkx as nx

from .node import Node

LEVELS = ("step", "target", "drafter")


class Graph:
    """One level of the IR. Names are unique; iteration order is a stable topological order."""

    def __init__(self, name: str, dag: nx.DiGraph | None = None):
        self.name = name
        self._g = dag if dag is not None else nx.DiGraph()
        self._names: list[str] | None = None  # the topological order, kept until the structure changes

    # -- building (used by lowering and by passes on their own fresh copies)
    def add(self, name: str, node: Node, inputs: Iterable[str] = ()) -> str:
        if name in self._g:
            raise ValueError(f"graph {self.name}: node {name!r} already exists")
        self._names = None
        self._g.add_node(name, node=node, order=self._g.number_of_nodes())
        for index, src in enumerate(inputs):
            if src not in self._g:
                raise ValueError(f"graph {self.name}: input {src!r} of {name!r} does not exist")
            self._g.add_edge(src, name, index=index)
        return name

    def bypass(self, name: str) -> str:
        """Remove `name`, a node with exactly one input, in place: its users read that input instead,
        at the same input positions. Returns the input's name."""
        (src,) = self.inputs(name)
        users = [(u, self._g.edges[name, u]["index"]) for u in self.users(name)]
        self._names = None
        self._g.remove_node(name)
        for user, index in users:
            self._g.add_edge(src, user, index=index)
        return src

    # -- reading
    def __contains__(self, name: str) -> bool:
        return name in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def node(self, name: str) -> Node:
        return self._g.nodes[name]["node"]

    def inputs(self, name: str) -> list[str]:
        preds = self._g.in_edges(name, data="index")
        return [src for src, _, _ in sorted(preds, key=lambda e: e[2])]

    def users(self, name: str) -> list[str]:
        return sorted(self._g.successors(name), key=lambda n: self._g.nodes[n]["order"])

    def names(self) -> list[str]:
        if self._names is None:
            order = nx.get_node_attributes(self._g, "order")
            self._names = list(nx.lexicographical_topological_sort(self._g, key=lambda n: order[n]))
        return list(self._names)

    def items(self) -> Iterator[tuple[str, Node]]:
        for name in self.names():
            yield name, self.node(name)

    def find(self, op: str | None = None, where: Callable[[Node], bool] | None = None) -> list[str]:
        """Names of the nodes with this op (any op if None) for which `where` holds."""
        return [n for n, node in self.items() if (op is None or node.op == op) and (where is None or where(node))]

    def one(self, op: str) -> tuple[str, Node]:
        found = self.find(op)
        if len(found) != 1:
            raise KeyError(f"graph {self.name}: expected exactly one {op!r} node, found {len(found)}")
        return found[0], self.node(found[0])

    @property
    def dag(self) -> nx.DiGraph:
        """The networkx graph underneath, to read; change the structure through `add` and `bypass`."""
        return self._g

    # -- editing (returns new graphs)
    def copy(self) -> "Graph":
        g = Graph(self.name, self._g.copy())
        g._names = self._names
        return g

    def with_node(self, name: str, node: Node) -> "Graph":
        """A copy with the payload of `name` replaced."""
        g = self.copy()
        g._g.nodes[name]["node"] = node
        return g

    def map_nodes(self, fn: Callable[[str, Node], Node | None]) -> tuple["Graph", int]:
        """A copy where each node becomes fn(name, node) (None keeps it); returns (graph, #changed)."""
        g = self.copy()
        changed = 0
        for name, node in self.items():
            new = fn(name, node)
            if new is not None and new != node:
                g._g.nodes[name]["node"] = new
                changed += 1
        return g, changed

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Graph) or self.name != other.name:
            return False
        if self.names() != other.names():
            return False
        return all(
            self.node(n) == other.node(n) and self.inputs(n) == other.inputs(n) for n in self.names()
        )

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self)} nodes)"


@dataclass(frozen=True)
class Program:
    """A deployment in IR form: the step graph plus the target and drafter model graphs."""

    step: Graph
    target: Graph
    drafter: Graph
    attrs: tuple[tuple[str, Any], ...] = field(default=())

    def graphs(self) -> list[Graph]:
        return [self.step, self.target, self.drafter]

    def graph(self, level: str) -> Graph:
        if level not in LEVELS:
            raise KeyError(f"no IR level {level!r}; levels are {', '.join(LEVELS)}")
        return getattr(self, level)

    def with_graph(self, level: str, graph: Graph) -> "Program":
        parts = {lv: self.graph(lv) for lv in LEVELS}
        parts[level] = graph
        return Program(**parts, attrs=self.attrs)

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    def structural_hash(self) -> str:
        from .text import print_program

        return hashlib.sha256(print_program(self).encode()).hexdigest()[:16]

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Program) and self.attrs == other.attrs and all(
            a == b for a, b in zip(self.graphs(), other.graphs())
        )

    __hash__ = None  # graphs are mutable containers underneath; use structural_hash()
