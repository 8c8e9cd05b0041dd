"""`specpilot serve`: an engine behind the OpenAI-compatible app, run by uvicorn."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..backends.torch_backend import Engine
from .app import ServedModel, create_app
from ..runtime.tokenizer import ChatTemplate
from .metrics import ServeMetrics
from .routed import step_engine_for
from .scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8  # requests in flight in the engine
    max_queue: int = 64  # requests waiting for a slot; more are refused with 429
    drain_s: float = 30.0  # at shutdown: how long running and waiting requests may take to finish
    log_level: str = "info"
    batching: bool = True  # requests in the batched engine (else every request one after another)


def served_model(name: str, engine: Engine, tokenizer, chat: ChatTemplate) -> ServedModel:
    return ServedModel(name=name, encode=lambda text: tokenizer.encode(text).ids,
                       decode=lambda ids: tokenizer.decode(ids), vocab_size=engine.target_cfg.vocab_size,
                       chat=chat, context=engine.target_cfg.max_position_embeddings, created=int(time.time()))


def build_app(name: str, engine: Engine, tokenizer, chat: ChatTemplate, config: ServeConfig, log=None):
    """The app over `engine`: every request in the batched engine where it serves the engine, else in
    the batch-1 loops (serve/routed.py), under the scheduler. `log` hears which way requests run and why."""
    model = served_model(name, engine, tokenizer, chat)
    q = engine.program.step.one("verify")[1]["q"]
    sched_cfg = SchedulerConfig(max_batch=config.max_batch, max_queue=config.max_queue, context=model.context,
                                verify_tokens=q)
    step_engine, how = step_engine_for(engine, config.max_batch, model.context, config.batching)
    (log or (lambda line: print(line, file=sys.stderr, flush=True)))(f"requests: {how}")

    def make_scheduler(metrics: ServeMetrics) -> Scheduler:
        return Scheduler(step_engine, model.decode, engine.eos_token_id, sched_cfg, metrics)

    return create_app(model, make_scheduler, config.drain_s)


def run_server(name: str, engine: Engine, tokenizer, chat: ChatTemplate, config: ServeConfig) -> None:
    """Serve until SIGINT/SIGTERM; then finish (or, after drain_s, cancel) what is in flight and return."""
    import uvicorn

    app = build_app(name, engine, tokenizer, chat, config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           timeout_graceful_shutdown=config.drain_s, lifespan="on"))
    # uvicorn handles SIGINT/SIGTERM while it runs, then raises the signal again under the handlers it
    # found: these make that a normal return (exit status 0) once the server has shut down cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()


def engine_chat_template(root: Path) -> ChatTemplate:
    from ..runtime.tokenizer import load_chat_template

    return load_chat_template(Path(root) / "target")
