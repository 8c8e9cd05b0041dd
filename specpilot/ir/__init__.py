"""The graph IR: step graph and model graphs, printer/parser, structural hash, verifier, lowering."""

from .graph import LEVELS, Graph, Program
from .lower import lower
from .node import MATMUL_OPS, OPS, Node
from .text import parse_program, print_program
from .verify import IRError, Limits, fact_problems, limits, program_problems, verify_program

__all__ = [
    "LEVELS", "MATMUL_OPS", "OPS", "Graph", "IRError", "Limits", "Node", "Program", "fact_problems", "limits", "lower",
    "parse_program", "print_program", "program_problems", "verify_program",
]
