"""The StepEngine the server runs: every request in the batched engine where it serves the engine.

The batched engine (runtime/batch.py, `Engine.batched`) packs every request's drafts into one ragged
verify forward a step, with requests joining and leaving at every step; greedy and sampled requests
share the batch (a sampled one samples losslessly with its own seeded uniforms, so its tokens are
its batch-1 loop's for its seed whatever shares the batch: runtime/batch.py's docstring). Hybrid
(Gated DeltaNet) targets too, their recurrent state a row a request (runtime/batch_hybrid.py).

Engines the batched engine does not serve (replay drafters) run every request in
`Batch1StepEngine`, one after another; `batched_engine_for` says why, and the server logs it.
"""

from __future__ import annotations

from ..backends.torch_backend import Engine
from ..errors import EngineError
from ..runtime.engine_api import StepEngine
from .batch1 import Batch1StepEngine


def batched_engine_for(engine: Engine, max_batch: int, context: int, attention=None) -> tuple[StepEngine | None, str]:
    """The batched engine over `engine` for `max_batch` requests of up to `context` positions, or
    None and the reason it cannot serve this engine. `attention`: the engine's ragged attention
    (None: the backend's, kernel_hooks.ragged_attention)."""
    if engine.replay is not None:
        return None, "a replay drafter follows per-request plans the server does not make"
    try:
        batched = engine.batched(max_batch=max_batch, capacity=context + engine.block_size + 2, attention=attention)
    except EngineError as e:
        return None, str(e)
    return batched, "greedy and sampled requests share one batched verify a step"


def step_engine_for(engine: Engine, max_batch: int, context: int, batching: bool = True,
                    attention=None) -> tuple[StepEngine, str]:
    """The StepEngine the server runs over `engine`: the batched engine where it serves it (and
    `batching` is on), else the batch-1 loops one request after another; and why."""
    batched, why = batched_engine_for(engine, max_batch, context, attention) if batching else \
        (None, "batching turned off")
    if batched is not None:
        return batched, f"batched ({why})"
    return Batch1StepEngine(engine, max_batch), f"one after another ({why})"
