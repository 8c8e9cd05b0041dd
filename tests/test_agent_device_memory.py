"""Device memory across a search's trials (compiler.tune_pipeline): the target's weights are held
once for every trial, plus what the measured candidate's passes changed, and a finished trial's
engines are freed before the next. Counted here on the CPU: the distinct storages holding a copy of
one target weight, at each token forcing (engine, AR baseline and reference alive) and after each
trial. An 8B target on one GPU has room for about four copies; before sharing, every trial that ran
a graphed loop left its target alive (a runner table keyed weakly by the target whose runners held
it) and each built its own engine, baseline and reference."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from specpilot import compiler
from specpilot.agent.search import TuneConfig
from specpilot.agent.trial import REJECTED, VALIDATED, TrialJob
from specpilot.backends import torch_backend
from specpilot.compiler import resolve_models, run_trial, shape_models, tune_pipeline
from specpilot.runtime.load import load_target
from specpilot.runtime.shared_weights import sharing_weights
from specpilot.spec import load_spec

from conftest import registries_restored, tiny_spec

REPLAY = {"name": "t", "target": {"shape": "tiny", "weights": "random", "seed": 1},
          "drafter": {"kind": "replay", "profile": "dflash-qwen3-8b", "benchmark": "humaneval", "block_size": 8},
          "serving": {"max_new_tokens": 12}, "benchmark": {"prompts": "code-smoke", "num_prompts": 1},
          "passes": "cuda-graphs,fused-decoder"}


def copies(weight: torch.Tensor) -> int:
    """How many distinct storages hold a tensor equal to `weight` (`weight` itself left out)."""
    gc.collect()
    storages = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on gc's objects touches deprecated torch aliases
        for o in gc.get_objects():
            # strided only: a CPU engine's oneDNN-packed weights (runtime/cpu_linear.py) are opaque
            # tensors torch.equal cannot read, and exist on CPU engines alone, not on a GPU's
            if (isinstance(o, torch.Tensor) and o is not weight and o.device.type == "cpu"
                    and o.layout == torch.strided and o.shape == weight.shape and o.dtype == weight.dtype
                    and torch.equal(o, weight)):
                storages.add(o.untyped_storage().data_ptr())
    return len(storages)


def probes(target) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of two of the target's weights: q_proj, which the fused stack concatenates (the one
    changed copy), and down_proj, which no pass here changes."""
    layer = target.model.layers[0]
    return layer.self_attn.q_proj.weight.detach().clone(), layer.mlp.down_proj.weight.detach().clone()


@pytest.fixture
def replay_spec(tmp_path):
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(REPLAY))
    spec = load_spec(path)
    return spec, probes(shape_models(spec).target(torch.float32, torch.device("cpu"))[0])


@pytest.fixture
def zoo_spec(tmp_path):
    path = tmp_path / "zoo.yaml"
    path.write_text(tiny_spec("dflash", extra='passes: "cuda-graphs,fused-decoder"\n'))
    spec = load_spec(path)
    return spec, probes(load_target(resolve_models(spec).target, dtype=torch.float32, device="cpu")[0])


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "interleave"), [("replay_spec", False), ("zoo_spec", True)],
                         ids=["sequential-replay", "interleaved-zoo"])  # each mode and each deployment once
def test_a_search_holds_the_target_once_plus_the_candidates_change(deployment, interleave, request, tmp_path,
                                                                    monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels' torch references: memory is checked here
    spec, (q, down) = request.getfixturevalue(deployment)
    seen = []

    def sample(where: str) -> None:
        seen.append((where, copies(q), copies(down)))

    forcing = compiler.force_tokens

    def force_tokens(*args, **kwargs):  # the peak of a trial: its engine, the baseline and the reference alive
        sample("token forcing")
        return forcing(*args, **kwargs)

    monkeypatch.setattr(compiler, "force_tokens", force_tokens)
    result = tune_pipeline(spec, out_dir=tmp_path / "tune", config=TuneConfig(rounds=1, candidates=3, repeats=1),
                           device="cpu", interleave=interleave, progress=lambda r: sample(f"after trial {r.trial}"))
    measured = [r for r in result.search.trials if r.relative is not None]
    assert len(measured) >= 4 and len([w for w, _, _ in seen if w == "token forcing"]) >= 5
    worst = max(seen, key=lambda s: s[1] + s[2])
    assert all(n_q <= 2 and n_down <= 1 for _, n_q, n_down in seen), (worst, seen)
    assert copies(q) == copies(down) == 0  # the search over, nothing of it stays
    assert all(r.peak_memory_gib is None for r in result.search.trials)  # a CPU has no device peak to report


@pytest.fixture
def nudging_format():
    """A weight format whose builder writes into the weight it is handed (x1.01), then serves it: the
    engine and, where they share the weight, token forcing's reference both read the nudged copy."""
    with registries_restored():
        def nudged(node, weight, compute):
            weight.mul_(1.01)
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            return linear

        torch_backend.register_weight_format("nudged", nudged, bits=32)
        yield ('pass nudge-down (lossless) "writes into a weight" {\n  rule r:\n'
               '    match linear where weight == "model.layers.0.mlp.down_proj.weight"\n    set format = "nudged"\n}\n')


def test_an_engine_that_writes_into_shared_weights_is_rejected(replay_spec, nudging_format, monkeypatch):
    """Sharing must not blind token forcing: a build that wrote into a weight its reference shares is
    rejected (without sharing the reference, rebuilt, would have caught the nudge itself), and the
    next trial of the search builds the weights afresh."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec, _ = replay_spec
    rules = (("nudge.rules", nudging_format),)
    with sharing_weights():
        first = run_trial(TrialJob(1, spec, "", (), "cpu", False))
        nudged = run_trial(TrialJob(2, spec, "nudge-down", rules, "cpu", False))
        after = run_trial(TrialJob(3, spec, "", (), "cpu", False))
    assert first.status == VALIDATED and after.status == VALIDATED
    assert nudged.status == REJECTED and "in place" in nudged.reason
    assert after.relative is not None and after.forcing == first.forcing
