"""The engine client: admission, queue limits, the step loop, detokenization, stop sequences, cancellation.

One background thread owns the StepEngine (runtime/engine_api.py) and runs its step loop: it admits
waiting requests while the engine has free slots (`max_batch`), steps every active request, turns
each request's new tokens into text, ends a request at EOS, at max_tokens or at a stop sequence, and
releases its slot. The server's handlers (app.py) only `submit` a request and read its outputs from
an asyncio queue; closing that stream (a client that went away) aborts the request, and the loop
frees its slot before its next step.

Stop sequences are matched on the detokenized text, as OpenAI's API defines them: the text up to the
first stop string is returned (the stop string not included) and the request ends there. Streamed
text holds back the longest tail that could still begin a stop string, and a tail that ends inside
a multi-byte character (the tokenizer decodes it as U+FFFD), until the next tokens decide it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..runtime.engine_api import RequestParams, StepEngine
from .metrics import ServeMetrics


class RequestError(Exception):
    """A request the server refuses: `status` is the HTTP status, the rest goes into OpenAI's error shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # requests the engine runs at once
    max_queue: int = 64  # requests waiting for a slot; one more is refused with 429
    context: int = 1024  # positions the models hold: prompt + max_tokens + one verify must fit
    verify_tokens: int = 1  # positions one verify step may write past the output (the step graph's q)


@dataclass
class Output:
    """What one request produced since the last Output: new token ids and the text they settle."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or a stop sequence), "length" (max_tokens), "abort", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: RequestParams
    stop: tuple[str, ...]
    emit: Callable[[Output], None]
    arrived: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    sent_chars: int = 0  # characters of the text already handed out
    first_token_at: float | None = None


class Detokenizer:
    """Text of a request's tokens so far, the part safe to hand out, and where a stop string ends it."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self.decode, self.stop = decode, tuple(s for s in stop if s)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)

    def settle(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """(text that may be handed out, whether a stop string was found: then the text ends before it)."""
        text = self.decode(tokens)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        if final:
            return text, False
        end = len(text) - self.hold
        while end > 0 and text[end - 1] == "\ufffd":  # an unfinished multi-byte character
            end -= 1
        return text[:max(end, 0)], False


class Scheduler:
    """Owns the StepEngine and its step loop thread; the asyncio side submits and reads outputs."""

    def __init__(self, engine: StepEngine, decode: Callable[[list[int]], str], eos_token_id: int | None,
                 config: SchedulerConfig, metrics: ServeMetrics | None = None) -> None:
        self.engine, self.decode, self.eos, self.config = engine, decode, eos_token_id, config
        self.metrics = metrics or ServeMetrics()
        self.waiting: deque[Request] = deque()
        self.running: dict[str, tuple[Request, Detokenizer]] = {}
        self.aborted: set[str] = set()
        self.cv = threading.Condition()
        self.closing = False
        self.ids = itertools.count()
        self.thread = threading.Thread(target=self.loop, name="specpilot-step-loop", daemon=True)
        self.thread.start()

    # ---- the asyncio side -------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], max_new_tokens: int, param: str = "prompt") -> None:
        """RequestError (400) unless the prompt and its new tokens fit the positions the models hold."""
        if not prompt_ids:
            raise RequestError(400, "the prompt gives no tokens", param=param)
        room = self.config.context - self.config.verify_tokens
        if len(prompt_ids) + max_new_tokens > room:
            raise RequestError(400, f"This model's maximum context length is {room} tokens (of "
                               f"{self.config.context} positions, {self.config.verify_tokens} kept for a verify "
                               f"step). However, you requested {len(prompt_ids) + max_new_tokens} tokens "
                               f"({len(prompt_ids)} in the prompt, {max_new_tokens} for the completion).",
                               param=param, code="context_length_exceeded")

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of this length leaves room for."""
        return max(0, self.config.context - self.config.verify_tokens - prompt_len)

    def submit(self, prompt_ids: list[int], params: RequestParams, stop: tuple[str, ...] = (),
               param: str = "prompt") -> "RequestStream":
        """Queue a request (RequestError now if it does not fit, the queue is full or the server is
        closing); its Outputs arrive through the returned stream, whose `aclose` aborts it."""
        self.check(prompt_ids, params.max_new_tokens, param)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Output] = asyncio.Queue()
        rid = f"req-{next(self.ids)}"
        request = Request(rid, list(prompt_ids), params, tuple(stop),
                          lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        with self.cv:
            if self.closing:
                raise RequestError(503, "the server is shutting down", type_="server_error", code="shutting_down")
            if len(self.waiting) >= self.config.max_queue:
                self.metrics.rejected.inc()
                raise RequestError(429, f"the server is busy: {len(self.waiting)} requests are waiting "
                                   f"(max_queue {self.config.max_queue}); retry later", type_="rate_limit_exceeded",
                                   code="queue_full")
            self.waiting.append(request)
            self.metrics.waiting.set(len(self.waiting))
            self.cv.notify()
        return RequestStream(self, rid, queue)

    def abort(self, rid: str) -> None:
        with self.cv:
            self.aborted.add(rid)
            self.cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let those admitted or waiting finish within `timeout`, cancel the rest."""
        with self.cv:
            self.closing = True
            self.cv.notify()
        self.thread.join(timeout)
        if self.thread.is_alive():
            with self.cv:
                self.aborted.update(r.rid for r in self.waiting)
                self.aborted.update(list(self.running))
                self.cv.notify()
            self.thread.join(timeout)

    # ---- the step loop thread ---------------------------------------------------------------------
    def loop(self) -> None:
        while True:
            with self.cv:
                while not (self.waiting or self.running or self.aborted or self.closing):
                    self.cv.wait()
                if self.closing and not (self.waiting or self.running):
                    return
                self.drop_aborted()
                admitted = self.admit()
            for request in admitted:
                self.start(request)
            if not self.running:
                continue
            try:
                new = self.engine.step()
            except Exception as e:  # the engine failed: every running request ends with the error
                for rid in list(self.running):
                    self.finish(rid, "error", error=f"{type(e).__name__}: {e}")
                continue
            self.metrics.steps.inc()
            for rid, tokens in new.items():
                if rid in self.running:
                    self.advance(rid, tokens)

    def drop_aborted(self) -> None:
        """Cancelled requests leave the queue, or the engine (freeing their slot); called holding cv."""
        if not self.aborted:
            return
        kept = deque(r for r in self.waiting if r.rid not in self.aborted)
        for r in self.waiting:
            if r.rid in self.aborted:
                r.emit(Output([], "", True, "abort", len(r.prompt_ids), 0))
                self.metrics.finished.labels("abort").inc()
        self.waiting = kept
        for rid in self.aborted & set(self.running):
            self.finish(rid, "abort")
        self.aborted.clear()
        self.metrics.waiting.set(len(self.waiting))

    def admit(self) -> list[Request]:
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.engine.max_batch:
            admitted.append(self.waiting.popleft())
        self.metrics.waiting.set(len(self.waiting))
        return admitted

    def start(self, request: Request) -> None:
        try:
            self.engine.admit(request.rid, request.prompt_ids, request.params)
        except Exception as e:
            request.emit(Output([], "", True, "error", len(request.prompt_ids), 0, error=f"{type(e).__name__}: {e}"))
            self.metrics.finished.labels("error").inc()
            return
        self.running[request.rid] = (request, Detokenizer(self.decode, request.stop))
        self.metrics.running.set(len(self.running))
        self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        if request.params.max_new_tokens == 0:
            self.finish(request.rid, "length")

    def advance(self, rid: str, tokens: list[int]) -> None:
        request, detok = self.running[rid]
        if not tokens:
            return
        now = time.perf_counter()
        if request.first_token_at is None:
            request.first_token_at = now
            self.metrics.ttft.observe(now - request.arrived)
        room = request.params.max_new_tokens - len(request.tokens)
        tokens = tokens[:room]
        if self.eos is not None and self.eos in tokens:
            tokens = tokens[:tokens.index(self.eos) + 1]
        request.tokens.extend(tokens)
        self.metrics.generation_tokens.inc(len(tokens))
        reason = None
        if tokens and tokens[-1] == self.eos:
            reason = "stop"
        elif len(request.tokens) >= request.params.max_new_tokens:
            reason = "length"
        text, stopped = detok.settle(request.tokens, final=reason is not None)
        if stopped:
            reason = "stop"
        delta = text[request.sent_chars:]
        request.sent_chars = len(text)
        if reason is None:
            request.emit(Output(tokens, delta, prompt_tokens=len(request.prompt_ids),
                                completion_tokens=len(request.tokens)))
        else:
            self.finish(rid, reason, tokens, delta)

    def finish(self, rid: str, reason: str, tokens: list[int] | None = None, delta: str = "",
               error: str | None = None) -> None:
        request, _ = self.running.pop(rid)
        self.engine.release(rid)
        self.metrics.running.set(len(self.running))
        self.metrics.finished.labels(reason).inc()
        self.metrics.latency.observe(time.perf_counter() - request.arrived)
        request.emit(Output(tokens or [], delta, True, reason, len(request.prompt_ids), len(request.tokens), error))


class RequestStream:
    """A submitted request's Outputs, in order, up to the finished one; `aclose` before then aborts it."""

    def __init__(self, scheduler: Scheduler, rid: str, queue: "asyncio.Queue[Output]") -> None:
        self.scheduler, self.rid, self.queue = scheduler, rid, queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Output:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        self.finished = out.finished
        return out

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self.scheduler.abort(self.rid)
