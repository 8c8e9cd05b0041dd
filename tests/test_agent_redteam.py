"""Red team: cheats planted where a search would meet them, each caught and recorded as rejected.

The cheats are planted in a poisoned memory (rows claiming each was a validated improvement on
this very deployment), so the search's first round is seeded with them and takes each through the
same gates as any proposal:

- a rule that changes a weight (the lm_head reads the embedding's weight): the IR verifier;
- a pass that claims acceptance on the GPU without doing it (accept on the device, no graphed
  step to run it): the IR verifier;
- a lower-precision weight swap declared lossless (fp32 matmuls stored in bf16): the contract check;
- a candidate that caches outputs between prompts (a plugin weight format that replays the lm_head
  output it computed for an earlier input of the same shape): built, measured, and token forcing
  rejects it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from specpilot.agent.fingerprint import fingerprint
from specpilot.agent.memory import Memory
from specpilot.agent.predict import Predictor
from specpilot.agent.search import Search, Setup, TuneConfig
from specpilot.agent.trial import REJECTED, TrialJob
from specpilot.agent.workers import InlinePool
from specpilot.compiler import lower_spec, resolve_models, run_trial
from specpilot.passes.plugins import load_module
from specpilot.passes.what_if import what_ifs
from specpilot.spec import load_spec

from conftest import registries_restored, tiny_spec

CACHING_PLUGIN = '''
"""A planted cheat: the lm_head remembers its output per input shape and replays it."""
from dataclasses import dataclass

from torch import nn

from specpilot.backends.torch_backend import register_weight_format
from specpilot.passes import Pass, PassResult, register


class Replaying(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.seen = {}

    def forward(self, x):
        key = tuple(x.shape)
        if key not in self.seen:  # computed once, then served to every later step and prompt
            self.seen[key] = x @ self.weight.to(x.dtype).T
        return self.seen[key]


register_weight_format("replaying", lambda node, weight, compute: Replaying(weight.to(compute)), bits=32)


@register
@dataclass(frozen=True)
class ReplayHead(Pass):
    """Serve the target's lm_head from a cache of earlier outputs (declared lossless: a lie)."""
    name = "replay-head"
    lossless = True

    def apply(self, program):
        g, changed = program.target, False
        for name, node in program.target.items():
            if node.op == "lm_head" and node["format"] != "replaying":
                g, changed = g.with_node(name, node.replace(format="replaying")), True
        return PassResult(program.with_graph("target", g) if changed else program, changed)
'''

RULES = {
    "weight": ('pass swap-head-weight (lossless) "a rule that changes a weight" {\n  rule r:\n    match lm_head\n'
               '    set weight = "model.embed_tokens.weight"\n}\n'),
    "device-accept": ('pass device-accept (lossless) "claims acceptance on the GPU" {\n  rule r:\n'
                      '    match accept where on == "host"\n    set on = "device"\n}\n'),
    "precision": ('pass fp32-to-bf16 (lossless) "lower precision, declared lossless" {\n  rule r:\n'
                  '    match linear where format == "float32"\n    set format = "bfloat16"\n}\n'),
}
PIPELINES = {"weight": "swap-head-weight", "device-accept": "device-accept", "precision": "fp32-to-bf16",
             "caching": "replay-head"}


@pytest.fixture
def planted(tmp_path):
    with registries_restored():
        plugin = tmp_path / "replay_head.py"
        plugin.write_text(textwrap.dedent(CACHING_PLUGIN))
        spec_path = tmp_path / "p.yaml"
        spec_path.write_text(tiny_spec("dflash", extra=f"plugins: [{plugin}]\n"))
        load_module(plugin, "test: ")
        yield spec_path


@pytest.mark.slow
def test_planted_cheats_are_caught_and_recorded_as_rejected(planted, tmp_path):
    spec = load_spec(planted)
    stock = lower_spec(spec, resolve_models(spec), "float32")
    fp = fingerprint(stock, "cpu")
    memory = Memory(tmp_path / "poisoned.db")
    for cheat, pipeline in PIPELINES.items():  # the poison: each claimed a validated improvement here
        rules = [(f"planted {cheat}", RULES[cheat])] if cheat in RULES else []
        rid = memory.record(run="poison", round=1, trial=1, fingerprint=fp, pipeline=pipeline, rules=rules,
                            proposer="planted", status="validated", relative=0.01, forcing_passed=True)
        memory.mark_improved(rid)
    setup = Setup(spec, stock, "", fp, "cpu", "h200", Predictor("h200", what_ifs))
    search = Search(setup, InlinePool(run_trial), memory, TuneConfig(rounds=1, candidates=1))
    result = search.run()
    rows = {r["pipeline"]: r for r in memory.trials(run=search.run_id)}
    for cheat, pipeline in PIPELINES.items():
        assert rows[pipeline]["status"] == REJECTED, (cheat, rows[pipeline])
        assert rows[pipeline]["improved"] == 0
    assert "checkpoint" in rows["swap-head-weight"]["reason"]  # the verifier: a weight's name is a fact
    assert "device" in rows["device-accept"]["reason"]  # the verifier: no backend accepts there without graphs
    assert "contract" in rows["fp32-to-bf16"]["reason"]
    assert "token forcing" in rows["replay-head"]["reason"]  # built and measured, then refused
    assert rows["replay-head"]["relative"] is not None
    assert "replay-head" not in result.best


def test_token_forcing_alone_catches_the_caching_cheat(planted):
    result = run_trial(TrialJob(1, load_spec(planted), "replay-head"))
    assert result.status == REJECTED and result.hard_failures > 0
