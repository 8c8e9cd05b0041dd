"""The OpenAI-compatible HTTP layer: request models in, one handler per endpoint, errors in OpenAI's shape.

    GET  /v1/models            the one model this server serves (the engine's name)
    POST /v1/completions       prompt (text or token ids) -> text; `stream` for server-sent events
    POST /v1/chat/completions  messages through the chat template (runtime/tokenizer.py) -> an assistant message
    GET  /metrics              Prometheus text format (metrics.py)
    GET  /health               200 while the step loop runs

Handlers hold no scheduling: they tokenize, check the model name, and read the scheduler's outputs
(scheduler.py owns admission, queue limits, the step loop, stop sequences and cancellation).
"""

from __future__ import annotations

import json
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.engine_api import RequestParams
from ..runtime.tokenizer import ChatTemplate
from .metrics import ServeMetrics
from .protocol import (ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage)
from .scheduler import Output, RequestError, Scheduler


DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServedModel:
    """What the handlers know of the engine: its name, tokenizer and chat template, its context."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    chat: ChatTemplate
    context: int
    created: int


def create_app(model: ServedModel, make_scheduler: Callable[[ServeMetrics], Scheduler],
               drain_s: float = 30.0) -> FastAPI:
    """The app; its lifespan starts the scheduler's step loop and, at shutdown, lets running and
    waiting requests finish for up to `drain_s` seconds, then cancels the rest."""
    metrics = ServeMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.scheduler = make_scheduler(metrics)
        yield
        await anyio.to_thread.run_sync(app.state.scheduler.close, drain_s)

    app = FastAPI(title="specpilot", lifespan=lifespan)
    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        return JSONResponse(validation_body(e), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(model)]}

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str) -> dict:
        check_model(model, name)
        return model_card(model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(model, body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise RequestError(400, str(e), param="prompt") from None
        ids = model.encode(prompt) if isinstance(prompt, str) else check_ids(prompt, model.vocab_size)
        params = request_params(body, body.max_tokens or 16)
        outputs = request.app.state.scheduler.submit(ids, params, body.stops())
        rid, created = new_id("cmpl"), now()

        def chunk(out: Output) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                    "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                 "finish_reason": out.finish_reason if out.finished else None}]}

        if body.stream:
            return sse_response(outputs, chunk, body.include_usage(), rid, created, model.name, "text_completion")
        text, last = await collect(outputs, request)
        return {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}],
                "usage": usage(last.prompt_tokens, last.completion_tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(model, body.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise RequestError(400, str(e), param="messages") from None
        try:
            ids = model.encode(model.chat.render(messages))
        except TemplateError as e:  # a template may refuse a conversation (roles out of order, ...)
            raise RequestError(400, f"the chat template ({model.chat.source}) refused the messages: {e}",
                               param="messages") from None
        scheduler = request.app.state.scheduler
        limit = body.token_limit()
        params = request_params(body, limit if limit is not None else max(1, scheduler.room(len(ids))))
        outputs = scheduler.submit(ids, params, body.stops(), param="messages")
        rid, created = new_id("chatcmpl"), now()

        def chunk(out: Output, first: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if first else ({"content": out.text} if out.text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": out.finish_reason if out.finished and not first else None}]}

        if body.stream:
            return sse_response(outputs, chunk, body.include_usage(), rid, created, model.name,
                                "chat.completion.chunk", first=chunk)
        text, last = await collect(outputs, request)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": last.finish_reason}],
                "usage": usage(last.prompt_tokens, last.completion_tokens)}

    return app


def model_card(model: ServedModel) -> dict:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "specpilot",
            "max_model_len": model.context}


def check_model(model: ServedModel, name: str) -> None:
    if name != model.name:
        raise RequestError(400, f"The model {name!r} does not exist: this server serves {model.name!r}",
                           param="model", code="model_not_found")


def check_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                           param="prompt")
    return ids


def request_params(body, max_tokens: int) -> RequestParams:
    return RequestParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed)


def validation_body(e: RequestValidationError) -> dict:
    """A 400 in OpenAI's shape naming the first bad field (or the JSON that did not parse)."""
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return error_body("We could not parse the JSON body of your request: expected a JSON object.",
                          "invalid_request_error", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return error_body(f"{param or 'body'}: {first.get('msg', 'invalid request')}", "invalid_request_error", param,
                      "invalid_value" if param else None)


async def collect(outputs: AsyncIterator[Output], request: Request) -> tuple[str, Output]:
    """The whole text of a request and its last Output; RequestError if it ended in an error or was
    cancelled. A client that disconnects before the end aborts the request (its slot is freed)."""
    parts, last = [], None
    async with aclosing(outputs) as stream, anyio.create_task_group() as tasks:

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_S)
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        async for out in stream:
            parts.append(out.text)
            last = out
        tasks.cancel_scope.cancel()
    if last is None or not last.finished:
        raise RequestError(499, "the client closed the request", code="client_closed")
    if last.finish_reason == "error":
        raise RequestError(500, f"the engine failed: {last.error}", type_="server_error")
    if last.finish_reason == "abort":
        raise RequestError(503, "the request was cancelled: the server is shutting down", type_="server_error")
    return "".join(parts), last


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def sse_response(outputs: AsyncIterator[Output], chunk, include_usage: bool, rid: str, created: int, name: str,
                 obj: str, first=None) -> StreamingResponse:
    """Server-sent events of a request: a chunk per Output with text (and the last one), the usage
    chunk where asked, then [DONE]. Closing the stream (the client left) aborts the request."""

    async def events():
        last = None
        async with aclosing(outputs) as stream:
            if first is not None:
                yield sse(first(Output([], ""), True))
            async for out in stream:
                last = out
                if out.finished and out.finish_reason in ("error", "abort"):
                    why = out.error or "the server is shutting down"
                    yield sse(error_body(f"the request ended early: {why}", "server_error"))
                    return
                if out.text or out.finished:
                    yield sse(chunk(out))
        if include_usage and last is not None:
            yield sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                       "usage": usage(last.prompt_tokens, last.completion_tokens)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/metrics", "/health")


class CountRequests:
    """ASGI middleware: counts every HTTP request by endpoint and status (specpilot_http_requests)."""

    def __init__(self, app, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests.labels(path, str(status["code"])).inc()
