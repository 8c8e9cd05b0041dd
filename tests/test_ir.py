"""The IR: lowering, printer/parser round trip, structural hash, verifier."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.errors import CheckpointError, DSLSyntaxError
from specpilot.ir import (
    IRError, Limits, Node, fact_problems, limits, lower, parse_program, print_program, program_problems, verify_program,
)
from specpilot.ir.text import format_literal

TARGET = dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=True)
DFLASH = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=1e6, target_layer_ids=[0, 1], block_size=8, mask_token_id=299)
PARD = dict(TARGET, num_hidden_layers=1, pard_token=299, pard_k=4)


def test_lowering_builds_both_levels():
    p = lower(TARGET, DFLASH)
    assert [n for n, _ in p.step.items()] == ["draft", "propose", "verify", "accept", "commit", "schedule"]
    assert p.step.one("verify")[1]["q"] == 8  # anchor + 7 drafts
    linears = p.target.find("linear")
    assert len(linears) == 2 * 7  # q k v o gate up down per layer
    attn = p.target.node("layers.0.attention")
    assert attn["mask"] == "causal" and attn["qk_norm"] is True
    assert p.drafter.node("layers.0.attention")["mask"] == "block-noncausal"
    assert p.drafter.node("lm_head")["weight"] == "target/model.embed_tokens.weight"  # shared, tied


def test_pard_lowering_and_llama_family():
    p = lower(dict(TARGET, model_type="llama", tie_word_embeddings=False), dict(PARD, model_type="llama"))
    assert p.step.one("draft")[1]["kind"] == "pard"
    assert p.step.one("verify")[1]["q"] == 5  # last token + k=4 drafts
    assert p.target.node("lm_head")["weight"] == "lm_head.weight"
    assert p.target.node("layers.0.attention")["qk_norm"] is False


def test_round_trip_and_hash():
    p = lower(TARGET, DFLASH)
    text = print_program(p)
    q = parse_program(text)
    assert q == p
    assert print_program(q) == text
    assert q.structural_hash() == p.structural_hash()
    # the hash is stable across processes: it is a digest of the canonical text, pinned here
    assert p.structural_hash() == lower(TARGET, DFLASH).structural_hash()


def test_hash_changes_with_any_attribute():
    p = lower(TARGET, DFLASH)
    name, node = p.target.one("lm_head")
    changed = p.with_graph("target", p.target.with_node(name, node.replace(format="u12")))
    assert changed.structural_hash() != p.structural_hash()


@settings(max_examples=40, deadline=None)
@given(st.recursive(
    st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
              st.booleans()),
    lambda children: st.lists(children, max_size=3).map(tuple), max_leaves=6))
def test_literals_round_trip(value):
    p = lower(TARGET, DFLASH)
    # attach an arbitrary literal to a program attribute and read it back
    q = type(p)(p.step, p.target, p.drafter, attrs=(("x", value),))
    back = parse_program(print_program(q)).attr("x")
    assert back == value and format_literal(back) == format_literal(value)


def test_parse_error_has_line_and_column():
    text = print_program(lower(TARGET, DFLASH)).splitlines()
    text[3] = text[3].replace("=", "", 1)  # break line 4
    with pytest.raises(DSLSyntaxError, match=r"ir.txt:4:\d+"):
        parse_program("\n".join(text), source="ir.txt")


def test_verifier_catches_broken_programs():
    p = lower(TARGET, DFLASH)
    name, v = p.step.one("verify")
    bad = p.with_graph("step", p.step.with_node(name, v.replace(q=3)))
    assert any("q=3" in s for s in program_problems(bad))
    with pytest.raises(IRError, match="proposal needs q=8"):
        verify_program(bad)
    name, lin = "layers.0.q_proj", p.target.node("layers.0.q_proj")
    bad = p.with_graph("target", p.target.with_node(name, lin.replace(in_features=65)))
    assert any("in_features=65" in s for s in program_problems(bad))
    bad = p.with_graph("target", p.target.with_node(name, lin.replace(format="int3")))
    assert any("format='int3' not allowed" in s for s in program_problems(bad))
    bad = p.with_graph("target", p.target.with_node(name, Node.make("draft", kind="pard", block_size=2, drafter="x")))
    assert any("belongs in a step graph" in s for s in program_problems(bad))


def test_lowering_errors_name_the_file_and_field():
    with pytest.raises(CheckpointError, match="t.json: field 'model_type' is 'gpt2'"):
        lower(dict(TARGET, model_type="gpt2"), DFLASH, target_source="t.json")
    bad = dict(TARGET)
    del bad["hidden_size"]
    with pytest.raises(CheckpointError, match="missing field 'hidden_size'"):
        lower(bad, DFLASH)
    with pytest.raises(CheckpointError, match="'vocab_size' is 301; expected the target's vocabulary size 300"):
        lower(TARGET, dict(PARD, vocab_size=301))
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        lower(TARGET, dict(DFLASH, target_layer_ids=[0, 5]))
    with pytest.raises(CheckpointError, match="not a drafter config"):
        lower(TARGET, dict(TARGET))


HYBRID = dict(model_type="qwen3_next", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
              partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4)


def _with(program, level, op, **attrs):
    """Every `op` node of one graph with `attrs`, as a rule's `set` would leave it."""
    graph, _ = program.graph(level).map_nodes(lambda _, node: node.replace(**attrs) if node.op == op else None)
    return program.with_graph(level, graph)


def _first(program, level, op, **attrs):
    name = program.graph(level).find(op)[0]
    graph = program.graph(level)
    return program.with_graph(level, graph.with_node(name, graph.node(name).replace(**attrs)))


def _unset(program, level, op, key):
    graph, _ = program.graph(level).map_nodes(
        lambda _, node: Node(node.op, tuple(kv for kv in node.attrs if kv[0] != key)) if node.op == op else None)
    return program.with_graph(level, graph)


def _tree(p, budget=7, topk=2):
    p = _with(p, "step", "propose", shape="tree", budget=budget, topk=topk)
    p = _with(p, "step", "verify", mode="tree", q=budget + 1)
    return _with(_with(p, "step", "accept", rule="tree-path"), "step", "commit", kv="compact")


def _bf16(p):
    return lower(TARGET, DFLASH, dtype="bfloat16")


REFUSED = [
    # choices no backend runs: each refused with the node, the attribute and what is accepted
    ("two-level without its first level", lambda p: _with(_tree(p), "step", "verify", mode="two-level"),
     "step/verify: a two-level verify needs its first level"),
    ("an early exit past the target", lambda p: _with(_tree(p), "step", "verify", mode="two-level", first="early-exit",
                                                      exit_layer=9),
     "step/verify: exit_layer=9 out of range"),
    ("batching", lambda p: _with(p, "step", "schedule", batch=4),
     "step/schedule: batch=4 under policy 'static': expected 1 (static) or >= 1 (continuous)"),
    ("batched two-level under spec control", lambda p: _with(_with(_tree(p), "step", "verify", mode="two-level",
                                                                   first="drafter"), "step", "schedule",
                                                             policy="continuous", batch=4, spec_control=True),
     "step/schedule: spec_control chooses chain lengths; this program verifies two-level trees"),
    ("batched trees under a verify budget", lambda p: _with(_tree(p), "step", "schedule", policy="continuous", batch=4,
                                                            verify_budget=True),
     "step/schedule: verify_budget and spec_control choose chain lengths; this program verifies trees"),
    ("device accept alone", lambda p: _with(p, "step", "accept", on="device"),
     "step/accept: on='device' runs only in graphed steps"),
    ("graphs with a host accept", lambda p: _with(p, "step", "schedule", graphs=True),
     "graphs=true needs chain or tree verification and accept on the device"),
    ("a chain's own budget", lambda p: _with(p, "step", "propose", budget=3),
     "step/propose: a chain proposes what the drafter drafts: budget=3 but a dflash block of 8 drafts 7"),
    ("top-k on a chain", lambda p: _with(p, "step", "propose", topk=4), "step/propose: topk is for a tree proposal"),
    ("a tree without top-k", lambda p: _unset(_tree(p), "step", "propose", "topk"),
     "step/propose: a tree proposal needs topk"),
    ("u12 in float32", lambda p: _first(p, "target", "linear", format="u12"),
     "target/layers.0.q_proj: format 'u12' encodes bfloat16 weights; this weight is float32"),
    ("the u12 kernel on a plain weight", lambda p: _first(p, "target", "linear", kernel="triton-u12"),
     "target/layers.0.q_proj: kernel 'triton-u12' runs u12 weights; this one is float32 (expected kernel 'torch')"),
    ("a layout without u12", lambda p: _first(p, "target", "linear", layout="rows"),
     "target/layers.0.q_proj: layout is a u12 weight's plane layout"),
    ("tiles that do not tile", lambda p: _first(_bf16(p), "target", "lm_head", format="u12", layout="tiles"),
     "target/lm_head: layout 'tiles' needs out_features % 16 == 0 and in_features % 64 == 0; this weight is [300, 64]"),
    ("a subset of the target's head", lambda p: _with(p, "target", "lm_head", vocab_subset=10),
     "target/lm_head: vocab_subset is for the drafter's head"),
    ("a corpus without a subset", lambda p: _with(p, "drafter", "lm_head", vocab_corpus="stdlib"),
     "drafter/lm_head: vocab_corpus without vocab_subset"),
    ("a subset beyond the vocabulary", lambda p: _with(p, "drafter", "lm_head", vocab_subset=301),
     "drafter/lm_head: vocab_subset=301 out of range: expected 1..300"),
    ("half a fused stack", lambda p: _with(p, "target", "mlp", kernel="triton-fused"),
     "target: the fused decoder stack is all or nothing: 2 of 9 rmsnorm/rope/mlp nodes"),
    # the deployment's limits: a verify beyond the positions the models hold, top-k beyond the vocabulary
    ("a verify beyond the positions", lambda p: _with(_tree(p, budget=5000), "step", "draft", block_size=8),
     "step/verify: q=5001 out of range: at most 2047 (the models hold 2048 positions"),
    ("a block beyond the positions", lambda p: _with(_with(_with(p, "step", "draft", block_size=10**9), "step", "propose",
                                                          budget=10**9 - 1), "step", "verify", q=10**9),
     "step/draft: block_size=1000000000 out of range: at most 2047"),
    ("top-k beyond the vocabulary", lambda p: _tree(p, topk=301), "step/propose: topk=301 out of range: expected 1..300"),
]


@pytest.mark.parametrize("case, change, message", REFUSED, ids=[c[0] for c in REFUSED])
def test_the_verifier_refuses_what_no_backend_runs(case, change, message):
    p = lower(dict(TARGET, max_position_embeddings=2048), DFLASH)
    assert not program_problems(p)
    problems = program_problems(change(p))
    assert any(message in s for s in problems), problems
    with pytest.raises(IRError, match=re.escape(message)):
        verify_program(change(p))


@pytest.mark.parametrize("first", ["drafter", "early-exit", "early-exit-drafter", "early-exit-split"])
def test_every_first_level_is_batched(first):
    p = lower(dict(TARGET, max_position_embeddings=2048), DFLASH)
    level = {"first": first, **({"exit_layer": 1} if first != "drafter" else {})}
    batched = _with(_with(_tree(p), "step", "verify", mode="two-level", **level), "step", "schedule",
                    policy="continuous", batch=4)
    assert not program_problems(batched)


def _graphed(p):
    return _with(_with(p, "step", "accept", on="device"), "step", "schedule", graphs=True)


def test_a_hybrid_target_verifies_trees_in_graphed_steps_unless_it_routes_experts():
    assert not program_problems(_tree(lower(HYBRID, DFLASH)))
    assert not program_problems(_graphed(_tree(lower(HYBRID, DFLASH))))
    moe = lower(dict(HYBRID, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     shared_expert_intermediate_size=32), DFLASH)
    assert any("sparse MoE layers read the experts" in s for s in program_problems(_graphed(moe)))


@pytest.mark.parametrize("change, message", [
    (lambda p: _with(_with(_with(p, "target", "rmsnorm", kernel="triton-fused"), "target", "rope", kernel="triton-fused"),
                     "target", "mlp", kernel="triton-fused"),
     "target: kernel 'triton-fused' serves attention stacks; this graph has Gated DeltaNet layers"),
])
def test_a_hybrid_target_refuses_fused_stacks(change, message):
    p = lower(HYBRID, DFLASH)
    assert not program_problems(p)
    assert any(message in s for s in program_problems(change(p))), program_problems(change(p))


def test_passes_may_change_only_choices():
    p = lower(TARGET, DFLASH, dtype="bfloat16")
    assert fact_problems(p, _first(p, "target", "linear", format="u12", kernel="triton-u12")) == []
    mask = fact_problems(p, _first(p, "target", "attention", mask="tree"))
    assert mask == ["target/layers.0.attention: mask changed from 'causal' to 'tree', but it describes the checkpoint "
                    "(passes may set only kernel on attention nodes)"]
    borrowed = fact_problems(p, _with(p, "drafter", "lm_head", format="u12"))
    assert borrowed and "borrows the target's weight 'target/model.embed_tokens.weight'" in borrowed[0]
    attrs = type(p)(p.step, p.target, p.drafter, attrs=(*p.attrs[:-1], ("max_positions", 10**6)))
    assert fact_problems(p, attrs)[0].startswith("program attributes changed")
    with pytest.raises(IRError, match="after a-pass: target/layers.0.attention: mask changed"):
        verify_program(_first(p, "target", "attention", mask="tree"), after="a-pass", before=p)


def test_lowering_records_the_positions_the_models_hold():
    p = lower(dict(TARGET, max_position_embeddings=1024), dict(PARD, max_position_embeddings=4096))
    assert p.attr("max_positions") == 1024 and limits(p) == Limits(1024, 300)
