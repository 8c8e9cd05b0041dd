"""The draft-vocab pass: the subset's choice, the head over it, the IR and cost changes, and that
engines with it stay lossless (their output is AR greedy's) and store the subset they used."""

import gzip
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specpilot.backends.torch_backend import build_engine
from specpilot.compiler import compile_pipeline, load_engine
from specpilot.cost.roofline import matmul_weight_bytes, weight_footprint
from specpilot.errors import EngineError, PipelineError, SpecError
from specpilot.ir import lower, parse_program, print_program, verify_program
from specpilot.passes import lookup, run_passes
from specpilot.passes.draft_vocab import DraftVocab
from specpilot.passes.what_if import what_ifs
from specpilot.runtime import draft_vocab as dv
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.tokenizer import load_tokenizer
from specpilot.spec import parse_spec

from conftest import tiny_spec
from test_ir import DFLASH, PARD, TARGET


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))


# -- the subset ---------------------------------------------------------------------------------

@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_subset_is_the_most_frequent_ids(counts, data):
    counts = torch.tensor(counts, dtype=torch.int64)
    vocab = counts.numel()
    size = data.draw(st.integers(1, vocab))
    always = data.draw(st.lists(st.integers(0, vocab - 1), max_size=size, unique=True))
    ids = dv.select_subset(counts, size, always)
    assert ids.numel() == size and torch.equal(ids, ids.unique())  # sorted, distinct
    assert set(always) <= set(ids.tolist())
    chosen = set(ids.tolist()) - set(always)
    left = set(range(vocab)) - set(ids.tolist())
    # every id chosen by frequency ranks (count, then smaller id) above every id left out
    for i in chosen:
        for j in left:
            assert (int(counts[i]), -i) > (int(counts[j]), -j)


def test_subset_bounds():
    counts = torch.tensor([3, 1, 2])
    with pytest.raises(ValueError, match="within 1..3"):
        dv.select_subset(counts, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        dv.select_subset(counts, 1, always=(0, 1))
    assert dv.select_subset(counts, 1, always=(1,)).tolist() == [1]  # forced in, frequency out
    assert dv.coverage(counts, torch.tensor([0, 2])) == pytest.approx(5 / 6)


# -- the head over it ---------------------------------------------------------------------------

@given(st.integers(2, 50), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_subset_head_is_the_full_head_at_its_ids(vocab, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(3, 2, hidden, generator=g)
    ids = torch.randperm(vocab, generator=g)[: max(1, vocab // 3)].sort().values
    head = dv.SubsetHead(weight, ids, vocab)
    full = torch.nn.functional.linear(h, weight)
    out = head(h)
    assert out.shape == full.shape and out.dtype == torch.float32
    assert torch.allclose(out[..., ids], full[..., ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert bool((out[..., outside] == float("-inf")).all())
    # the drafter proposes the full head's argmax whenever that token is in the subset
    in_subset = torch.isin(full.argmax(-1), ids)
    assert torch.equal(out.argmax(-1)[in_subset], full.argmax(-1)[in_subset])
    assert bool(torch.isin(out.argmax(-1), ids).all())


def test_subset_head_checks_its_weight():
    with pytest.raises(ValueError, match=r"\[10, hidden\]"):
        dv.SubsetHead(torch.zeros(9, 4), torch.tensor([1]), 10)


# -- the corpus ---------------------------------------------------------------------------------

def test_corpus_forms(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta")
    lines = [json.dumps({"text": "one"}), "", json.dumps({"prompt": "two"})]
    (tmp_path / "c.jsonl").write_text("\n".join(lines))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode()))
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "b.py").write_text("x = 1\n")
    (folder / "a.py").write_text("y = 2\n")
    assert dv.read_corpus(str(tmp_path / "a.txt")) == ["alpha beta"]
    assert dv.read_corpus(str(tmp_path / "c.jsonl")) == ["one", "two"]
    assert dv.read_corpus(str(tmp_path / "c.jsonl.gz")) == ["one", "two"]
    assert dv.read_corpus(str(folder)) == ["y = 2\n", "x = 1\n"]  # path order
    assert dv.read_corpus(str(tmp_path / "a.txt"), max_bytes=5) == ["alpha"]


def test_corpus_errors(tmp_path):
    with pytest.raises(SpecError, match=r"'nope.txt' does not exist \(expected 'stdlib'"):
        dv.read_corpus("nope.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(SpecError, match=r"bad.jsonl:1: expected an object with a string field 'text' or 'prompt'"):
        dv.read_corpus(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SpecError, match="holds no text"):
        dv.read_corpus(str(tmp_path / "empty.txt"))


def test_stdlib_corpus_leaves_out_the_prompt_sets_sources(tmp_path, monkeypatch):
    assert {"base64.py", "test/test_base64.py", "textwrap.py"} <= dv._heldout_sources()
    for rel in ("a.py", "base64.py", "test/test_base64.py", "test/test_a.py", "site-packages/p.py",
                "__pycache__/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    monkeypatch.setattr(dv.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    assert dv.read_corpus("stdlib") == ["# a.py\n", "# test/test_a.py\n"]


# -- the pass -----------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", [DFLASH, PARD], ids=["dflash", "pard"])
def test_pass_marks_only_the_drafter_head(drafter):
    p = lower(TARGET, drafter, dtype="bfloat16")
    q, [rec] = run_passes(p, [DraftVocab(size=100, corpus="c.txt")])
    assert rec.changed and rec.lossless
    assert q.target == p.target and q.step == p.step
    [head] = q.drafter.find("lm_head")
    for name, node in p.drafter.items():
        new = q.drafter.node(name)
        if name == head:
            assert (new["vocab_subset"], new["vocab_corpus"]) == (100, "c.txt")
            rest = {k: v for k, v in new.attrs if k not in ("vocab_subset", "vocab_corpus")}
            assert rest == dict(node.attrs)
        else:
            assert new == node, name
    # the IR text carries it, and the verifier accepts it
    back = verify_program(parse_program(print_program(q)))
    assert back.drafter.node(head) == q.drafter.node(head)
    # again: nothing to change; the whole vocabulary: nothing to change
    assert not run_passes(q, [DraftVocab(size=100, corpus="c.txt")])[1][0].changed
    vocab = p.drafter.node(head)["out_features"]
    r, [rec] = run_passes(p, [DraftVocab(size=vocab)])
    assert not rec.changed and r == p and "whole vocabulary" in rec.summary
    # a search measures the space (τ's dependence on the subset is measured, not modelled: no what-if)
    space = DraftVocab.schedule_space(p)
    assert all(vocab / 16 <= x.size < vocab and x.apply(p).changed for x in space)
    assert "draft-vocab" not in {w.pass_name for w in what_ifs(p)}
    big = drafter if "pard_k" not in drafter else dict(drafter, vocab_size=8192)
    assert {x.size for x in DraftVocab.schedule_space(lower(dict(TARGET, vocab_size=8192), big))} == {
        512, 1024, 2048, 4096}


def test_pass_parameters():
    with pytest.raises(PipelineError, match="size must be >= 1"):
        lookup("draft-vocab").from_params({"size": 0})
    assert DraftVocab(size=5, corpus="x.txt").spec() == 'draft-vocab{size=5, corpus="x.txt"}'


def test_cost_model_reads_only_the_subset_rows():
    p = lower(TARGET, DFLASH, dtype="bfloat16")
    q, _ = run_passes(p, [DraftVocab(size=64)])
    [head] = p.drafter.find("lm_head")
    before, after = p.drafter.node(head), q.drafter.node(head)
    assert matmul_weight_bytes(after)[0] == matmul_weight_bytes(before)[0] * 64 / before["out_features"]
    # the DFlash drafter borrowed the whole head; the subset is a copy of its own
    assert weight_footprint(q) - weight_footprint(p) == matmul_weight_bytes(after)[0]


# -- engines ------------------------------------------------------------------------------------

def _engine(kind, tmp_path, size=40):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20)
    target_dir, drafter_dir = resolve_builtin("tiny-qwen3"), resolve_builtin(f"tiny-qwen3/{kind}")
    p = lower(json.loads((target_dir / "config.json").read_text()),
              json.loads((drafter_dir / "config.json").read_text()), dtype="float32")
    p, _ = run_passes(p, [DraftVocab(size=size, corpus=str(corpus))])
    return build_engine(p, target_dir, drafter_dir, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["dflash", "pard"])
def test_engine_drafts_from_the_subset_and_stays_lossless(kind, tmp_path):
    engine = _engine(kind, tmp_path)
    ids = engine.draft_vocab.ids
    assert ids.numel() == 40 and engine.eos_token_id in ids.tolist()
    head = engine.drafter._shared[1] if kind == "dflash" else engine.drafter.model.lm_head
    assert isinstance(head, dv.SubsetHead)
    h = torch.randn(2, engine.target_cfg.hidden_size)
    assert bool(torch.isin(head(h).argmax(-1), ids).all())
    for prompt in (list(range(60, 80)), [5, 9, 11]):
        out = engine.generate(prompt, 16)
        assert out.tokens == engine.generate_ar(prompt, 16).tokens


def test_compiled_engine_stores_its_subset(tmp_path):
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x * 2\n" * 30)
    spec = parse_spec(__import__("yaml").safe_load(tiny_spec(
        "dflash", extra=f'passes: "draft-vocab{{size=48, corpus=\\"{tmp_path / "corpus.txt"}\\"}}"')), "t.yaml")
    out = tmp_path / "engine"
    result = compile_pipeline(spec, out_dir=out, device="cpu")
    assert result.validation.passed and result.measurement.matches_ar == 2
    assert result.report["drafter"]["vocab_subset"]["size"] == 48
    stored = out / "drafter" / dv.VOCAB_FILE
    assert stored.is_file()
    loaded = load_engine(out, device="cpu")  # reads the stored subset back
    vocab_size = loaded.engine.target_cfg.vocab_size
    expected = dv.build_vocab(load_tokenizer(out / "target"), str(tmp_path / "corpus.txt"), 48, vocab_size,
                              loaded.engine.eos_token_id)
    assert torch.equal(loaded.engine.draft_vocab.ids, expected.ids)
    assert loaded.engine.draft_vocab.coverage is None and expected.coverage > 0.9  # 48 ids cover a tiny corpus
    with pytest.raises(EngineError, match="the IR asks for 'other'"):
        dv.load_vocab(stored, 48, vocab_size, "other")
    with pytest.raises(EngineError, match="expected 47 sorted distinct token ids"):
        dv.load_vocab(stored, 47, vocab_size, str(tmp_path / "corpus.txt"))
