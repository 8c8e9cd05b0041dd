"""The search agent (specpilot/agent): vetting proposals, the round loop, calibration, the report.

Most tests drive the loop with a scripted evaluator (a table of measured ratios by pass) so the
loop's decisions are checked exactly and fast; test_tune_cli_zoo_tiny runs the real thing (build,
measure, token forcing) on a tiny pair, and test_process_workers runs real trials in two worker
processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from specpilot.agent.fingerprint import fingerprint
from specpilot.agent.memory import Memory
from specpilot.agent.predict import Calibration, Predictor
from specpilot.agent.proposals import Candidate, Proposal, Rejection, vet
from specpilot.agent.report import write_report
from specpilot.agent.search import Search, Setup, TuneConfig
from specpilot.agent.trial import FAILED, REJECTED, VALIDATED, TrialJob, TrialResult
from specpilot.agent.workers import InlinePool, ProcessPool, WorkersSpec
from specpilot.cli import main
from specpilot.compiler import lower_spec, resolve_models, run_trial
from specpilot.dsl.pipeline import pass_names
from specpilot.errors import SpecError
from specpilot.passes import REGISTRY
from specpilot.passes.what_if import what_ifs
from specpilot.spec import load_spec

from conftest import tiny_spec


@pytest.fixture
def registry():
    """Rules passes a test's proposals register are gone after it."""
    saved = dict(REGISTRY)
    yield
    REGISTRY.clear()
    REGISTRY.update(saved)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent") / "tiny.yaml"
    path.write_text(tiny_spec("dflash"))
    spec = load_spec(path)
    stock = lower_spec(spec, resolve_models(spec), "float32")
    return spec, stock


def setup_for(tiny, start: str = "") -> Setup:
    spec, stock = tiny
    return Setup(spec, stock, start, fingerprint(stock, "cpu"), "cpu", "h200", Predictor("h200", what_ifs))


# ---------------------------------------------------------------------------------------- vetting

HOSTILE = {
    "unknown pass": ("no-such-pass", ()),
    "bad parameter": ("draft-block-size{size=-3}", ()),
    "wrong parameter name": ("draft-block-size{blocks=3}", ()),
    "python smuggled as a pipeline": ("__import__('os').system('touch /tmp/pwned')", ()),
    "python in a parameter": ("draft-block-size{size=exec('1')}", ()),
    "a rule that edits a weight": ("swap-weight", (("r1", 'pass swap-weight (lossless) {\n rule r:\n  match lm_head\n'
                                                          '  set weight = "model.embed_tokens.weight"\n}'),)),
    "a rule that changes a shape": ("grow", (("r2", 'pass grow (lossless) {\n rule r:\n  match linear\n'
                                                   '  set out_features = 7\n}'),)),
    "accept on the device without graphed steps": ("claim-device-accept", (("r3", 'pass claim-device-accept '
                                                   '(lossless) {\n rule r:\n  match accept\n  set on = "device"\n}'),)),
    "lower precision declared lossless": ("bf16-swap", (("r4", 'pass bf16-swap (lossless) {\n rule r:\n  match '
                                          'linear where format == "float32"\n  set format = "bfloat16"\n}'),)),
    "a lossy rules pass": ("honest-bf16", (("r5", 'pass honest-bf16 (lossy) {\n rule r:\n  match linear\n'
                                                  '  set format = "bfloat16"\n}'),)),
    "a rules pass taking a built-in's name": ("cuda-graphs", (("r6", 'pass cuda-graphs (lossless) {\n rule r:\n'
                                                                     '  match accept\n  set on = "host"\n}'),)),
    "rules text that is Python": ("x", (("r7", "import os\nos.system('true')"),)),
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_hostile_proposals_are_rejected_with_a_reason(what, tiny, registry, tmp_path):
    pipeline, rules = HOSTILE[what]
    before = set(tmp_path.iterdir())
    got = vet(Proposal(pipeline, "llm", rules), tiny[1])
    assert isinstance(got, Rejection), what
    assert got.reason
    assert not Path("/tmp/pwned").exists() and set(tmp_path.iterdir()) == before


def test_rejection_reasons_name_the_check(tiny, registry):
    reason = lambda key: vet(Proposal(HOSTILE[key][0], "llm", HOSTILE[key][1]), tiny[1]).reason  # noqa: E731
    assert "unknown pass" in reason("unknown pass")
    assert "weight" in reason("a rule that edits a weight") and "checkpoint" in reason("a rule that edits a weight")
    assert "contract" in reason("lower precision declared lossless")
    assert "lossy" in reason("a lossy rules pass")
    assert "device" in reason("accept on the device without graphed steps")


def test_a_good_rules_proposal_is_a_candidate(tiny, registry):
    rules = (("ok", 'pass graph-it (lossless) {\n rule a:\n  match accept where on == "host"\n  set on = "device"\n'
                    ' rule g:\n  match schedule\n  set graphs = true\n}'),)
    got = vet(Proposal("graph-it,draft-block-size{size=3}", "llm", rules), tiny[1])
    assert isinstance(got, Candidate)
    assert got.program.step.one("draft")[1]["block_size"] == 3
    assert got.program.step.one("accept")[1]["on"] == "device"


# ---------------------------------------------------------------------------------------- the loop

def scripted(table: dict[str, float], *, fail: set[str] = frozenset(), cheat: set[str] = frozenset(),
             interrupt_at: int | None = None, calls: list | None = None):
    """An evaluator: engine/AR = product of the table's factor for each pass name in the pipeline
    (1.0 for the empty one); passes in `fail` fail to build, in `cheat` fail token forcing."""

    def evaluate(job: TrialJob) -> TrialResult:
        if calls is not None:
            calls.append(job.pipeline)
        if interrupt_at is not None and job.trial >= interrupt_at:
            raise KeyboardInterrupt
        names = pass_names(job.pipeline) if job.pipeline else []
        if set(names) & set(fail):
            return TrialResult.failed(job, "EngineError: needs a GPU")
        rel = 1.0
        for n in names:
            rel *= table.get(n, 1.0)
        if set(names) & set(cheat):
            return TrialResult(job.trial, job.pipeline, REJECTED, "token forcing: 3 hard failures", 10.0, 10.0 * rel,
                               2.0, 48, 3, 0, "token forcing FAIL")
        return TrialResult(job.trial, job.pipeline, VALIDATED, "", 10.0, 10.0 * rel, 2.0, 48, 0, 0, "token forcing PASS")

    return evaluate


def test_search_takes_the_measured_winner_and_records_everything(tiny, tmp_path):
    memory = Memory(tmp_path / "m.db")
    table = {"cuda-graphs": 0.6, "draft-block-size": 0.9, "tree-verify": 1.4}
    search = Search(setup_for(tiny), InlinePool(scripted(table, fail={"attention-split-kv"}, cheat={"fused-decoder"})),
                    memory, TuneConfig(rounds=3, candidates=4))
    result = search.run()
    assert "cuda-graphs" in result.best
    assert result.best_relative < 0.6 + 1e-9
    assert result.start_relative == 1.0
    statuses = {r.status for r in result.trials}
    assert {VALIDATED} <= statuses
    rows = memory.trials(run=search.run_id)
    assert len(rows) == len(result.trials)
    assert any(r["improved"] for r in rows)
    # every improvement taken is recorded as a mechanism, and only validated rows are
    assert all(r["forcing_passed"] for r in rows if r["improved"])
    # the rounds' logs hold the cost model's gaps
    assert result.rounds and result.rounds[0].gaps and result.gaps_before


def test_a_cheat_that_fails_token_forcing_is_never_chosen(tiny, tmp_path):
    table = {"cuda-graphs": 0.1}  # the fastest by far, but it fails token forcing
    result = Search(setup_for(tiny), InlinePool(scripted(table, cheat={"cuda-graphs"})), None,
                    TuneConfig(rounds=2, candidates=6)).run()
    assert "cuda-graphs" not in result.best
    assert any(r.status == REJECTED and "cuda-graphs" in r.pipeline for r in result.trials)


def test_search_stops_when_a_round_gains_too_little(tiny):
    result = Search(setup_for(tiny), InlinePool(scripted({})), None, TuneConfig(rounds=5, candidates=2,
                                                                                patience=1)).run()
    assert result.best == "" and "gained less" in result.stopped
    assert len(result.rounds) == 1


def test_ctrl_c_leaves_the_best_so_far(tiny):
    calls = []
    table = {"cuda-graphs": 0.5, "draft-block-size": 0.95}
    # trial numbers count rejected proposals too: interrupt once round 2 starts measuring
    first = Search(setup_for(tiny), InlinePool(scripted(table)), None, TuneConfig(rounds=1, candidates=6)).run()
    n_round1 = max(r.trial for r in first.trials)
    result = Search(setup_for(tiny), InlinePool(scripted(table, interrupt_at=n_round1 + 1, calls=calls)), None,
                    TuneConfig(rounds=3, candidates=6)).run()
    assert result.interrupted and "interrupted" in result.stopped
    assert result.best == first.best and "cuda-graphs" in result.best


def test_memory_seeds_a_new_deployment(tiny, tmp_path):
    memory = Memory(tmp_path / "m.db")
    table = {"cuda-graphs": 0.6}
    Search(setup_for(tiny), InlinePool(scripted(table)), memory, TuneConfig(rounds=2, candidates=3)).run()
    other = replace(setup_for(tiny), fingerprint=replace(setup_for(tiny).fingerprint, drafter_kind="pard"))
    calls = []
    Search(other, InlinePool(scripted(table, calls=calls)), memory, TuneConfig(rounds=1, candidates=1)).run()
    # trial 1 is the start; the one candidate of round 1 is memory's mechanism
    assert "cuda-graphs" in calls[1]


def test_llm_that_fails_gives_a_note_and_the_search_goes_on(tiny):
    from specpilot.agent.llm import LLMConfig

    config = TuneConfig(rounds=1, candidates=2, llm=LLMConfig("http://127.0.0.1:9/v1", timeout_s=2))
    result = Search(setup_for(tiny), InlinePool(scripted({"cuda-graphs": 0.5})), None, config).run()
    assert "cuda-graphs" in result.best
    assert "LLM proposer" in result.rounds[0].notes[0]


# ---------------------------------------------------------------------------------------- calibration

def test_calibration_learns_per_pass_and_never_from_the_trial_it_predicts(tiny):
    cal = Calibration()
    assert cal.factor(frozenset({"cuda-graphs"})) == 1.0
    for _ in range(4):
        cal.add(frozenset({"cuda-graphs"}), 0.5, 2.0)  # 4x slower than predicted where it does not pay
        cal.add(frozenset(), 1.0, 1.0)
    assert cal.factor(frozenset({"cuda-graphs"})) / cal.factor(frozenset()) > 2.0
    assert cal.factor(frozenset()) == pytest.approx(1.0, abs=0.3)
    # the search's rows: each calibrated prediction was made before its trial was added
    table = {"cuda-graphs": 3.0, "draft-block-size": 0.9}
    search = Search(setup_for(tiny), InlinePool(scripted(table)), None, TuneConfig(rounds=2, candidates=3))
    result = search.run()
    first = [r for r in result.trials if r.relative is not None and r.calibrated_rel is not None]
    assert first[0].calibrated_rel == pytest.approx(first[0].predicted_rel)  # nothing learned before trial 1


# ---------------------------------------------------------------------------------------- workers

def test_workers_spec_parses_and_refuses():
    assert WorkersSpec.parse("3") == WorkersSpec(3)
    assert WorkersSpec.parse("ray://10.0.0.1:10001").ray == "ray://10.0.0.1:10001"
    with pytest.raises(SpecError, match="--workers"):
        WorkersSpec.parse("lots")


@pytest.mark.slow
def test_process_workers_run_real_trials_pinned_to_devices(tiny):
    """Two spawned CPU workers share the CPU (issue 48's path: worker i on devices[i % n]); each
    builds, measures and token-forces a real candidate."""
    spec, _ = tiny
    pool = ProcessPool(run_trial, 2, ["cpu"])
    try:
        jobs = [TrialJob(1, spec, ""), TrialJob(2, spec, "draft-block-size{size=3}"), TrialJob(3, spec, "no-such")]
        results = pool.run(jobs)
    finally:
        pool.close()
    assert [r.trial for r in results] == [1, 2, 3]
    assert results[0].status == VALIDATED and results[1].status == VALIDATED
    assert results[2].status == FAILED and "no-such" in results[2].reason
    assert {r.extra.get("worker") for r in results[:2]} <= {0, 1}
    assert all(r.device == "cpu" for r in results[:2])


# ---------------------------------------------------------------------------------------- the report

def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(chromium() is None, reason="headless Chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tiny, tmp_path):
    table = {"cuda-graphs": 0.6, "draft-block-size": 0.9}
    result = Search(setup_for(tiny), InlinePool(scripted(table, cheat={"fused-decoder"})), None,
                    TuneConfig(rounds=2, candidates=3)).run()
    page = write_report(tmp_path / "out", result, "tiny")
    dom = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60).stdout
    from html.parser import HTMLParser

    class Find(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.svgs, self.inside, self.chosen = set(), [], None, ""

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "id" in a:
                self.ids.add(a["id"])
                self.inside = a["id"]
            if tag == "svg":
                self.svgs.append(tag)

        def handle_data(self, data):
            if self.inside == "chosen-pipeline":
                self.chosen += data

        def handle_endtag(self, tag):
            if tag == "code":
                self.inside = None

    f = Find()
    f.feed(dom)
    assert f.chosen == result.best and "cuda-graphs" in f.chosen
    assert {"plot-progress", "plot-predicted-vs-measured", "plot-gaps"} <= f.ids
    assert len(f.svgs) >= 3
    doc = json.loads((tmp_path / "out" / "search.json").read_text())
    assert doc["best"] == result.best and len(doc["trials"]) == len(result.trials)


# ---------------------------------------------------------------------------------------- the command

@pytest.mark.slow
def test_tune_cli_zoo_tiny(tiny, tmp_path):
    """`specpilot tune` end to end on a tiny pair: real builds, measurements and token forcing;
    an engine directory and a report come out, and `specpilot memory` lists the trials."""
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(tiny_spec("dflash"))
    r = CliRunner().invoke(main, ["tune", str(spec_path), "--rounds", "1", "--candidates", "1", "--min-gain", "0.99",
                                  "--device", "cpu",
                                  "--memory", str(tmp_path / "m.db"), "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "engine" / "engine.json").is_file()
    assert (tmp_path / "out" / "report.html").is_file()
    r = CliRunner().invoke(main, ["memory", str(tmp_path / "m.db")])
    assert r.exit_code == 0 and "dflash" in r.output
    assert Memory(tmp_path / "m.db").count() >= 3


@pytest.mark.slow
def test_interleaved_trials_time_candidates_round_robin(tiny):
    """What a one-GPU search runs (InterleavedPool): a round's candidates built in one process and
    timed in rotated order, each token-forced; one that does not build fails alone. Here on the CPU."""
    from specpilot.compiler import run_trials_interleaved

    spec, _ = tiny
    results = run_trials_interleaved([TrialJob(1, spec, ""), TrialJob(2, spec, "no-such-pass"),
                                      TrialJob(3, spec, "draft-block-size{size=2}")], rounds=2)
    assert [r.status for r in results] == [VALIDATED, FAILED, VALIDATED]
    assert all(r.engine_ms and r.ar_ms and r.tokens_checked for r in (results[0], results[2]))


# ---------------------------------------------------------------------------------------- batch regimes

def regime_scripted(tables: dict[int, dict[str, float]]):
    """A measurer whose figures depend on the deployment's batch (the job's serving.batch_sizes), as
    the real ones do: the batch-1 loops or the batched engine at the largest batch."""
    def evaluate(job: TrialJob) -> TrialResult:
        return scripted(tables[max(job.spec.serving.batch_sizes)])(job)

    return evaluate


def regime_setup(tiny, batch: int) -> Setup:
    spec, _ = tiny
    spec = replace(spec, serving=replace(spec.serving, batch_sizes=(batch,)))
    stock = lower_spec(spec, resolve_models(spec), "float32")
    return Setup(spec, stock, "", fingerprint(stock, "cpu", spec.serving.batch_sizes), "cpu", "h200",
                 Predictor("h200", what_ifs))


def test_batch_regimes_choose_their_own_pipelines_and_memory_keeps_them_apart(tiny, tmp_path):
    """At batch 1 CUDA graphs pay and speculation control does nothing; at batch 32 the reverse (the
    batching passes are offered only there). One shared memory: each regime's trials and best
    pipeline stay under its own fingerprint, and the other regime's mechanism is only a seed that
    must win its own measurement."""
    tables = {1: {"cuda-graphs": 0.6, "spec-control": 1.0}, 32: {"cuda-graphs": 1.3, "spec-control": 0.5,
                                                                 "verify-budget": 0.8}}
    memory = Memory(tmp_path / "m.db")
    one, many = regime_setup(tiny, 1), regime_setup(tiny, 32)
    assert one.fingerprint.batch == "b1" and many.fingerprint.batch == "b32"
    config = TuneConfig(rounds=2, candidates=4, patience=1)
    b1 = Search(one, InlinePool(regime_scripted(tables)), memory, config).run()
    b32 = Search(many, InlinePool(regime_scripted(tables)), memory, config).run()
    assert "cuda-graphs" in b1.best and "spec-control" not in b1.best
    assert {"spec-control", "verify-budget"} & set(pass_names(b32.best)) and "cuda-graphs" not in b32.best
    batching = ("spec-control", "verify-budget", "ragged-verify")
    assert not any(n in r.pipeline for r in b1.trials for n in batching)  # nothing they change at batch 1
    # the batch-1 mechanism was offered to batch 32 as a seed, and not taken
    assert any(r.proposer == "memory" and "cuda-graphs" in r.pipeline for r in b32.trials)
    by_key = {s["fingerprint"]["batch"]: s for s in memory.summary()}
    assert set(by_key) == {"b1", "b32"}
    assert by_key["b1"]["best_pipeline"] == b1.best and by_key["b32"]["best_pipeline"] == b32.best
    own = [m.pipeline for m in memory.mechanisms(many.fingerprint) if m.distance == 0]
    assert b32.best in own and not any("cuda-graphs" in m for m in own)


# ---------------------------------------------------------------------------------------- the confidence rule

def test_paired_ratio_bounds_the_gain():
    from specpilot.agent.search import paired_ratio

    assert paired_ratio([0.8], [1.0]) is None  # one repeat says nothing about the noise
    mean, bound = paired_ratio([0.80, 0.82, 0.79], [1.0, 1.02, 0.99])
    assert mean == pytest.approx(0.803, abs=0.005) and mean < bound < 0.85
    mean, bound = paired_ratio([0.70, 1.10, 0.85], [1.0, 1.0, 1.0])  # faster on average, but noisy
    assert mean < 0.9 and bound > 1.0


def test_interleaved_repeats_decide_by_the_confidence_rule(tiny):
    """A pool that times each round's candidates and control round-robin (InterleavedPool): a candidate
    whose mean beats the control but whose repeats scatter is not taken; a steady one is."""
    from specpilot.agent.workers import InterleavedPool

    repeats = {"cuda-graphs": [0.55, 1.25, 0.75], "draft-block-size": [0.90, 0.91, 0.90]}  # engine/AR per repeat

    def evaluate_many(jobs):
        out = []
        for job in jobs:
            names = set(pass_names(job.pipeline)) if job.pipeline else set()
            rounds = [1.0, 1.0, 1.0]
            for n in names:
                rounds = [a * b for a, b in zip(rounds, repeats.get(n, [1.0, 1.0, 1.0]))]
            r = TrialResult(job.trial, job.pipeline, VALIDATED, "", 10.0, 10.0 * sum(rounds) / 3, 2.0, 48, 0, 0,
                            "token forcing PASS", extra={"rounds_relative": rounds})
            out.append(r)
        return out

    result = Search(setup_for(tiny), InterleavedPool(evaluate_many, "cpu"), None,
                    TuneConfig(rounds=1, candidates=8, patience=1)).run()
    graphs = [r for r in result.trials if r.pipeline == "cuda-graphs" and not r.control]
    assert graphs and graphs[0].relative < 0.9 and graphs[0].vs_control_bound > 1.0  # the lowest mean, not sure
    assert "draft-block-size" in result.best and "cuda-graphs" not in result.best
    taken = next(r for r in result.trials if r.improved)
    assert taken.vs_control <= 0.98 and taken.vs_control_bound < 1.0 and len(taken.rounds_relative) == 3


@pytest.mark.slow
def test_a_batched_deployment_is_measured_as_served(tiny, monkeypatch):
    """A trial of a deployment served at batch 3 times the batched engine against the stock batched AR
    (compiler.measure_trial): every request of the run (2 x 3 in flight, prompts cycled) token-forced."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the batched engine's SDPA path: the kernels have their own tests
    spec, _ = tiny
    spec = replace(spec, serving=replace(spec.serving, batch_sizes=(3,)))
    r = run_trial(TrialJob(1, spec, ""))
    assert r.status == VALIDATED, r.reason
    assert r.extra["prompts"] == 6 and r.tokens_checked > 6 * 2
    assert r.engine_ms and r.ar_ms and r.tau >= 1.0


def test_memory_offers_each_pass_of_a_mechanism_alone(tiny, tmp_path):
    """A mechanism validated on another deployment (block 3 with CUDA graphs) is offered as it was, and
    each of its passes alone: the other deployment's block size need not carry over."""
    from specpilot.agent.proposers import memory_proposals

    memory = Memory(tmp_path / "m.db")
    fp = setup_for(tiny).fingerprint
    row = memory.record(run="r", round=1, trial=2, fingerprint=replace(fp, drafter_kind="pard"), pipeline=
                        "draft-block-size{size=3},cuda-graphs", proposer="schedule-space", status=VALIDATED,
                        relative=0.5, forcing_passed=True)
    memory.mark_improved(row)
    got = {p.pipeline for p in memory_proposals(memory, fp, [])}
    assert got == {"draft-block-size{size=3},cuda-graphs", "draft-block-size{size=3}", "cuda-graphs"}
