"""train/train_smollm2.py at toy scale on a tiny GGUF target: the distilled data is the target's
greedy output with the hidden states a fresh forward gives, every phase runs and writes drafters
specpilot loads, and their outputs through specpilot's loops equal AR greedy."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

from gguf_fixtures import write_tiny_gguf  # noqa: E402
from specpilot.hf.gguf import gguf_to_hf_dir  # noqa: E402
from specpilot.runtime.builtin import PARD_LAYERS_FILE, SHARED_EMBEDDING, assemble_shared_embedding  # noqa: E402
from specpilot.runtime.decode import generate_ar  # noqa: E402
from specpilot.runtime.load import load_drafter, load_target  # noqa: E402
from train import train_smollm2 as ts  # noqa: E402
from train.corpus import build_corpus  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_tiny_gguf(root / "tiny.gguf", seed=3)
    return gguf_to_hf_dir(root / "tiny.gguf", root / "target")


def test_greedy_with_hidden_is_ar_greedy_with_a_fresh_forwards_hidden_states(tiny_target):
    target, _ = load_target(tiny_target, dtype=torch.float32, device="cpu")
    prompts = torch.randint(5, 300, (3, 7), generator=torch.Generator().manual_seed(0))
    seqs, hidden = ts.greedy_with_hidden(target, prompts, 9, (0, 1))
    assert seqs.shape == (3, 16) and hidden.shape == (3, 15, 2 * 64)
    for row in range(3):
        ar = generate_ar(target, prompts[row].tolist(), max_new_tokens=9, eos_token_id=None)
        assert seqs[row, 7:].tolist() == ar.tokens
    fresh = target(seqs[:, :-1], target.new_cache(3, 15), hidden_layers=(0, 1)).hidden
    torch.testing.assert_close(hidden.float(), fresh.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)


def test_wheel_split_and_join_round_trip(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    wheel.write_bytes(bytes(range(256)) * 1000)
    ts.split_wheel(wheel, tmp_path / "parts", part_mib=0.1)
    assert len(list((tmp_path / "parts").glob("part-*"))) == 3
    assert ts.join_wheel(tmp_path / "parts", tmp_path / "out").read_bytes() == wheel.read_bytes()
    (tmp_path / "parts" / "part-01").unlink()
    with pytest.raises(SystemExit, match="missing part-01"):
        ts.join_wheel(tmp_path / "parts", tmp_path / "out2")


@pytest.mark.slow  # ~11 s on an idle core: the corpus, the prompts, transformers' import
def test_smoke_run_writes_drafters_whose_outputs_equal_ar(tiny_target, tmp_path):
    data = tmp_path / "corpus"
    build_corpus(data, max_files=30)
    out = tmp_path / "out"
    stored = tmp_path / "zoo" / "smollm2-135m-instruct"
    assert ts.main(["--out", str(out), "--preset", "smoke", "--target", str(tiny_target), "--data", str(data),
                    "--store", str(stored)]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["drafter_size"]["bf16_bytes"] <= ts.DRAFTER_BYTES
    # --store: the zoo's form (weights as .xz), which materializes to OUT's files byte for byte
    from specpilot.zoo import materialize

    assert (stored / "pard" / (PARD_LAYERS_FILE + ".xz")).is_file() and (stored / "dflash" / "model.safetensors.xz").is_file()
    plain = materialize(stored, tmp_path / "cache")
    for name in ("dflash/model.safetensors", f"pard/{PARD_LAYERS_FILE}", "dflash/config.json", "train_log.json"):
        assert (plain / name).read_bytes() == (out / name).read_bytes()
    assert log["phases"]["distill"]["generated_tokens"] > 0
    for kind in ("dflash", "pard"):
        assert log["phases"][kind]["steps"] == ts.SMOKE_CAPS[f"{kind}_steps"]
        assert log["phases"]["eval"]["summary"][kind]["equals_ar"] == log["phases"]["eval"]["summary"][kind]["prompts"]
        assert (out / kind / "MODEL_CARD.md").is_file()
    from safetensors import safe_open

    with safe_open(str(out / "pard" / PARD_LAYERS_FILE), framework="pt") as f:
        assert SHARED_EMBEDDING not in f.keys() and f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    target, cfg = load_target(tiny_target, dtype=torch.float32, device="cpu")
    dflash = load_drafter(out / "dflash", target, cfg, dtype=torch.float32, device="cpu")
    assert dflash.block_size == 16 and dflash.target_layer_ids == (0, 1)
    pard = load_drafter(assemble_shared_embedding(out / "pard", tiny_target, tmp_path / "pard"), target, cfg,
                        dtype=torch.float32, device="cpu")
    assert pard.k == 8 and pard.mask_token_id == dflash.mask_token_id == 3  # <empty_output>


def test_drafters_over_the_size_budget_are_refused_before_training(tiny_target, monkeypatch):
    from specpilot.hf.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((tiny_target / "config.json").read_text()), "config.json")
    sizes = ts.drafter_sizes(ts.PRESETS["smoke"][0], cfg, 3)
    assert sizes["parameters"]["dflash"] > 0 and sizes["parameters"]["pard"] > 0
    monkeypatch.setattr(ts, "DRAFTER_BYTES", sizes["bf16_bytes"] - 1)
    with pytest.raises(SystemExit, match="over DRAFTER_BYTES"):
        ts.drafter_sizes(ts.PRESETS["smoke"][0], cfg, 3)
