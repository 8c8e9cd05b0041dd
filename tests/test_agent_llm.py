"""The LLM proposer through the official `openai` client against a real server process on
localhost. The server is SCRIPTED (tests/scripted_openai_server.py): it answers from a fixed list,
it is no model. What is tested is the client path, the prompt the proposer sends (gap report,
pass catalogue, grammar), and that every answer, hostile ones included, is only ever data."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.agent.llm import LLMConfig, llm_proposals, parse_answer
from specpilot.agent.proposals import Candidate, Rejection, vet
from specpilot.agent.search import Search, TuneConfig
from specpilot.agent.workers import InlinePool
from specpilot.passes import REGISTRY

from test_agent import registry, scripted, setup_for, tiny  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent

ANSWER = """Here are candidates.
PIPELINE: cuda-graphs,draft-block-size{size=3}
PIPELINE: no-such-pass{x=1}
PIPELINE: __import__('os').system('touch PWNED')
PIPELINE: weight-thief
RULES:
pass weight-thief (lossless) "steal" {
  rule r:
    match lm_head
    set weight = "model.embed_tokens.weight"
}
END
PIPELINE: graph-accept
RULES:
pass graph-accept (lossless) "accept on the device, graphed" {
  rule a:
    match accept where on == "host"
    set on = "device"
  rule g:
    match schedule
    set graphs = true
}
END
"""


@pytest.fixture
def server(tmp_path):
    script, log, port = tmp_path / "script.json", tmp_path / "requests.log", tmp_path / "port"
    script.write_text(json.dumps([ANSWER]))
    proc = subprocess.Popen([sys.executable, str(HERE / "scripted_openai_server.py"), str(script), str(log), str(port)],
                            cwd=tmp_path)
    deadline = time.time() + 30
    while not port.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert port.exists(), "the scripted server did not start"
    yield f"http://127.0.0.1:{port.read_text()}/v1", log, tmp_path
    proc.kill()
    proc.wait()


def test_openai_client_against_the_scripted_server(server, tiny, registry):  # noqa: F811
    url, log, cwd = server
    found, note = llm_proposals(LLMConfig(url, model="scripted"), "1. launch overhead: 0.8 ms", [("", "validated")])
    assert "5 proposals" in note
    sent = json.loads(log.read_text().splitlines()[0])
    prompt = sent["messages"][1]["content"]
    assert "launch overhead" in prompt and "draft-block-size" in prompt and "pass_def" in prompt
    verdicts = {p.pipeline: vet(p, tiny[1]) for p in found}
    assert isinstance(verdicts["cuda-graphs,draft-block-size{size=3}"], Candidate)
    assert isinstance(verdicts["graph-accept"], Candidate)
    for hostile in ("no-such-pass{x=1}", "__import__('os').system('touch PWNED')", "weight-thief"):
        assert isinstance(verdicts[hostile], Rejection), hostile
    assert not (cwd / "PWNED").exists()
    assert "checkpoint" in verdicts["weight-thief"].reason


def test_search_with_the_llm_proposer_records_its_rejections(server, tiny, registry):  # noqa: F811
    url, _, _ = server
    config = TuneConfig(rounds=1, candidates=3, llm=LLMConfig(url, model="scripted"))
    result = Search(setup_for(tiny), InlinePool(scripted({"cuda-graphs": 0.5, "graph-accept": 0.45})), None,
                    config).run()
    llm_rows = [r for r in result.trials if r.proposer == "llm"]
    assert {r.status for r in llm_rows} >= {"rejected"}
    assert any("unknown pass" in r.reason for r in llm_rows)
    assert "5 proposals" in result.rounds[0].notes[0]


def test_parse_answer_takes_text_only():
    got = parse_answer("PIPELINE: a\nnoise\nPIPELINE: b\nRULES:\npass b (lossless) { rule r: match x remove }\nEND\n", "s")
    assert [p.pipeline for p in got] == ["a", "b"]
    assert got[1].rules[0][1].startswith("pass b")


@pytest.mark.slow
def test_llm_proposer_against_specpilot_serve(tmp_path, tiny, registry):  # noqa: F811
    """The project's own OpenAI-compatible server (`specpilot serve`, a real process) over a tiny
    engine as the endpoint. The tiny model holds 2048 positions and the proposer's prompt (gap report,
    catalogue, grammar) is about 5000 tokens: the server answers an OpenAI-shaped 400, the proposer
    records it as the round's note with no proposals, and the search goes on without it."""
    from specpilot.compiler import compile_pipeline
    from specpilot.spec import load_spec

    from conftest import tiny_spec
    from test_serve import start_server, stop_server

    spec = tmp_path / "p.yaml"
    spec.write_text(tiny_spec("pard"))
    compile_pipeline(load_spec(spec), out_dir=tmp_path / "engine", device="cpu")
    proc, url = start_server(tmp_path / "engine", log=tmp_path / "server.log")
    try:
        found, note = llm_proposals(LLMConfig(f"{url}/v1", model="t", max_tokens=16), "1. launch overhead", [])
        assert found == [] and "BadRequestError" in note and "maximum context length" in note, note
        config = TuneConfig(rounds=1, candidates=2, llm=LLMConfig(f"{url}/v1", model="t", max_tokens=16))
        result = Search(setup_for(tiny), InlinePool(scripted({"cuda-graphs": 0.5})), None, config).run()
        assert "cuda-graphs" in result.best and "maximum context length" in result.rounds[0].notes[0]
    finally:
        assert stop_server(proc) == 0
