"""The StepEngine the server runs: greedy requests in the batched engine, sampled ones beside it.

The batched engine (runtime/batch.py, `Engine.batched`) packs every greedy request's drafts into one
ragged verify forward a step, with requests joining and leaving at every step; it decodes greedily
only. Requests at temperature > 0 run in `Batch1StepEngine` (lossless speculative sampling, one
request after another). Both share the server's `max_batch` slots, and one `step()` advances both.

Engines the batched engine does not serve (hybrid targets, replay drafters) run every request in
`Batch1StepEngine`; `batched_engine_for` says why, and the server logs it.
"""

from __future__ import annotations

from ..backends.torch_backend import Engine
from ..errors import EngineError
from ..runtime.engine_api import RequestParams, StepEngine
from .batch1 import Batch1StepEngine


def batched_engine_for(engine: Engine, max_batch: int, context: int, attention=None) -> tuple[StepEngine | None, str]:
    """The batched engine over `engine` for `max_batch` greedy requests of up to `context` positions,
    or None and the reason it cannot serve this engine. `attention`: the engine's ragged attention
    (None: the backend's, kernel_hooks.ragged_attention)."""
    if engine.replay is not None:
        return None, "a replay drafter follows per-request plans the server does not make"
    try:
        batched = engine.batched(max_batch=max_batch, capacity=context + engine.block_size + 2, attention=attention)
    except EngineError as e:
        return None, str(e)
    return batched, "greedy requests share one batched verify a step"


class RoutedStepEngine:
    """Greedy requests to `batched`, sampled ones (and all of them where `batched` is None) to
    `sequential`; at most `max_batch` in flight together."""

    def __init__(self, batched: StepEngine | None, sequential: Batch1StepEngine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.batched, self.sequential, self.max_batch = batched, sequential, max_batch
        self.where: dict[str, StepEngine] = {}

    def admit(self, rid: str, prompt_ids: list[int], params: RequestParams) -> None:
        if rid in self.where:
            raise ValueError(f"request {rid!r} is already active")
        if len(self.where) >= self.max_batch:
            raise ValueError(f"{len(self.where)} requests active: max_batch is {self.max_batch}")
        engine = self.batched if self.batched is not None and params.temperature == 0 else self.sequential
        engine.admit(rid, prompt_ids, params)
        self.where[rid] = engine

    def step(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for engine in (self.batched, self.sequential):
            if engine is not None and engine.active():
                out.update(engine.step())
        return out

    def release(self, rid: str) -> None:
        engine = self.where.pop(rid, None)
        if engine is not None:
            engine.release(rid)

    def active(self) -> list[str]:
        return list(self.where)
