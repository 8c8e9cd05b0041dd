"""The search loop: rounds of propose, predict, measure, gate, integrate.

    search = Search(setup, pool, memory, config)
    result = search.run(progress)

Round 0 measures the starting pipeline (the spec's own). Each round then:

1. the cost model prices the incumbent: its ranked gaps and its ceiling (the round's gap report);
2. proposers offer pipelines: every pass's schedule space placed in the incumbent's pipeline, the
   mechanisms memory validated on the nearest deployments (first round: seeded with them), and an
   LLM if one is configured;
3. each proposal is vetted (proposals.vet: DSL, verifier, contract); refused ones are recorded as
   rejected with their reason; candidates whose program was measured already are skipped;
4. each candidate is predicted (relative to AR, at the acceptance measured nearest its draft length,
   calibrated by this deployment's earlier trials; on a CPU priced by this host's measured record) and
   the best K are kept, at most half of them introducing the same pass, memory's seeds first;
5. the K and the incumbent (a control, measured again beside them) go to the workers;
6. every result is recorded in memory; the fastest validated candidate that beats the incumbent by
   `min_gain`, and beats it again in a confirmation (both measured once more side by side), becomes
   the incumbent and is marked a mechanism in memory. "Beats" is a confidence rule where the pool
   timed the round interleaved (each candidate and the control once per repeat, round-robin; the
   trial's `rounds_relative`: engine/AR of each prompt of each repeat at batch 1, of each repeat
   when served at batch): over those paired samples, the geometric mean of candidate / control is
   at most 1 - min_gain and its one-sided 90% upper bound (Student's t) is below 1 (faster, and
   measurably so). Where a pool gives one
   figure a trial (processes, Ray), the candidate must beat the incumbent's best measurement (this
   round's control or an earlier one) by `min_gain`.

It stops after `rounds`, when `patience` rounds in a row gain less than `min_gain` (the calibration
learns from each, so the next round's choice differs), or when the predicted gap to the
ceiling is below `min_gap` of the incumbent's time. Ctrl-C stops it between trials with the best
validated pipeline so far. Measured time decides; predictions only prune.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cost import Estimate
from ..dsl.pipeline import pass_names
from ..ir import Program
from ..passes import Pass
from ..dsl import parse_pipeline
from ..errors import PipelineError
from .fingerprint import Fingerprint
from .llm import LLMConfig, llm_proposals
from .memory import Memory
from .predict import Calibration, Predictor, rank_correlation
from .proposals import Candidate, Proposal, Rejection, vet
from .proposers import memory_proposals, schedule_space_proposals
from .trial import FAILED, REJECTED, VALIDATED, TrialJob, TrialResult


# one-sided 90% quantiles of Student's t by degrees of freedom 1..20 (beyond: 1.30, near the normal's 1.28)
T90 = (3.078, 1.886, 1.638, 1.533, 1.476, 1.440, 1.415, 1.397, 1.383, 1.372, 1.363, 1.356, 1.350, 1.345, 1.341,
       1.337, 1.333, 1.330, 1.328, 1.325)


def paired_ratio(candidate: list[float], control: list[float]) -> tuple[float, float] | None:
    """A candidate against the control timed beside it, sample by sample (engine/AR of each prompt of
    each repeat, or of each repeat): (geometric mean of candidate/control, its one-sided 90% upper
    confidence bound), or None without two samples of both."""
    d = [math.log(c / k) for c, k in zip(candidate, control) if c > 0 and k > 0]
    n = len(d)
    if n < 2:
        return None
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    t = T90[n - 2] if n - 1 <= len(T90) else 1.30
    return math.exp(mean), math.exp(mean + t * sd / math.sqrt(n))


@dataclass(frozen=True)
class TuneConfig:
    rounds: int = 3
    candidates: int = 4  # K measured per round
    min_gain: float = 0.02  # a round gains when its best beats its control by this share
    patience: int = 2  # rounds in a row without a gain before the search stops
    confirm: bool = True  # a round's winner must win again, measured beside the incumbent once more
    strict_referee: bool = True  # bf16 candidates also judged against fp32 (validate/referee.py)
    min_gap: float = 0.01  # stop when the predicted gap to the ceiling is below this share of the time
    repeats: int = 3  # interleaved pools: times each candidate and the control are timed round-robin a round
    llm: LLMConfig | None = None
    seed_from_memory: bool = True
    commit: str = ""

    def __post_init__(self):
        if self.rounds < 0 or self.candidates < 1 or self.repeats < 1:
            raise ValueError("rounds must be >= 0, candidates and repeats >= 1")


@dataclass(frozen=True)
class Setup:
    """The deployment a search tunes: its spec, stock program and starting pipeline."""

    spec: object  # PipelineSpec
    stock: Program
    start: str  # the starting pipeline string
    fingerprint: Fingerprint
    device: str  # where workers measure ("cpu", "cuda")
    gpu: str  # the cost model's device: the spec's GPU, or "cpu" (this host's measured record) on a CPU
    predictor: Predictor


@dataclass
class TrialRow:
    """One trial as the report shows it."""

    trial: int
    round: int
    pipeline: str
    proposer: str
    status: str
    reason: str = ""
    predicted_ms: float | None = None  # the cost model's engine ms/token on its device (Setup.gpu)
    predicted_rel: float | None = None  # predicted engine / AR
    calibrated_rel: float | None = None  # predicted_rel x calibration from earlier trials only
    measured_ms: float | None = None
    ar_ms: float | None = None
    relative: float | None = None  # measured engine / AR
    tau: float | None = None
    forcing: str = ""
    control: bool = False
    improved: bool = False
    note: str = ""
    rounds_relative: list[float] = field(default_factory=list)  # engine/AR per prompt and interleaved repeat
    vs_control: float | None = None  # geometric mean of this trial's repeats over the control's
    vs_control_bound: float | None = None  # its one-sided 90% upper bound (the confidence rule)
    peak_memory_gib: float | None = None  # device memory at most while it ran (TrialResult's); None on a CPU


@dataclass
class RoundLog:
    round: int
    incumbent: str
    incumbent_relative: float | None
    gaps: list[dict]
    ceiling_ms: float | None
    predicted_ms: float | None
    proposals: int
    rejected: int
    measured: int
    chosen: str | None
    gain: float | None
    notes: list[str] = field(default_factory=list)


@dataclass
class SearchResult:
    run: str
    start: str
    best: str
    best_relative: float | None
    start_relative: float | None
    trials: list[TrialRow]
    rounds: list[RoundLog]
    stopped: str
    gaps_before: list[dict]
    gaps_after: list[dict]
    interrupted: bool = False
    cost_device: str = ""  # what the predictions priced: the spec's GPU, or this host's CPU (measured)
    rank_correlation: dict = field(default_factory=dict)  # Spearman's rho of predicted vs measured engine/AR


def prediction_ranks(rows: list[TrialRow]) -> dict:
    """How the predictions ordered the measured trials (validated, predicted and measured): Spearman's
    rho of the raw and of the calibrated engine/AR against the measured one, and how many trials."""
    rows = [r for r in rows if r.status == VALIDATED and r.relative and r.predicted_rel and r.calibrated_rel]
    measured = [r.relative for r in rows]
    return {"raw": rank_correlation([r.predicted_rel for r in rows], measured),
            "calibrated": rank_correlation([r.calibrated_rel for r in rows], measured), "n": len(rows)}


def gap_rows(e: Estimate) -> list[dict]:
    return [{"what": g.what, "pass": g.pass_name, "pipeline": g.pipeline, "saving_ms": g.saving * 1e3,
             "fraction": g.fraction} for g in e.gaps]


def gap_report(e: Estimate) -> str:
    lines = [f"GPU {e.gpu}; time per output token {e.t_token.value * 1e3:.4f} ms (predicted), "
             f"ceiling {e.ceiling.t_token * 1e3:.4f} ms ({e.ceiling.pipeline or 'as is'}), "
             f"τ {e.tau.value:.2f}"]
    lines += [f"{i + 1}. {g.what}: {g.saving * 1e3:.4f} ms/token ({g.fraction:.0%}), closed by "
              f"{g.pipeline or '(no pass yet)'}" for i, g in enumerate(e.gaps)]
    return "\n".join(lines)


class Search:
    def __init__(self, setup: Setup, pool, memory: Memory | None, config: TuneConfig,
                 log: Callable[[str], None] | None = None):
        self.setup, self.pool, self.memory, self.config = setup, pool, memory, config
        self.log = log or (lambda _: None)
        self.run_id = uuid.uuid4().hex[:12]
        self.calibration = Calibration()
        self.rows: list[TrialRow] = []
        self.rounds: list[RoundLog] = []
        self.seen: dict[str, TrialRow] = {}  # ir hash -> first trial of that program
        self.next_trial = 0
        self.tried: list[tuple[str, str]] = []
        self.predicted: dict[str, tuple[float, float] | None] = {}  # ir hash -> the cost model's (s/token, engine/AR)
        self.estimates: dict[str, Estimate] = {}
        self.outcomes: dict[str, list[str]] = {}  # pass name -> statuses of the measured trials holding it

    # -- bookkeeping
    def _record(self, row: TrialRow, rules=()) -> int | None:
        self.rows.append(row)
        self.tried.append((row.pipeline, row.status + (f" {row.relative:.3f} of AR" if row.relative else
                                                       f": {row.reason[:80]}")))
        if self.memory is None:
            return None
        return self.memory.record(run=self.run_id, round=row.round, trial=row.trial,
                                  fingerprint=self.setup.fingerprint, pipeline=row.pipeline, rules=list(rules),
                                  proposer=row.proposer, status=row.status, reason=row.reason,
                                  predicted_ms=row.predicted_ms, calibrated_ms=None, measured_ms=row.measured_ms,
                                  ar_ms=row.ar_ms, relative=row.relative, tau=row.tau, forcing=row.forcing,
                                  forcing_passed=row.status == VALIDATED, commit_id=self.config.commit)

    def _trial_id(self) -> int:
        self.next_trial += 1
        return self.next_trial

    def _names(self, pipeline: str) -> frozenset[str]:
        return frozenset(pass_names(pipeline)) if pipeline else frozenset()

    def _estimate(self, c: Candidate) -> Estimate:
        program = c.program
        key = f"{c.ir_hash}:{self.setup.predictor.version}"
        if key not in self.estimates:
            self.estimates[key] = self.setup.predictor.estimate(program)
        return self.estimates[key]

    def _predict(self, c: Candidate) -> tuple[float | None, float | None, float | None]:
        program, pipeline = c.program, c.pipeline
        key = f"{c.ir_hash}:{self.setup.predictor.version}"
        if key not in self.predicted:
            self.predicted[key] = self.setup.predictor.relative(program)
        got = self.predicted[key]
        if got is None:
            return None, None, None
        t, rel = got
        return t * 1e3, rel, rel * self.calibration.factor(self._names(pipeline))

    def _measure(self, round_no: int, items: list[tuple[Candidate, bool]],
                 progress: Callable[[TrialResult], None] | None) -> list[tuple[TrialRow, int | None, Candidate]]:
        jobs, meta = [], {}
        for cand, control in items:
            job = TrialJob(self._trial_id(), self.setup.spec, cand.pipeline, cand.proposal.rules, self.setup.device,
                           self.config.strict_referee)
            jobs.append(job)
            meta[job.trial] = (cand, control)
        out = []

        def done(r: TrialResult) -> None:
            if progress:
                progress(r)

        results = self.pool.run(jobs, done)
        for r in results:
            cand, control = meta[r.trial]
            pred_ms, pred_rel, cal_rel = self._predict(cand)
            row = TrialRow(r.trial, round_no, cand.pipeline, cand.proposal.proposer, r.status, r.reason, pred_ms,
                           pred_rel, cal_rel, r.engine_ms, r.ar_ms, r.relative, r.tau, r.forcing, control,
                           note=cand.proposal.note, rounds_relative=list(r.extra.get("rounds_relative", [])),
                           peak_memory_gib=r.peak_memory_gib)
            row_id = self._record(row, cand.proposal.rules)
            out.append((row, row_id, cand))
            self.seen.setdefault(cand.ir_hash, row)
        for row, _, cand in out:
            if not row.control:
                for name in self._names(row.pipeline) - self._names(self.setup.start):
                    self.outcomes.setdefault(name, []).append(row.status)
        for row, _, cand in out:  # calibrate only after the round's predictions were made
            if row.status == VALIDATED and row.tau:
                self.setup.predictor.learn_trial(cand.program, row.tau)
            if row.status == VALIDATED and row.predicted_rel and row.relative:
                self.calibration.add(self._names(row.pipeline), row.predicted_rel, row.relative)
            elif row.status == FAILED and row.predicted_rel:  # does not run here: learn it as very slow
                self.calibration.add(self._names(row.pipeline), row.predicted_rel, row.predicted_rel * 100)
        return out

    def _wins(self, row: TrialRow, control: TrialRow, bar: float | None) -> bool:
        """Whether a validated candidate beats the control by min_gain: by the confidence rule over
        the repeats both were timed in side by side, else (one figure a trial) against `bar`, the
        incumbent's best engine/AR measured."""
        if row.status != VALIDATED or row.relative is None:
            return False
        paired = paired_ratio(row.rounds_relative, control.rounds_relative) if control.status == VALIDATED else None
        if paired is not None:
            row.vs_control, row.vs_control_bound = paired
            return paired[0] <= 1 - self.config.min_gain and paired[1] < 1.0
        return bar is not None and row.relative <= bar * (1 - self.config.min_gain)

    def _select(self, candidates: list[Candidate], k: int) -> list[Candidate]:
        """K candidates: memory's seeds first; then the best-predicted candidate of each direction
        (family) in the order of their best calibrated prediction, so every direction gets measured
        before one direction takes every slot; then the rest by prediction, at most half of the K
        from one direction. A pass whose every trial failed to run here is not tried again."""
        failed_here = {n for n, runs in self.outcomes.items() if runs and all(s == FAILED for s in runs)}
        scored = []
        for c in candidates:
            if self._names(c.pipeline) & failed_here:
                continue
            _, _, cal = self._predict(c)
            scored.append((0 if c.proposal.family == "memory" else 1, cal if cal is not None else math.inf, c))
        scored.sort(key=lambda s: (s[0], s[1]))
        chosen: list[Candidate] = [c for seed, _, c in scored if seed == 0][:k]
        per = Counter(c.proposal.family for c in chosen)
        for _, _, c in scored:  # one a direction first
            if len(chosen) < k and id(c) not in {id(x) for x in chosen} and per[c.proposal.family] == 0:
                chosen.append(c)
                per[c.proposal.family] += 1
        cap = max(1, math.ceil(k / 2))
        for _, _, c in scored:
            if len(chosen) < k and id(c) not in {id(x) for x in chosen} and per[c.proposal.family] < cap:
                chosen.append(c)
                per[c.proposal.family] += 1
        return chosen

    # -- the loop
    def run(self, progress: Callable[[TrialResult], None] | None = None) -> SearchResult:
        s, cfg = self.setup, self.config
        start_passes = parse_pipeline(s.start, source="the starting pipeline", plugins=True)
        start = vet(Proposal(s.start, "start"), s.stock)
        if isinstance(start, Rejection):
            raise PipelineError(f"the starting pipeline {s.start!r} is refused: {start.reason}")
        incumbent: Candidate = start
        incumbent_passes: list[Pass] = list(start_passes)
        stopped, interrupted = "rounds done", False
        gaps_before: list[dict] = []
        start_rel = incumbent_rel = None
        idle = 0  # rounds in a row without a gain
        try:
            (row, row_id, _), = self._measure(0, [(start, True)], progress)
            if row.status != VALIDATED:
                raise PipelineError(f"the starting pipeline {s.start!r} did not validate: {row.reason}")
            incumbent_rel = row.relative
            start_rel = row.relative
            if row.tau:
                s.predictor.learn_tau(start.program, row.tau)
            estimate = self._estimate(incumbent)
            gaps_before = gap_rows(estimate)
            for round_no in range(1, cfg.rounds + 1):
                estimate = self._estimate(incumbent)
                log = RoundLog(round_no, incumbent.pipeline, incumbent_rel, gap_rows(estimate),
                               estimate.ceiling.t_token * 1e3, estimate.t_token.value * 1e3, 0, 0, 0, None, None)
                self.rounds.append(log)
                gap_share = 1 - estimate.ceiling.t_token / estimate.t_token.value if estimate.t_token.value else 0
                if gap_share < cfg.min_gap:
                    stopped = f"predicted gap to the ceiling {gap_share:.1%} < {cfg.min_gap:.1%}"
                    break
                proposals = schedule_space_proposals(incumbent_passes, incumbent.program)
                if self.memory is not None and (cfg.seed_from_memory or round_no > 1):
                    proposals = memory_proposals(self.memory, s.fingerprint, incumbent_passes) + proposals
                if cfg.llm is not None:
                    found, note = llm_proposals(cfg.llm, gap_report(estimate), self.tried)
                    log.notes.append(note)
                    proposals += found
                log.proposals = len(proposals)
                candidates, hashes, texts = [], set(), set()
                for p in proposals:
                    if (p.pipeline, p.rules) in texts:
                        continue
                    texts.add((p.pipeline, p.rules))
                    v = vet(p, s.stock)
                    if isinstance(v, Rejection):
                        log.rejected += 1
                        self._record(TrialRow(self._trial_id(), round_no, p.pipeline, p.proposer, REJECTED, v.reason,
                                              note=p.note), p.rules)
                        continue
                    if v.ir_hash in self.seen or v.ir_hash in hashes or v.ir_hash == incumbent.ir_hash:
                        continue
                    hashes.add(v.ir_hash)
                    candidates.append(v)
                chosen = self._select(candidates, cfg.candidates)
                if not chosen:
                    stopped = "no new candidate to measure"
                    break
                measured = self._measure(round_no, [(c, False) for c in chosen] + [(incumbent, True)], progress)
                log.measured = len(measured)
                control = next(r for r, _, _ in measured if r.control)
                # the bar without repeats: the incumbent's best measurement, this round's or an earlier
                # one, so that a control that happened to run slow does not let noise pick the winner
                control_rel = min((x for x in (control.relative if control.status == VALIDATED else None,
                                               incumbent_rel) if x is not None), default=None)
                winners = [(r, rid, c) for r, rid, c in measured if not r.control and self._wins(r, control, control_rel)]
                best = min(winners, key=lambda x: x[0].vs_control or x[0].relative, default=None)
                fastest = min((r for r, _, _ in measured if not r.control and r.status == VALIDATED and r.relative),
                              key=lambda r: r.vs_control or r.relative, default=None)
                if best is not None and cfg.confirm:
                    # a duel: the winner and the incumbent measured again side by side; it must win again
                    duel = self._measure(round_no, [(best[2], False), (incumbent, True)], progress)
                    again, inc_again = duel[0][0], duel[1][0]
                    again.note = f"confirmation of trial {best[0].trial}"
                    log.measured += 2
                    if not self._wins(again, inc_again, inc_again.relative):
                        log.notes.append(f"trial {best[0].trial} ({best[0].pipeline}) did not win its confirmation: "
                                         f"{again.relative} against {inc_again.relative}"
                                         + (f" (repeats: {again.vs_control:.3f} of the control, 90% bound "
                                            f"{again.vs_control_bound:.3f})" if again.vs_control else ""))
                        best = None
                if best is None:
                    if fastest is not None:
                        log.gain = 1 - (fastest.vs_control or (fastest.relative / control_rel if control_rel else 1.0))
                    idle += 1
                    if idle >= cfg.patience:
                        stopped = f"{idle} rounds in a row gained less than {cfg.min_gain:.0%} over their control"
                        break
                    continue
                idle = 0
                row, rid, cand = best
                row.improved = True
                if self.memory is not None and rid is not None:
                    self.memory.mark_improved(rid)
                log.chosen, log.gain = row.pipeline, 1 - (row.vs_control or row.relative / control_rel)
                incumbent, incumbent_rel = cand, row.relative
                incumbent_passes = list(cand.passes)
                if row.tau:
                    s.predictor.learn_tau(cand.program, row.tau)
        except KeyboardInterrupt:
            stopped, interrupted = "interrupted (Ctrl-C): the best validated pipeline so far", True
        after = self._estimate(incumbent)
        return SearchResult(self.run_id, s.start, incumbent.pipeline, incumbent_rel, start_rel, self.rows, self.rounds,
                            stopped, gaps_before, gap_rows(after), interrupted, s.predictor.model.gpu.full_name,
                            prediction_ranks(self.rows))
