"""Replay drafters, targets by shape and the replay benchmark: accept lengths follow the plan, outputs
stay AR greedy (every token forced), eager and graphed loops alike (uncaptured on a CPU); specs by
shape validate, bad ones fail in one line."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from specpilot.backends.torch_backend import ReplaySetup, ShapeModels, build_engine
from specpilot.cli import main
from specpilot.dsl import parse_pipeline
from specpilot.hf.known import dflash_config, model_config, pard_config
from specpilot.ir import lower
from specpilot.passes import run_passes
from specpilot.profiles import load_profile
from specpilot.runtime.decode import Generation
from specpilot.runtime.replay import Replay, ReplayPlan
from specpilot.spec import parse_spec
from specpilot.validate.forcing import force_tokens

PROMPTS = [[72, 101, 108, 108, 111, 32, 119], [100, 101, 102, 32, 102, 40, 120, 41, 58, 10]]


def shape_models(shape: str) -> ShapeModels:
    """The tiny shape's replay pairs: a one-layer DFlash network (the 5-layer recipe runs in the
    compile and benchmark tests) or the tiny PARD network."""
    drafter = dflash_config("tiny", layers=1, block_size=8) if shape == "dflash" else pard_config("tiny", k=6)
    return ShapeModels(model_config("tiny"), drafter, ReplaySetup("dflash-qwen3-8b", "humaneval"))


@pytest.fixture
def host_tree_builder(monkeypatch):
    """The graphed tree loops with the best-first tree kernel's reference (a heap on the host) rather
    than the kernel under the Triton interpreter: what is checked here is the replay, not the kernel."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("proposal", ["chain", "tree"])
@pytest.mark.parametrize("shape", ["dflash", "pard"])
def test_a_replay_run_accepts_as_planned_and_outputs_ar_greedy(shape, proposal, graphs, host_tree_builder):
    models = shape_models(shape)
    pipeline = ",".join(p for p in ("tree-verify{budget=12, topk=3}" if proposal == "tree" else "",
                                    "cuda-graphs" if graphs else "") if p)
    program, _ = run_passes(lower(models.target_cfg, models.drafter_cfg), parse_pipeline(pipeline))
    engine = build_engine(program, None, None, torch.device("cpu"), shape=models)
    calls = []
    network = getattr(engine.drafter, "model", engine.drafter)  # the replay network: a real module, counted
    network.register_forward_hook(lambda *_: calls.append(1))
    runs = []
    for prompt in PROMPTS:
        ar = engine.generate_ar(prompt, 20)
        before = len(calls)
        gen = engine.generate(prompt, 20)
        assert gen.tokens == ar.tokens
        plan = engine.replay.plans[tuple(prompt), 20]
        assert plan.settled and gen.accepted[:-1] == plan.accepts[: len(gen.accepted) - 1]
        assert len(calls) - before >= gen.steps  # every step ran the drafter network
        runs.append((gen.accepted, 20))
    reference, cfg = models.target(torch.float32, torch.device("cpu"))
    assert force_tokens(reference, cfg, PROMPTS, [engine.generate(p, 20).tokens for p in PROMPTS], "float32").passed
    summary = engine.replay.summary(runs)
    assert summary["measured_tau"] == summary["drawn_tau"] and summary["plans_settled"] == "2/2"


def test_the_overwrite_makes_the_truth_the_top_token_or_no_candidate():
    plan = ReplayPlan(32, "cpu")
    truth = list(range(3, 35))
    plan.load(truth, bonus_positions=[12, 20])
    logits = torch.randn(1, 16, 40)
    out = plan.overwrite(logits.clone(), torch.tensor(9) + 1)  # rows draft positions 10..25
    for r in range(16):
        pos = 10 + r
        if pos in (12, 20):
            assert truth[pos] not in out[0, r].topk(8).indices.tolist()
        else:
            assert out[0, r].argmax() == truth[pos]


class ChunkedVerifier:
    """A model-free engine whose greedy choice at output index `flip` depends on where a verify puts
    it (row parity), as a bf16 near-tie does: the continuation after it follows what was committed
    there. Its drafter follows the plan's buffers exactly as the replay drafters do."""

    def __init__(self, plan: ReplayPlan, prompt_len: int, k: int, flip: int):
        self.plan, self.p, self.k, self.flip = plan, prompt_len, k, flip
        self.base = [(7 * i + 3) % 50 for i in range(400)]
        self.alt = [(11 * i + 5) % 50 + 50 for i in range(400)]

    def run(self, max_new: int) -> Generation:
        truth, bonus = self.plan.truth.tolist(), self.plan.bonus.tolist()
        out, accepted, alt = [self.base[0]], [], False

        def verify(i: int, row: int) -> int:
            if i == self.flip:
                return self.alt[i] if row % 2 else self.base[i]
            return self.alt[i] if alt and i > self.flip else self.base[i]

        while len(out) < max_new:
            a, n = len(out) - 1, 0
            while n < self.k and not bonus[self.p + a + n + 1] and truth[self.p + a + n + 1] == verify(a + n + 1, n + 1):
                n += 1
            span = [verify(a + j, j) for j in range(1, n + 2)]
            kept = span[: max_new - len(out)]
            if a < self.flip <= a + len(kept):
                alt = kept[self.flip - a - 1] == self.alt[self.flip]
            out += kept
            accepted.append(len(kept) - 1)
        return Generation(tokens=out, accepted=accepted, steps=len(accepted))


def test_plans_settle_where_the_verify_breaks_a_near_tie_by_where_a_token_sits():
    dist = load_profile("dflash-qwen3-8b").distribution("humaneval", drafts=7)
    replay = Replay(ReplayPlan(512, "cpu"), dist, seed=3)
    runs = []
    for i in range(40):
        prompt = [1] * (5 + i % 7)
        fake = ChunkedVerifier(replay.plan, len(prompt), dist.k, flip=9 + i % 13)
        gen = replay.generate(prompt, 96, lambda: fake.run(96))
        plan = replay.plans[tuple(prompt), 96]
        assert plan.settled and gen.accepted[:-1] == plan.accepts[: len(gen.accepted) - 1]
        runs.append((gen.accepted, 96))
    s = replay.summary(runs)
    assert s["plans_settled"] == "7/7"  # the same 7 prompt lengths recur: a plan settles once, then holds
    assert s["measured_tau"] == pytest.approx(dist.tau, rel=0.03)


SHAPE_SPEC = {"name": "t", "target": {"shape": "tiny", "weights": "random", "seed": 1},
              "drafter": {"kind": "replay", "profile": "dflash-qwen3-8b", "benchmark": "gsm8k", "block_size": 8},
              "serving": {"max_new_tokens": 40}, "benchmark": {"prompts": "code-smoke", "num_prompts": 2},
              "passes": "cuda-graphs"}


def test_a_spec_by_shape_round_trips_with_its_replay_defaults():
    spec = parse_spec(SHAPE_SPEC, "p.yaml")
    assert spec.target == "tiny" and spec.target_shape.seed == 1
    assert (spec.drafter.shape, spec.drafter.benchmark) == ("dflash", "gsm8k")
    assert parse_spec(spec.to_dict(), "p.yaml") == spec


@pytest.mark.parametrize("change, fragment", [
    ({"target": {"shape": "llama-9b"}}, "field 'target.shape': expected one of"),
    ({"target": {"shape": "tiny", "weights": "hf"}}, "field 'target.weights': expected one of random"),
    ({"drafter": {"kind": "dflash"}}, "field 'drafter.kind': expected 'replay'"),
    ({"target": "tiny-qwen3"}, "field 'drafter.kind': expected dflash or pard"),
    ({"drafter": {"kind": "replay", "profile": "pard-llama-3.1-8b"}}, "field 'drafter.profile': profile 'pard-llama-3.1-8b' has no τ"),
    ({"drafter": {"kind": "replay", "profile": "dflash-qwen3-8b", "benchmark": "trivia"}}, "field 'drafter.benchmark'"),
    ({"drafter": {"kind": "replay", "profile": "dflash-qwen3-8b", "path": "x"}}, "field 'drafter.path': expected no path"),
    ({"drafter": {"kind": "replay", "profile": "dflash-qwen3-8b", "shape": "eagle"}}, "field 'drafter.shape'"),
])
def test_a_bad_spec_by_shape_fails_in_one_line_and_writes_nothing(tmp_path, change, fragment):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({**SHAPE_SPEC, **change}))
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "e"), "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert fragment in r.output and len(r.output.strip().splitlines()) == 1 and str(path) in r.output
    assert not (tmp_path / "e").exists()


def test_compile_by_shape_reports_the_profile_against_the_measurement(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(SHAPE_SPEC))
    r = CliRunner().invoke(main, ["compile", str(path), "-o", str(tmp_path / "e"), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "e" / "report.json").read_text())
    replay = report["replay"]
    assert replay["profile"] == "dflash-qwen3-8b/gsm8k" and replay["published_tau"] == 6.54
    assert replay["measured_tau"] == replay["drawn_tau"] and "2602.06036" in replay["source"]
    assert report["predicted"]["engine_ms_per_token"] > 0 and report["target"]["shape"] == "tiny"
    assert report["outputs_equal_ar"] == "2/2" and report["token_forcing"].startswith("token forcing PASS")
    assert not list((tmp_path / "e").rglob("*.safetensors"))  # random weights: rebuilt from the seed, not stored
    run = CliRunner().invoke(main, ["run", str(tmp_path / "e"), "--prompt", "def f(x):", "--max-new-tokens", "8",
                                    "--device", "cpu"])
    assert run.exit_code == 0, run.output


def test_the_replay_benchmark_smoke_run_writes_its_rows(tmp_path, host_tree_builder):
    from bench.e2e import replay as bench

    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    doc = json.loads(next(tmp_path.glob("replay_cpu_*.json")).read_text())
    rows = doc["records"]
    assert {(r["config"], r["variant"]) for r in rows} == {("chain16", "base"), ("tree16", "base"),
                                                            ("chain16", "vocab"), ("tree16", "vocab")}
    for r in rows:
        assert r["passed"] and r["plans_settled"] == "2/2"
        assert set(r["terms_ms"]) == {"draft", "propose", "verify", "accept_commit", "launch_sync", "host"}
        assert r["loop_efficiency"] > 0 and r["speedup"] > 0
    assert {"loop_efficiency_chain", "loop_efficiency_tree", "best_speedup"} <= set(doc["aims"])
