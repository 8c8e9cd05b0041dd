"""The IR verifier: every pass must leave a program that passes it (the pass manager runs it).

It checks the op schemas (known ops, required attributes, allowed values), that each graph is a
DAG of the right level, the matmul shapes along edges, the step graph's internal agreement (the
verify length matches what the proposer emits; acceptance and commit fit the verify mode), that
the program fits the deployment's limits (`Limits`: a verify must fit the positions the models and
their caches hold; top-k and vocabulary subsets within the vocabulary), and that every choice it
holds is one a backend runs (`_run_problems`): an attribute the torch backend would ignore or
cannot run is an error here, so the cost model never prices what does not execute. Given the
program a pass started from, it also checks that the pass changed only choices (`fact_problems`):
shapes, names, ops and edges describe the checkpoint.

What the backend reads, attribute by attribute (tests/test_passes.py runs each):
  draft.block_size             the draft and verify loops' block (k for PARD)
  propose.shape/budget/topk    a tree proposal (tree loops, budget and top-k); a chain's budget is its block
  verify.mode, accept.rule,    chain or tree loops; rule and commit follow the mode (checked here);
  commit.kv                    "two-level" with verify.first/exit_layer: the tree loops, each drafted tree
                               pruned to q - 1 nodes by the first level (runtime/two_level.py)
  accept.on, schedule.graphs   together: graphed loops accept on the device (the cuda-graphs pass)
  schedule.policy/batch        "static" (batch 1: the batch-1 loops) or "continuous" (runtime/batch.py, up to
                               `batch` requests): chains or trees (two-level: any first level, its budget
                               batch-wide; a Gated DeltaNet hybrid's: the drafter level), no graphs yet
  schedule.verify_budget/      the batched engine's mechanisms (verify-budget, ragged-verify, spec-control):
  ragged/spec_control          only under policy "continuous"
  linear/lm_head format        the module serving the weight (bf16/fp16/fp32 cast, u12)
  linear/lm_head kernel/layout u12's kernel and plane layout: only on u12 weights
  lm_head vocab_subset/corpus  the drafter's head over a token subset (draft-vocab); not the target's
  rmsnorm/rope/mlp kernel      "triton-fused": the whole stack of that graph fused, or none of it
  attention kernel             "triton-split-kv" per attention layer
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..errors import SpecpilotError
from ..formats.u12 import tiles_fit
from .graph import LEVELS, Graph, Program
from .node import FUSED_OPS, MATMUL_OPS, OPS, SHARED, Node


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
    if verify["mode"] == "two-level":
        if not 2 <= verify["q"] <= want_q:
            problems.append(f"step/verify: q={verify['q']} but a two-level verify keeps 1..{want_q - 1} of the "
                            f"proposal's nodes plus the anchor (expected 2..{want_q})")
    elif verify["q"] != want_q:
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


@dataclass(frozen=True)
class Limits:
    """What a deployment can hold, read from its program.

    `positions` is the fewest positions the target and drafter hold (their max_position_embeddings,
    the program attribute `max_positions` lowering records; None for programs that do not say): a
    verify of q tokens needs q positions after at least one prompt token, a draft block as many.
    `vocab` is the target's vocabulary: the most ranks a tree can take a position and the largest
    token subset a drafter head can score."""

    positions: int | None
    vocab: int

    @property
    def max_tokens_a_step(self) -> int | None:
        return None if self.positions is None else self.positions - 1

    def why_tokens(self) -> str:
        return (f"the models hold {self.positions} positions (max_position_embeddings): at most "
                f"{self.max_tokens_a_step} tokens a step after one prompt token")


def limits(program: Program) -> Limits:
    vocab = max((program.target.node(n)["vocab"] for n in program.target.find("embed")), default=0)
    positions = program.attr("max_positions")
    return Limits(int(positions) if positions is not None else None, vocab)


def _limit_problems(program: Program) -> list[str]:
    lim, problems = limits(program), []
    draft, propose, verify = (program.step.one(op)[1] for op in ("draft", "propose", "verify"))
    if propose["budget"] < 1:
        problems.append(f"step/propose: budget={propose['budget']} must be >= 1")
    if "topk" in propose and not 1 <= propose["topk"] <= lim.vocab:
        problems.append(f"step/propose: topk={propose['topk']} out of range: expected 1..{lim.vocab} (the vocabulary)")
    most = lim.max_tokens_a_step
    if most is not None:
        drafted = draft["block_size"] + (1 if draft["kind"] == "pard" else 0)  # PARD's pass holds k + 1 tokens
        if drafted > most:
            problems.append(f"step/draft: block_size={draft['block_size']} out of range: at most "
                            f"{most - (1 if draft['kind'] == 'pard' else 0)} ({lim.why_tokens()})")
        if verify["q"] > most:
            problems.append(f"step/verify: q={verify['q']} out of range: at most {most} ({lim.why_tokens()})")
    return problems


def _run_problems(program: Program) -> list[str]:
    """Choices no backend runs (module docstring): refused rather than priced and ignored."""
    step, problems = program.step, []
    draft, propose, verify, accept = (step.one(op)[1] for op in ("draft", "propose", "verify", "accept"))
    schedule = step.node(step.find("schedule")[0]) if step.find("schedule") else None
    graphs = bool(schedule is not None and schedule.get("graphs"))
    recurrent = bool(program.target.find("gated_deltanet"))
    if verify["mode"] == "two-level":
        layers = len(program.target.find("attention")) + len(program.target.find("gated_deltanet"))
        if "first" not in verify:
            problems.append("step/verify: a two-level verify needs its first level (first=drafter, early-exit, "
                            "early-exit-drafter or early-exit-split; the two-level-verify pass sets it)")
        elif verify["first"] != "drafter" and not 1 <= verify.get("exit_layer", 0) < layers:
            problems.append(f"step/verify: exit_layer={verify.get('exit_layer')} out of range: the early-exit first "
                            f"level reads 1..{layers - 1} of the target's {layers} layers")
    elif "first" in verify or "exit_layer" in verify:
        problems.append(f"step/verify: first and exit_layer belong to a two-level verify, not mode {verify['mode']!r}")
    if propose["shape"] == "chain":
        drafts = draft["block_size"] - 1 if draft["kind"] == "dflash" else draft["block_size"]
        if propose["budget"] != drafts:
            problems.append(f"step/propose: a chain proposes what the drafter drafts: budget={propose['budget']} but a "
                            f"{draft['kind']} block of {draft['block_size']} drafts {drafts} (draft-block-size sets both)")
        if "topk" in propose:
            problems.append("step/propose: topk is for a tree proposal (a chain takes each position's top token)")
    else:
        if "topk" not in propose:
            problems.append("step/propose: a tree proposal needs topk, the ranks per position it builds from "
                            "(tree-verify sets it)")
    if accept["on"] == "device" and not graphs:
        problems.append("step/accept: on='device' runs only in graphed steps: set schedule graphs=true with it "
                        "(the cuda-graphs pass sets both); ungraphed loops accept on the host")
    if schedule is not None:
        batched = schedule["policy"] == "continuous"
        if schedule["batch"] < 1 or (not batched and schedule["batch"] != 1):
            problems.append(f"step/schedule: batch={schedule['batch']} under policy {schedule['policy']!r}: expected "
                            "1 (static) or >= 1 (continuous)")
        mechanisms = [a for a in ("verify_budget", "ragged", "spec_control") if schedule.get(a)]
        if mechanisms and not batched:
            problems.append(f"step/schedule: {', '.join(mechanisms)} run in the batched engine: expected policy "
                            "'continuous' (the passes set it)")
        if batched:
            if verify["mode"] == "two-level" and schedule.get("spec_control"):
                problems.append("step/schedule: spec_control chooses chain lengths; this program verifies two-level "
                                "trees (leave out spec-control)")
            if verify["mode"] == "tree" and (schedule.get("verify_budget") or schedule.get("spec_control")):
                problems.append("step/schedule: verify_budget and spec_control choose chain lengths; this program "
                                "verifies trees (leave out tree-verify, or those passes)")
            if graphs:
                problems.append("step/schedule: policy 'continuous' runs its steps ungraphed (no CUDA-graph buckets "
                                "yet): expected no graphs (leave out cuda-graphs)")
            if recurrent and verify["mode"] == "two-level" and verify.get("first", "drafter") != "drafter":
                problems.append(f"step/schedule: policy 'continuous' runs a Gated DeltaNet target's two-level verify "
                                f"with the drafter first level only, got first={verify['first']!r} (expected "
                                "first=drafter, or policy 'static')")
        if graphs and program.target.find("moe"):
            problems.append("step/schedule: graphs=true needs steps without host reads; this target's sparse MoE "
                            "layers read the experts each step routes to on the host (expected no graphs)")
    for graph in (program.target, program.drafter):
        stack = graph.find(None, lambda node: node.op in FUSED_OPS)
        fused = [n for n in stack if graph.node(n).get("kernel") == "triton-fused"]
        if fused and len(fused) != len(stack):
            problems.append(f"{graph.name}: the fused decoder stack is all or nothing: {len(fused)} of {len(stack)} "
                            f"rmsnorm/rope/mlp nodes have kernel 'triton-fused' (the backend fuses whole stacks; "
                            f"the fused-decoder pass marks every one)")
        if fused and graph.find("gated_deltanet"):
            problems.append(f"{graph.name}: kernel 'triton-fused' serves attention stacks; this graph has Gated "
                            f"DeltaNet layers (expected kernel 'torch')")
        for name, node in graph.items():
            where = f"{graph.name}/{name}"
            if node.op in MATMUL_OPS:
                if node["format"] == "u12" and node["dtype"] != "bfloat16":
                    problems.append(f"{where}: format 'u12' encodes bfloat16 weights; this weight is {node['dtype']}")
                if node["kernel"] == "triton-u12" and node["format"] != "u12":
                    problems.append(f"{where}: kernel 'triton-u12' runs u12 weights; this one is {node['format']} "
                                    f"(expected kernel 'torch')")
                if "layout" in node and node["format"] != "u12":
                    problems.append(f"{where}: layout is a u12 weight's plane layout; this weight is {node['format']}")
                elif node.get("layout") == "tiles" and not tiles_fit((node["out_features"], node["in_features"])):
                    problems.append(f"{where}: layout 'tiles' needs out_features % 16 == 0 and in_features % 64 == 0; "
                                    f"this weight is [{node['out_features']}, {node['in_features']}] (expected rows)")
            if node.op == "lm_head" and ("vocab_subset" in node or "vocab_corpus" in node):
                if graph.name != "drafter":
                    problems.append(f"{where}: vocab_subset is for the drafter's head (the target's head decides "
                                    f"the output tokens)")
                elif "vocab_subset" not in node:
                    problems.append(f"{where}: vocab_corpus without vocab_subset")
                elif not 1 <= node["vocab_subset"] <= node["out_features"]:
                    problems.append(f"{where}: vocab_subset={node['vocab_subset']} out of range: expected "
                                    f"1..{node['out_features']} (the vocabulary)")
    return problems


def fact_problems(before: Program, after: Program) -> list[str]:
    """What `after` changed beyond choices (OpSchema.choices): nodes, edges, ops, shapes, names and
    the program's attributes describe the checkpoint, and a backend loads the checkpoint, not the
    IR, so a pass that changes them makes the IR claim what does not run. A drafter node borrowing
    a target weight (`target/...`) runs the target's module: its format, kernel and layout are facts too."""
    problems = []
    if before.attrs != after.attrs:
        problems.append(f"program attributes changed from {dict(before.attrs)} to {dict(after.attrs)}")
    for level in LEVELS:
        b, a = before.graph(level), after.graph(level)
        gone, new = sorted(set(b.names()) - set(a.names())), sorted(set(a.names()) - set(b.names()))
        if gone:
            problems.append(f"{level}: nodes removed ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})")
        if new:
            problems.append(f"{level}: nodes added ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''})")
        for name in (n for n in b.names() if n in a):
            nb, na = b.node(name), a.node(name)
            where = f"{level}/{name}"
            if nb.op != na.op:
                problems.append(f"{where}: op changed from {nb.op} to {na.op}")
                continue
            if b.inputs(name) != a.inputs(name):
                problems.append(f"{where}: inputs changed from {b.inputs(name)} to {a.inputs(name)}")
            schema = OPS.get(nb.op)
            choices = set(schema.choices) if schema else set()
            borrowed = str(nb.get("weight", "")).startswith(SHARED)
            for key in sorted({k for k, _ in nb.items()} | {k for k, _ in na.items()}):
                old, now = nb.get(key, "(unset)"), na.get(key, "(unset)")
                if old == now:
                    continue
                if borrowed and key in ("format", "kernel", "layout"):
                    problems.append(f"{where}: {key} changed from {old!r} to {now!r}, but this node borrows the target's "
                                    f"weight {nb['weight']!r} and runs the target's module (set it on the target's node)")
                elif key not in choices:
                    allowed = ", ".join(sorted(choices)) or "nothing"
                    problems.append(f"{where}: {key} changed from {old!r} to {now!r}, but it describes the checkpoint "
                                    f"(passes may set only {allowed} on {nb.op} nodes)")
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
    if problems:
        return problems
    problems += _model_problems(program.target) + _model_problems(program.drafter)
    problems += _limit_problems(program) + _run_problems(program)
    t_vocab = {program.target.node(n)["vocab"] for n in program.target.find("embed")}
    d_heads = {program.drafter.node(n)["out_features"] for n in program.drafter.find("lm_head")}
    if d_heads and t_vocab and d_heads != t_vocab:
        problems.append(f"drafter: lm_head vocabulary {sorted(d_heads)} differs from the target's {sorted(t_vocab)}")
    return problems


def verify_program(program: Program, after: str = "", before: Program | None = None) -> Program:
    """Raise IRError listing every broken invariant; return the program unchanged otherwise.
    `before`, the program a pass started from: also check that the pass changed only choices."""
    problems = program_problems(program) + (fact_problems(before, program) if before is not None else [])
    if problems:
        ctx = f" after {after}" if after else ""
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise IRError(f"invalid IR{ctx}: {shown}")
    return program
