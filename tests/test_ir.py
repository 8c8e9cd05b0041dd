"""The IR: lowering, printer/parser round trip, structural hash, verifier."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.errors import CheckpointError, DSLSyntaxError
from specpilot.ir import IRError, Node, lower, parse_program, print_program, program_problems, verify_program
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
