"""The DSL: pipeline strings, rules files, the rewrite engine, and that nothing in it runs as Python."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.dsl import (
    Attr, Compare, Pattern, RemoveNode, RewriteError, Rule, RuleSet, SetAttrs, load_rules, parse_pipeline,
    parse_rules, rule_pass,
)
from specpilot.errors import DSLSyntaxError, PipelineError
from specpilot.ir import IRError, lower, print_program, verify_program
from specpilot.passes import REGISTRY, Pass, pipeline_string, register, run_passes
from specpilot.passes.block_size import DraftBlockSize
from specpilot.passes.cuda_graphs import CudaGraphs

TARGET = dict(model_type="qwen3", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=True)
DFLASH = dict(model_type="qwen3", rope_theta=1e6, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, target_layer_ids=[0, 1], block_size=8, mask_token_id=299)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rules" / "lm_head_bf16.rules"

LM_HEAD_RULES = """\
# the sketch from the issue, in the final syntax
pass keep-lm-head-bf16 (lossy) "Store the lm_head in bfloat16." {
  rule lm-head-bf16:
    on target, drafter
    match lm_head where format == "float32" and out_features >= 256 and not weight ~ "target/*"
    set format = "bfloat16", kernel = "torch"
}
pass graphed-steps (lossless) {
  rule device-accept:
    on step
    match accept where on == "host"
    set on = "device"
  rule graphs:
    match schedule where not has graphs or graphs == false
    set graphs = true
}
"""


@pytest.fixture(autouse=True)
def registry():
    """Rule passes registered by a test do not leak into other tests."""
    saved = dict(REGISTRY)
    yield REGISTRY
    REGISTRY.clear()
    REGISTRY.update(saved)


@pytest.fixture(scope="module")
def program():
    return lower(TARGET, DFLASH)


@dataclass(frozen=True)
class Knobs(Pass):
    """A pass with one parameter of each literal type, to test pipeline values."""

    name = "test-knobs"
    n: int = 1
    ratio: float = 0.5
    mode: str = "auto"
    flag: bool = False
    ids: tuple = ()


@pytest.fixture
def knobs():
    return register(Knobs)


# ----------------------------------------------------------------------------- pipelines


def test_empty_pipeline():
    assert parse_pipeline("") == []
    assert parse_pipeline("  \n\t ") == []


def test_pipeline_values(knobs):
    [p] = parse_pipeline('test-knobs{n=-3, ratio=1e-3, mode=two-level, flag=true, ids=[0, 2, "x", auto]}')
    assert p == Knobs(n=-3, ratio=0.001, mode="two-level", flag=True, ids=(0, 2, "x", "auto"))
    assert parse_pipeline('test-knobs{mode="two-level"}') == parse_pipeline("test-knobs{mode=two-level}")
    assert parse_pipeline("test-knobs{ratio=2}")[0].ratio == 2.0  # ints widen to float parameters
    assert parse_pipeline("test-knobs{}, test-knobs") == [Knobs(), Knobs()]
    for p in [Knobs(), Knobs(n=7, ratio=-0.25, mode="a b", flag=True, ids=(1, "two", 3.5))]:
        assert parse_pipeline(pipeline_string([p])) == [p]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 512), max_size=6), st.lists(st.sampled_from(["", " ", "\n", "\t", "  \n  "]), min_size=6, max_size=6))
def test_pipeline_round_trip(sizes, ws):
    a, b, c, d, e, f = ws
    text = ",".join(f"{a}draft-block-size{b}{{{c}size{d}={e}{s}{f}}}{a}" for s in sizes)
    passes = parse_pipeline(text)
    assert passes == [DraftBlockSize(size=s) for s in sizes]
    assert parse_pipeline(pipeline_string(passes)) == passes


@pytest.mark.parametrize("text, line, col, expected, got", [
    ("draft-block-size{size=4", 1, 24, "expected ',' or '}'", "got end of input"),
    ("draft-block-size{size=4},\n  draft-block-size{size=@}", 2, 25, "expected", "got '@'"),
    ("draft-block-size,,draft-block-size", 1, 18, "expected a pass name", "got ','"),
    ("draft-block-size{size=4}\n\n  draft-block-size", 3, 3, "expected ','", "got 'draft-block-size'"),
    ("draft-block-size{\n  size 4}", 2, 8, "expected '='", "got '4'"),
])
def test_pipeline_syntax_errors_carry_line_and_column(text, line, col, expected, got):
    with pytest.raises(DSLSyntaxError) as info:
        parse_pipeline(text, source="spec.yaml")
    message = str(info.value)
    assert message.startswith(f"spec.yaml:{line}:{col}: ")
    assert expected in message and got in message and "\n" not in message


def test_unknown_pass_and_bad_parameters():
    with pytest.raises(PipelineError, match=r"<pipeline>:2:3: unknown pass 'weights-u13'"):
        parse_pipeline("draft-block-size{size=4},\n  weights-u13")
    with pytest.raises(PipelineError, match="'draft-block-size'.*'size' expects int, got \"big\""):
        parse_pipeline('draft-block-size{size="big"}')
    with pytest.raises(PipelineError, match="'draft-block-size'.*'size' expects int, got 1.5"):
        parse_pipeline("draft-block-size{size=1.5}")
    with pytest.raises(PipelineError, match="'draft-block-size'.*'size' expects int, got true"):
        parse_pipeline("draft-block-size{size=true}")
    with pytest.raises(PipelineError, match="'draft-block-size' has no parameter 'budget'"):
        parse_pipeline("draft-block-size{budget=4}")
    with pytest.raises(PipelineError, match="size must be >= 1"):
        parse_pipeline("draft-block-size{size=0}")
    with pytest.raises(PipelineError, match="1:26: parameter 'size' is given twice"):
        parse_pipeline("draft-block-size{size=4, size=5}")


# ----------------------------------------------------------------------------- predicates and patterns


def matched(program, pattern: str, level: str = "target") -> list[str]:
    """Names of the `level` nodes that `match <pattern>` selects."""
    [cls] = parse_rules(f"pass t (lossless) {{ rule r: on {level} match {pattern} remove }}")
    pat = cls.rules.rules[0].pattern
    graph = program.graph(level)
    return [name for name in graph.names() if pat.matches(graph, name)]


@pytest.mark.parametrize("pattern, expected", [
    ("lm_head", ["lm_head"]),
    ('* where name == "norm"', ["norm"]),
    ('linear where name ~ "layers.1.*_proj" and out_features > 64', ["layers.1.gate_proj", "layers.1.up_proj"]),
    ('linear where out_features >= 64 and not name ~ "layers.0.*" and in_features < 128',
     ["layers.1.q_proj", "layers.1.o_proj", "layers.1.gate_proj", "layers.1.up_proj"]),
    ('linear where name ~ "*.[kv]_proj" and name ~ "layers.0.*"', ["layers.0.k_proj", "layers.0.v_proj"]),
    ("* where has qk_norm", ["layers.0.attention", "layers.1.attention"]),
    ("attention where qk_norm == true", ["layers.0.attention", "layers.1.attention"]),
    ("attention where qk_norm == 1", []),                      # a bool is not a number
    ('rmsnorm|rope where theta == 1000000 or weight == "model.norm.weight"',
     ["layers.0.rope", "layers.1.rope", "norm"]),              # 1000000 == 1e6: numbers compare as numbers
    ('* where format in ["bfloat16", "float32"] and in_features == 128',
     ["layers.0.down_proj", "layers.1.down_proj"]),
    ('linear|lm_head where format not in ["float32"]', []),
    ("* where eps < 1e-5 and dim != 64", []),
    ("* where eps < 1e-5", ["layers.0.input_norm", "layers.0.post_norm", "layers.1.input_norm",
                            "layers.1.post_norm", "norm"]),
    ('* where mask < "d"', ["layers.0.attention", "layers.1.attention"]),   # strings order as strings
    ('* where mask < 3 or vocab > "a"', []),                   # mixed kinds never order
    ("input where has layers", []),
    ("input()", ["tokens"]),                                   # no inputs
    ("argmax(lm_head(rmsnorm))", ["argmax"]),
    ("argmax(lm_head(linear))", []),
    ('add(embed, linear where name ~ "*.o_proj")', ["layers.0.attn_residual"]),
    ("add(*, *)", ["layers.0.attn_residual", "layers.0.mlp_residual",
                   "layers.1.attn_residual", "layers.1.mlp_residual"]),
    ("add(*)", []),                                            # arity must match
    # `not` binds tighter than `and`, `and` tighter than `or`
    ('* where name == "norm" or name == "embed" and dim == 1', ["norm"]),
    ('* where (name == "norm" or name == "embed") and dim == 1', []),
    ('* where not has dim and not has eps and not has weight and name ~ "layers.0.*"',
     ["layers.0.rope", "layers.0.attention", "layers.0.attn_residual", "layers.0.mlp_residual"]),
])
def test_predicate_semantics(program, pattern, expected):
    assert matched(program, pattern) == expected


def test_missing_attributes_are_false_not_errors(program):
    # any test of an attribute the node lacks is false, whatever the operator; `not` negates it
    assert matched(program, "* where budget != 3") == []
    assert matched(program, "* where budget not in [3]") == []
    assert len(matched(program, "* where not (budget == 3)")) == len(program.target)
    assert matched(program, "linear where in_features == $missing") == []


def test_attribute_references_in_predicates(program):
    square = matched(program, "linear where in_features == $out_features and name ~ \"layers.0.*\"")
    assert square == ["layers.0.q_proj", "layers.0.o_proj"]


@settings(max_examples=30, deadline=None)
@given(st.integers(-10, 400), st.sampled_from(["==", "!=", "<", "<=", ">", ">="]))
def test_comparisons_agree_with_numbers(threshold, op):
    p = lower(TARGET, DFLASH)
    python = {"==": int.__eq__, "!=": int.__ne__, "<": int.__lt__, "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__}
    want = [n for n in p.target.find("linear") if python[op](p.target.node(n)["out_features"], threshold)]
    assert matched(p, f"linear where out_features {op} {threshold}") == want


# ----------------------------------------------------------------------------- rules as passes


def test_set_changes_exactly_the_matched_nodes(program):
    keep, graphed = load_rules(LM_HEAD_RULES)
    result = keep.rules.run(program)
    assert result.hits == {"lm-head-bf16": 1}  # the target's lm_head; the DFlash drafter's borrows it
    before, after = print_program(program).splitlines(), print_program(result.program).splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1
    for a, b in changed:
        assert "lm_head(norm)" in a and b == a.replace('format="float32"', 'format="bfloat16"')
    assert graphed.rules.run(program).hits == {"device-accept": 1, "graphs": 1}


def test_rule_passes_run_through_the_pass_manager(program):
    load_rules(LM_HEAD_RULES)
    passes = parse_pipeline("keep-lm-head-bf16, graphed-steps, draft-block-size{size=4}")
    assert pipeline_string(passes) == "keep-lm-head-bf16,graphed-steps,draft-block-size{size=4}"
    q, records = run_passes(program, passes)
    assert [r.changed for r in records] == [True, True, True]
    assert [r.lossless for r in records] == [False, True, True]
    assert records[0].summary == "lm-head-bf16: 1 rewrite"
    assert q.target.node("lm_head")["format"] == "bfloat16" and q.step.one("accept")[1]["on"] == "device"
    # a second run finds nothing to do, and the schedule space says so beforehand
    again, records = run_passes(q, passes[:2])
    assert again == q and not any(r.changed for r in records) and records[0].summary == "no rule matched"
    assert type(passes[0]).schedule_space(program) == [passes[0]]
    assert type(passes[0]).schedule_space(q) == []


def test_each_rule_sweeps_once_and_hits_are_counted(program):
    [flip, widen] = load_rules("""
    pass flip (lossless) {
      rule to-device: match accept where on == "host" set on = "device"
      rule to-host:   match accept where on == "device" set on = "host"
      rule never:     match lm_head where format == "u12" set kernel = "triton-u12"
    }
    pass widen (lossy) {
      rule widen: match linear where name ~ "layers.0.*" set in_features = 64
    }""")
    result = flip.rules.run(program)
    assert result.hits == {"to-device": 1, "to-host": 1, "never": 0}
    # host -> device -> host: each rule rewrote the node once, the program is as it was
    assert not result.changed and result.program == program
    _, [record] = run_passes(program, [flip()])
    assert not record.changed and record.summary == "to-device: 1 rewrite, to-host: 1 rewrite (no net change)"
    # a node that already has the value is matched but not rewritten: of the 14 layers.0 linears
    # (target and drafter) only the two down_proj (in_features 128) change
    assert widen.rules.run(program).hits == {"widen": 2}


def test_remove_rewires_users_and_keeps_the_ir_valid(program):
    [cls] = load_rules("""
    pass drop-post-norms (lossy) {
      rule drop: on target match rmsnorm(add) where name ~ "layers.*.post_norm" remove
    }""")
    result = cls.rules.run(program)
    assert result.hits == {"drop": 2}
    g = result.program.target
    assert "layers.0.post_norm" not in g and len(g) == len(program.target) - 2
    assert g.inputs("layers.0.gate_proj") == ["layers.0.attn_residual"]
    assert g.inputs("layers.0.mlp_residual") == ["layers.0.attn_residual", "layers.0.down_proj"]
    verify_program(result.program)
    # but the checkpoint still has its norms: as a pass it is refused, and never offered to a search
    with pytest.raises(IRError, match=r"after drop-post-norms: target: nodes removed \(layers.0.post_norm, layers.1.post_norm\)"):
        run_passes(program, [cls()])
    assert cls.schedule_space(program) == []


def test_remove_keeps_input_positions(program):
    [cls] = load_rules('pass p (lossy) { rule r: match linear where name == "layers.0.o_proj" remove }')
    g = cls.rules.run(program).program.target
    assert g.inputs("layers.0.attn_residual") == ["embed", "layers.0.attention"]


def test_remove_refuses_what_it_cannot_rewire(program):
    [two_inputs] = load_rules('pass a (lossy) { rule r: on drafter match linear where name == "layers.0.k_proj" remove }')
    with pytest.raises(RewriteError, match=r"<rules>:1:23: rule 'r' on drafter/layers.0.k_proj: .*exactly one input, it has 2"):
        two_inputs.rules.run(program)
    assert two_inputs.schedule_space(program) == []
    [both] = load_rules('pass b (lossy) { rule r: match linear where name ~ "layers.0.gate_proj" or name ~ "layers.0.up_proj" remove }')
    with pytest.raises(RewriteError, match="'layers.0.mlp' already reads 'layers.0.post_norm'"):
        both.rules.run(program)


def test_replace_and_unset(program):
    [cls] = load_rules("""
    pass reshape (lossy) {
      rule mlp-to-add: on target match mlp(linear, linear) replace with add {}
      rule no-qk-norm: on drafter match attention unset qk_norm, context
      rule copy:       on target match lm_head set weight = $weight, kernel = $kernel
    }""")
    result = cls.rules.run(program)
    assert result.hits == {"mlp-to-add": 2, "no-qk-norm": 1, "copy": 0}
    g = result.program.target
    assert g.node("layers.1.mlp").op == "add" and g.node("layers.1.mlp").attrs == ()
    assert g.inputs("layers.1.mlp") == ["layers.1.gate_proj", "layers.1.up_proj"]
    assert "qk_norm" not in result.program.drafter.node("layers.0.attention")
    verify_program(result.program)


def test_a_rule_that_breaks_the_ir_is_caught_by_the_verifier(program):
    load_rules("""
    pass int4-head (lossy) { rule r: match lm_head set format = "int4" }
    pass no-accept (lossy) { rule r: match accept remove }
    pass to-norm (lossy) { rule r: on target match linear replace with rmsnorm {dim = $out_features} }
    """)
    with pytest.raises(IRError, match="after int4-head.*format='int4' not allowed"):
        run_passes(program, parse_pipeline("int4-head"))
    with pytest.raises(IRError, match="after no-accept.*exactly one 'accept'"):
        run_passes(program, parse_pipeline("no-accept"))
    with pytest.raises(IRError, match="after to-norm.*rmsnorm needs attribute 'eps'"):
        run_passes(program, parse_pipeline("to-norm"))
    assert REGISTRY["int4-head"].schedule_space(program) == []  # never offered to a search


def test_rules_in_python_are_the_same_objects(program):
    [parsed] = parse_rules('pass p (lossless) {\n  rule r: match accept where on == "host" set on = "device"\n}')
    rule = Rule("r", ("step",), Pattern(("accept",), Compare(Attr("on"), "==", "host")),
                SetAttrs((("on", "device"),)), where="<rules>:2:8")
    assert parsed.rules == RuleSet((rule,))
    cls = rule_pass("py-device-accept", RuleSet((rule,)) + RuleSet((rule,)), lossless=True)
    assert parse_pipeline("py-device-accept") == [cls()]
    assert cls.rules.run(program).hits == {"r": 1}  # the second copy finds nothing left to do
    with pytest.raises(ValueError, match="unknown op"):
        Rule("r", ("step",), Pattern(("acept",)), RemoveNode())
    with pytest.raises(ValueError, match="never in the step graph"):
        Rule("r", ("step",), Pattern(("linear",)), RemoveNode())


def test_the_example_rules_file(program):
    passes = load_rules(EXAMPLE)
    assert [p.name for p in passes] == ["lm-head-bf16", "graphed-steps"]
    assert passes[0].__doc__.startswith("Store a float32 lm_head")
    q, records = run_passes(program, parse_pipeline("lm-head-bf16,graphed-steps,draft-block-size{size=8}"))
    assert [r.changed for r in records] == [True, True, False]
    assert q.step == CudaGraphs().apply(program).program.step  # graphed-steps is the cuda-graphs pass as rules
    assert load_rules(str(EXAMPLE)) == passes  # a path as a string; reloading gives the same classes


# ----------------------------------------------------------------------------- loading and its errors


def test_reloading_is_idempotent_and_edits_replace(tmp_path):
    path = tmp_path / "mine.rules"
    path.write_text(LM_HEAD_RULES)
    first = load_rules(path)
    assert load_rules(path) == first and all(a is b for a, b in zip(load_rules(path), first))
    path.write_text(LM_HEAD_RULES.replace('"bfloat16"', '"float16"'))
    edited = load_rules(path)
    assert edited[0] is not first[0] and REGISTRY["keep-lm-head-bf16"] is edited[0]
    assert edited[1] is first[1]  # unchanged pass, same class


def test_name_clashes_name_the_file(tmp_path):
    path = tmp_path / "clash.rules"
    path.write_text('# mine\npass draft-block-size (lossless) { rule r: match accept set on = "device" }')
    with pytest.raises(PipelineError, match=r"clash.rules:2:6: pass 'draft-block-size' is already defined by a built-in pass"):
        load_rules(path)
    load_rules(LM_HEAD_RULES, source="a.rules")
    with pytest.raises(PipelineError, match=r"b.rules:2:6: .*'keep-lm-head-bf16' is already defined by the rules in a.rules"):
        load_rules(LM_HEAD_RULES, source="b.rules")
    assert REGISTRY["draft-block-size"] is DraftBlockSize
    with pytest.raises(PipelineError, match="nowhere.rules: cannot read rules file"):
        load_rules(str(tmp_path / "nowhere.rules"))


@pytest.mark.parametrize("text, line, col, message", [
    ("pass p (lossless) {\n  rule r:\n    match lm_head where format = \"x\"\n    set a = 1\n}", 3, 32,
     "expected 'in', 'not', '~' or a comparison (==, !=, <, <=, >, >=), got '='"),
    ("pass p (lossless) {\n  rule r:\n    match lm_head\n}", 4, 1, "got '}'"),
    ("pass p (safe) {}", 1, 9, "expected lossless or lossy, got 'safe'"),
    ("pass p (lossless) {\n  rule r: on step, model match accept remove\n}", 2, 20,
     "expected a level (step, target, drafter), got 'model'"),
    ("pass p (lossless) {\n  rule r: match accept where on == host set on = 1\n}", 2, 36, "got 'host'"),
    ("pass p (lossless) {\n  rule r:\n    match lm_haed set a = 1\n}", 3, 11, "unknown op 'lm_haed'"),
    ("pass p (lossless) {\n  rule r: match accept replace with acept {}\n}", 2, 37, "unknown op 'acept'"),
    ("pass p (lossless) {\n  rule r: on step match linear set a = 1\n}", 2, 8, "'linear' is never in the step graph"),
    ("pass p (lossless) {\n  rule r: match * replace with add {}\n}", 2, 8, "cannot be placed in the step graph"),
    ("pass p (lossless) {\n  rule r: match accept set on = 1, on = 2\n}", 2, 36, "'on' is assigned twice"),
    ("pass p (lossless) {\n  rule r: match accept remove\n  rule r: match accept remove\n}", 3, 8, "'r' is defined twice"),
    ("pass p (lossless) { rule r: match accept remove }\n\npass p (lossy) { rule r: match accept remove }", 3, 6,
     "'p' is defined twice"),
])
def test_rules_errors_carry_line_and_column(text, line, col, message):
    with pytest.raises(DSLSyntaxError) as info:
        load_rules(text, source="x.rules")
    assert str(info.value).startswith(f"x.rules:{line}:{col}: ")
    assert message in str(info.value)


def test_a_bad_file_registers_nothing(registry):
    before = dict(registry)
    with pytest.raises(DSLSyntaxError):
        load_rules(LM_HEAD_RULES + "\npass broken (lossless) { rule r: match nope remove }")
    assert registry == before


# ----------------------------------------------------------------------------- nothing runs as Python


@pytest.mark.parametrize("text", [
    'pass p (lossless) { rule r: match accept where __import__("os") set on = "device" }',
    'pass p (lossless) { rule r: match accept where on == __import__("os").system("true") set on = "x" }',
    'pass p (lossless) { rule r: match accept where on.__class__ == "x" set on = "x" }',
    'pass p (lossless) { rule r: match accept set on = eval("1") }',
    'pass p (lossless) { rule r: match accept set on = "x"; import os }',
    'pass p (lossless) { rule r: match accept where on == "host" set on = `id` }',
    'pass p (lossless) { rule r: match lambda x: x remove }',
])
def test_python_is_a_syntax_error(text):
    with pytest.raises(DSLSyntaxError, match=r"^<rules>:1:\d+: expected .*, got "):
        load_rules(text)


def test_python_names_are_just_missing_attributes(program, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the DSL must not evaluate Python")

    text = """
    pass dunder (lossless) {
      rule class:  match * where __class__ == "Node" or has __dict__ or __init__ ~ "*" set on = "x"
      rule code:   match accept where on == "__import__('os').system('true')" set on = "device"
      rule string: match accept set on = "__import__('os')"
    }
    pass ref (lossless) { rule r: match accept set on = $__class__ }"""
    with monkeypatch.context() as m:  # only around the DSL: pytest itself compiles when reporting
        for name in ("eval", "exec", "compile"):
            m.setattr(builtins, name, forbidden)
        dunder, ref = load_rules(text)
        result = dunder.rules.run(program)
        with pytest.raises(RewriteError) as missing:
            ref.rules.run(program)
    assert result.hits == {"class": 0, "code": 0, "string": 1}
    assert result.program.step.one("accept")[1]["on"] == "__import__('os')"  # only ever data
    assert "has no attribute '__class__' (read as $__class__)" in str(missing.value)
