"""What the search hands a worker and what comes back: data only, picklable, JSON-ready.

A `TrialJob` is one candidate pipeline of one deployment: the spec (as loaded), the pipeline
string and the rules texts it needs (proposals are data: the worker parses them with the DSL like
any user's), the device the worker runs it on. A `TrialResult` is what the worker measured: the
AR loop and the engine on the same prompts (prefill excluded), τ, and the token-forcing verdict.

The worker itself (build, measure, force) is the compiler's (`specpilot.compiler.run_trial`):
the agent sits below the compiler and is handed that function, so it never imports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

VALIDATED = "validated"  # measured, token forcing passed
REJECTED = "rejected"  # refused: by vetting (DSL, verifier, contract) or by token forcing
FAILED = "failed"  # the candidate did not build or run here (an error, a worker that died)


@dataclass(frozen=True)
class TrialJob:
    trial: int  # the run's trial number (unique within a search)
    spec: Any  # specpilot.spec.PipelineSpec (frozen, picklable)
    pipeline: str
    rules: tuple[tuple[str, str], ...] = ()  # (source, text) of the rules files this pipeline needs
    device: str = "cpu"
    strict_referee: bool = True  # bf16 engines: judge against fp32 (validate/referee.py)


@dataclass
class TrialResult:
    trial: int
    pipeline: str
    status: str  # VALIDATED, REJECTED or FAILED
    reason: str = ""
    ar_ms: float | None = None  # AR ms/token measured beside the engine
    engine_ms: float | None = None  # engine ms/token
    tau: float | None = None
    tokens_checked: int = 0
    hard_failures: int = 0
    near_ties: int = 0
    forcing: str = ""  # the token-forcing summary line
    ir_hash: str = ""
    device: str = ""
    wall_s: float = 0.0
    # the device memory allocated at most while it ran (GiB; an interleaved round's: all its engines at
    # once); None on a CPU
    peak_memory_gib: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def relative(self) -> float | None:
        """Engine ms/token over the AR ms/token measured beside it: the figure candidates are ranked
        by, so that a machine slowed by other work slows both sides alike."""
        if self.ar_ms and self.engine_ms:
            return self.engine_ms / self.ar_ms
        return None

    @property
    def forcing_passed(self) -> bool:
        return self.status == VALIDATED

    def to_dict(self) -> dict:
        return {**asdict(self), "relative": self.relative}

    @staticmethod
    def failed(job: TrialJob, reason: str) -> "TrialResult":
        return TrialResult(job.trial, job.pipeline, FAILED, reason=reason, device=job.device)
