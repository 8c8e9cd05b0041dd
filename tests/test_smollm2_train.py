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


# --- continuing across calls: the graphed distillation, the data file, --init, --phases ---------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    data = tmp_path_factory.mktemp("corpus")
    build_corpus(data, max_files=30)
    return data


@pytest.mark.parametrize("split_kv", [False, True], ids=["sdpa", "split-kv"])
def test_graphed_greedy_batch_equals_ar_row_by_row_across_reused_batches(tiny_target, split_kv):
    """SDPA: three batches through one runner; the split-KV kernel (the GPU's decode attention; here
    under Triton's interpreter, ~0.3 s a call) a short one after a longer one."""
    target, _ = load_target(tiny_target, dtype=torch.float32, device="cpu")
    gen_len = 3 if split_kv else 8
    runner = ts.GreedyBatch(target, batch=3, max_prompt=9, gen_len=gen_len, prefill_rows=2, split_kv=split_kv)
    gen = torch.Generator().manual_seed(1)
    for p in (9, 5) if split_kv else (9, 5, 7):  # a shorter batch after a longer one: stale slots past its length stay hidden
        prompts = torch.randint(5, 300, (3, p), generator=gen)
        seqs = runner.run(prompts)
        assert seqs.shape == (3, p + gen_len) and torch.equal(seqs[:, :p], prompts)
        for row in range(3):
            ar = generate_ar(target, prompts[row].tolist(), max_new_tokens=gen_len, eos_token_id=None)
            assert seqs[row, p:].tolist() == ar.tokens, (p, row)
    runner.close()
    with pytest.raises(ValueError, match="at most 9 prompt tokens"):
        runner.run(torch.zeros(3, 10, dtype=torch.long))


def tiny_cfg(tiny_target):
    from specpilot.hf.config import ModelConfig

    return ModelConfig.from_hf(json.loads((tiny_target / "config.json").read_text()), "config.json")


def test_distilled_file_round_trips_and_refuses_another_runs_file(tiny_target, tmp_path):
    from types import SimpleNamespace

    shapes, cfg = ts.PRESETS["smoke"][0], tiny_cfg(tiny_target)
    gen = torch.Generator().manual_seed(2)
    data = {24: {"train": torch.randint(0, 320, (4, 44), generator=gen), "val": torch.randint(0, 320, (1, 44), generator=gen),
                 "hidden_train": torch.zeros(4, 43, 8)},
            40: {"train": torch.randint(0, 320, (2, 60), generator=gen), "val": torch.randint(0, 320, (1, 60), generator=gen)}}
    source = SimpleNamespace(batches=5, used={"code": 7, "instruct": 3}, counts={"code": 7, "instruct": 3, "snippet": 1, "own": 0})
    path = tmp_path / "d" / "distilled.pt"
    ts.save_distilled(path, data, source, shapes, cfg, seed=0)
    groups, state = ts.load_distilled(path, shapes, cfg, torch.device("cpu"))
    assert sorted(groups) == [24, 40] and state["batches"] == 5 and state["used"] == {"code": 7, "instruct": 3}
    for p in data:
        assert set(groups[p]) == {"train", "val"}  # hidden states are recomputed, not stored
        for k in ("train", "val"):
            assert groups[p][k].dtype == torch.long and torch.equal(groups[p][k], data[p][k])
    with pytest.raises(SystemExit, match=r"field 'gen_len' is 20, this run needs 64"):
        ts.load_distilled(path, ts.PRESETS["cpu"][0], cfg, torch.device("cpu"))
    (tmp_path / "junk.pt").write_bytes(b"not a file torch wrote")
    with pytest.raises(SystemExit, match="junk.pt: not a train_smollm2 distilled file"):
        ts.load_distilled(tmp_path / "junk.pt", shapes, cfg, torch.device("cpu"))
    with pytest.raises(SystemExit, match="missing.pt: no such file"):
        ts.load_distilled(tmp_path / "missing.pt", shapes, cfg, torch.device("cpu"))


def saved_drafters(tiny_target, path, seed):
    """Both drafters with random weights (as if trained), saved as a train_smollm2 output folder."""
    shapes, cfg = ts.PRESETS["smoke"][0], tiny_cfg(tiny_target)
    torch.manual_seed(seed)
    target, _ = load_target(tiny_target, dtype=torch.float32, device="cpu")
    dflash = ts.DFlashDrafter(ts.dflash_config(shapes, cfg, 3), embed=target.embed, head=target.head)
    pard, pcfg, _ = ts.pard_model(shapes, tiny_target, cfg, torch.device("cpu"))
    for m in (dflash, pard):
        for q in m.parameters():
            if q.requires_grad:
                torch.nn.init.normal_(q, std=0.05)
    ts.save_dflash(dflash, path / "dflash")
    ts.save_pard(pard, pcfg, shapes, 3, path / "pard")
    return dflash, pard, pcfg


def test_init_loads_exactly_the_saved_drafters(tiny_target, tmp_path):
    saved_drafters(tiny_target, tmp_path / "a", seed=4)
    fresh_d, fresh_p, pcfg = saved_drafters(tiny_target, tmp_path / "b", seed=5)  # other weights
    assert (tmp_path / "a" / "dflash" / "model.safetensors").read_bytes() != (tmp_path / "b" / "dflash" / "model.safetensors").read_bytes()
    ts.load_init(fresh_d, tmp_path / "a" / "dflash" / "model.safetensors")
    ts.load_init(fresh_p, tmp_path / "a" / "pard" / PARD_LAYERS_FILE, skip=(SHARED_EMBEDDING, "lm_head.weight"))
    ts.save_dflash(fresh_d, tmp_path / "c" / "dflash")
    ts.save_pard(fresh_p, pcfg, ts.PRESETS["smoke"][0], 3, tmp_path / "c" / "pard")
    from safetensors.torch import load_file

    for f in ("dflash/model.safetensors", f"pard/{PARD_LAYERS_FILE}"):  # tensors: the header's metadata order varies
        saved, again = load_file(str(tmp_path / "a" / f)), load_file(str(tmp_path / "c" / f))
        assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved), f
    # the zoo's stored form is materialized and gives the same files
    from specpilot.zoo import store_pair

    store_pair(tmp_path / "a", tmp_path / "zoo" / "pair", names=("dflash", "pard"))
    plain = ts.resolve_init(tmp_path / "zoo" / "pair", ("dflash", "pard"), tmp_path / "cache")
    assert (plain / "dflash" / "model.safetensors").read_bytes() == (tmp_path / "a" / "dflash" / "model.safetensors").read_bytes()


def test_bad_init_paths_name_the_path_and_what_is_missing(tiny_target, tmp_path):
    with pytest.raises(SystemExit, match=r"--init .*nowhere: no such directory"):
        ts.resolve_init(tmp_path / "nowhere", ("dflash", "pard"), tmp_path / "cache")
    saved_drafters(tiny_target, tmp_path / "a", seed=4)
    (tmp_path / "a" / "pard" / PARD_LAYERS_FILE).unlink()
    with pytest.raises(SystemExit, match=rf"--init {tmp_path / 'a'}: missing pard/{PARD_LAYERS_FILE} "):
        ts.resolve_init(tmp_path / "a", ("dflash", "pard"), tmp_path / "cache")
    assert ts.resolve_init(tmp_path / "a", ("dflash",), tmp_path / "cache") == tmp_path / "a"
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--init: .*manifest.json: not a zoo manifest"):
        ts.resolve_init(tmp_path / "z", ("dflash",), tmp_path / "cache")
    big = replace_layers(ts.PRESETS["smoke"][0])  # a drafter of another shape than the file's
    cfg = tiny_cfg(tiny_target)
    other = ts.DFlashDrafter(ts.dflash_config(big, cfg, 3), embed=None, head=None)
    with pytest.raises(SystemExit, match=r"dflash/model.safetensors: does not fit this run's drafter \(lacks layers.1"):
        ts.load_init(other, tmp_path / "a" / "dflash" / "model.safetensors")


def replace_layers(shapes):
    from dataclasses import replace

    return replace(shapes, dflash_layers=2)


def run_main(tiny_target, corpus, out, *extra):
    return ts.main(["--out", str(out), "--preset", "smoke", "--target", str(tiny_target), "--data", str(corpus), *extra])


def test_phases_run_only_what_they_say_and_init_continues_from_given_weights(tiny_target, corpus, tmp_path):
    data = tmp_path / "keep" / "distilled.pt"
    assert run_main(tiny_target, corpus, tmp_path / "o1", "--phases", "distill", "--distilled", str(data)) == 0
    log1 = json.loads((tmp_path / "o1" / "train_log.json").read_text())
    assert set(log1["phases"]) == {"distill"} and data.is_file()
    assert not (tmp_path / "o1" / "dflash").exists() and not (tmp_path / "o1" / "pard").exists()
    assert log1["phases"]["distill"]["graphed_decode"] is True
    groups, state = ts.load_distilled(data, ts.PRESETS["smoke"][0], tiny_cfg(tiny_target), torch.device("cpu"))
    assert state["batches"] == ts.SMOKE_CAPS["distill_batches"]

    # a second distill call adds to the file and carries on with the prompt source's state
    assert run_main(tiny_target, corpus, tmp_path / "o2", "--phases", "distill", "--distilled", str(data),
                    "--distill-batches", "1") == 0
    groups2, state2 = ts.load_distilled(data, ts.PRESETS["smoke"][0], tiny_cfg(tiny_target), torch.device("cpu"))
    assert state2["batches"] == state["batches"] + 1
    assert sum(len(g["train"]) for g in groups2.values()) > sum(len(g["train"]) for g in groups.values())
    for p, g in groups.items():  # the earlier sequences kept as they were
        assert torch.equal(groups2[p]["train"][: len(g["train"])], g["train"])

    # dflash and eval from --init: DFlash one step away from the given weights, PARD copied as given
    saved_drafters(tiny_target, tmp_path / "init", seed=6)
    out = tmp_path / "o3"
    assert run_main(tiny_target, corpus, out, "--phases", "dflash,eval", "--distilled", str(data),
                    "--init", str(tmp_path / "init"), "--dflash-steps", "1") == 0
    log = json.loads((out / "train_log.json").read_text())
    assert set(log["phases"]) == {"dflash", "eval"} and log["phases"]["dflash"]["steps"] == 1
    assert log["phases"]["dflash"]["init"] == str(tmp_path / "init" / "dflash")
    assert (out / "pard" / PARD_LAYERS_FILE).read_bytes() == (tmp_path / "init" / "pard" / PARD_LAYERS_FILE).read_bytes()
    from safetensors.torch import load_file

    before, after = load_file(str(tmp_path / "init" / "dflash" / "model.safetensors")), load_file(str(out / "dflash" / "model.safetensors"))
    moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
    assert 0 < moved < 0.01  # one warm-up step of lr peak/warmup; a fresh start differs by ~0.1
    assert log["phases"]["eval"]["summary"]["dflash"]["equals_ar"] == log["phases"]["eval"]["summary"]["dflash"]["prompts"]
    assert "continued from: `" in (out / "dflash" / "MODEL_CARD.md").read_text()


def test_training_without_distill_needs_a_data_file_and_phases_are_checked(tiny_target, corpus, tmp_path):
    with pytest.raises(SystemExit, match="needs --distilled FILE"):
        run_main(tiny_target, corpus, tmp_path / "o", "--phases", "dflash")
    with pytest.raises(SystemExit, match="--phases: unknown train"):
        run_main(tiny_target, corpus, tmp_path / "o", "--phases", "distill,train")
    with pytest.raises(SystemExit, match=r"--phases eval: .* has no dflash or pard/ drafter"):
        run_main(tiny_target, corpus, tmp_path / "o", "--phases", "eval")
    assert not (tmp_path / "o").exists()  # refused before any work: nothing written


def test_graphed_greedy_batch_serves_its_decode_step_by_the_split_kv_kernel_and_puts_sdpa_back(tiny_target):
    from specpilot.backends.kernel_hooks import triton_runs
    from specpilot.runtime.model import attend_visible

    target, _ = load_target(tiny_target, dtype=torch.float32, device="cpu")
    if not triton_runs(target.device):
        pytest.skip("needs Triton's interpreter (the suite's conftest sets it)")
    runner = ts.GreedyBatch(target, batch=2, max_prompt=6, gen_len=4)
    assert len(runner.installed) == len(target.model.layers)
    runner.close()
    assert all(layer.self_attn.attention is attend_visible for layer in target.model.layers)
    plain = ts.GreedyBatch(target, batch=2, max_prompt=6, gen_len=4, split_kv=False)
    assert plain.installed == []


def test_run_gpu_smollm2_groups_pass_flags_train_smollm2_takes(tmp_path):
    """bench/run_gpu.sh's training groups (PRINT_ONLY: their commands, nothing run): each parses, and
    smollm2more continues from what the group before it keeps on the machine."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "bench" / "run_gpu.sh"), "smollm2", "smollm2init", "smollm2more"],
                          env={**os.environ, "PRINT_ONLY": "1", "OUT": str(tmp_path)}, cwd=root, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    runs = {line.split(":", 1)[0]: shlex.split(line.split(": ", 1)[1]) for line in done.stdout.splitlines()
            if line.startswith("smollm2_") and "train.train_smollm2 --out" in line}
    assert set(runs) == {"smollm2_train", "smollm2_init", "smollm2_more"}
    parsed = {name: ts.parse_args(cmd[3:])[0] for name, cmd in runs.items()}
    for args in parsed.values():
        assert args.out == tmp_path and args.phases == ts.PHASES and args.distilled == Path("/tmp/smollm2-data.pt")
    assert (root / parsed["smollm2_init"].init / "manifest.json").is_file()  # the committed pair, stored form
    assert parsed["smollm2_more"].init == Path("/tmp/smollm2-out")
    more = parsed["smollm2_more"]
    assert 400 <= sum(getattr(more, f"{p}_seconds") for p in ts.PHASES) <= 480  # within the 540 s run, setup beside


@pytest.mark.gpu
def test_graphed_greedy_batch_captured_on_the_gpu_equals_ar(tiny_target):
    """The CUDA path: the step captured as a CUDA graph, the split-KV kernel natively (fp32, so the
    comparison with AR is not at bf16's mercy); a shorter batch after a longer one."""
    target, _ = load_target(tiny_target, dtype=torch.float32, device="cuda")
    runner = ts.GreedyBatch(target, batch=5, max_prompt=40, gen_len=12, prefill_rows=2)
    assert runner.step.graph is not None and len(runner.installed) == len(target.model.layers)
    gen = torch.Generator().manual_seed(7)
    for p in (40, 24):
        prompts = torch.randint(5, 300, (5, p), generator=gen).cuda()
        seqs = runner.run(prompts).cpu()
        for row in range(5):
            ar = generate_ar(target, prompts[row].tolist(), max_new_tokens=12, eos_token_id=None)
            assert seqs[row, p:].tolist() == ar.tokens, (p, row)
    runner.close()


def test_a_graph_that_fails_falls_back_to_the_eager_loop_and_says_so(tiny_target, corpus, tmp_path, monkeypatch):
    def no_graph(*a, **k):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(ts, "GreedyBatch", no_graph)
    assert run_main(tiny_target, corpus, tmp_path / "o", "--phases", "distill", "--distill-batches", "1") == 0
    d = json.loads((tmp_path / "o" / "train_log.json").read_text())["phases"]["distill"]
    assert d["graphed_decode"] is False and "stream is capturing" in d["graph_error"] and d["new_tokens"] > 0
