"""The HTTP routes: OpenAI (/v1/chat/completions, /v1/completions, /v1/models), Anthropic
(/v1/messages, /v1/messages/count_tokens) and /health.

Bodies are read and validated by hand rather than through FastAPI's automatic models: that is
what lets every client mistake - bad JSON, a wrong type, an oversize body - come back as a 4xx
in the calling API's own error envelope instead of FastAPI's generic 422.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_flow.log import get_logger
from dspark_flow.server import anthropic_api, openai_api
from dspark_flow.server.common import (
    SSE_HEADERS,
    ApiError,
    Finished,
    check_api_key,
    error_body,
    parse_model,
    read_json,
)
from dspark_flow.server.config import ServerConfig
from dspark_flow.server.engine import Engine, GenRequest, Job
from dspark_flow.server.prompts import check_budget, encode_chat, encode_text, sampler_for

log = get_logger()

DISCONNECT_POLL_SECONDS = 0.25


async def _collect(job: Job, request: Request) -> Finished:
    """Wait for a non-streaming result; cancel the generation if the client hangs up."""

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        async for item in job.items():
            if isinstance(item, Finished):
                return item
        raise ApiError(500, "the generation ended without a result", type="server_error")
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    # No redirect for a trailing slash: a 307 on a POST is a hop many clients do not take; the
    # path is then unknown, answered 404 in the caller's dialect like any other.
    app = FastAPI(
        title="dspark-flow",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    created = int(time.time())  # the model's "created" in /v1/models: when it began serving
    app.state.engine = engine
    app.state.config = config

    _answer_errors_in_dialect(app)

    # -- helpers -----------------------------------------------------------------------------

    async def begin(request: Request) -> dict[str, Any]:
        """Key, readiness and body checks every generation route starts with."""
        check_api_key(request, config.api_key)
        if not engine.ready:
            raise ApiError(503, "the model is still loading", type="server_error")
        return await read_json(request, config.max_body_bytes)

    def check_model(name: str) -> None:
        if not config.accepts(name):
            raise ApiError(
                404,
                f"the model '{name}' does not exist; this server serves '{config.model_id}'",
                param="model",
                code="model_not_found",
            )

    async def submit(
        prompt_ids: list[int], budget: int | None, sampler: Any, stop: list[str]
    ) -> Job:
        max_tokens = check_budget(engine, prompt_ids, budget)
        # It would wait behind the running request and those already queued.
        if config.max_queue is not None and engine.busy and engine.waiting >= config.max_queue:
            raise ApiError(
                429,
                f"the server is busy: {engine.waiting} requests are waiting (at most "
                f"{config.max_queue}); retry later",
                code="rate_limit_exceeded",
            )
        return engine.submit(GenRequest(prompt_ids, max_tokens, sampler, stop))

    # -- routes ------------------------------------------------------------------------------

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD
    async def health() -> JSONResponse:
        return JSONResponse(_health(engine, config), status_code=200 if engine.ready else 503)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request) -> JSONResponse:
        check_api_key(request, config.api_key)
        return JSONResponse({"object": "list", "data": [_model_card(config.model_id, created)]})

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str) -> JSONResponse:
        check_api_key(request, config.api_key)
        check_model(name)
        return JSONResponse(_model_card(config.model_id, created))

    async def openai_generate(request: Request, chat: bool) -> Response:
        """Chat and text completions differ only in request model, encoding and reply shape."""
        body = await begin(request)
        req: openai_api.ChatCompletionRequest | openai_api.CompletionRequest
        if chat:
            req = parse_model(openai_api.ChatCompletionRequest, body)
        else:
            req = parse_model(openai_api.CompletionRequest, body)
        check_model(req.model)
        if isinstance(req, openai_api.ChatCompletionRequest):
            ids = await run_in_threadpool(encode_chat, engine, req.chat_messages())
        else:
            ids = await run_in_threadpool(encode_text, engine, req.single_prompt())
        sampler = sampler_for(engine, req.temperature, req.top_p, req.top_k, req.min_p, req.seed)
        job = await submit(ids, req.budget, sampler, req.stop_list())
        if req.stream:
            chunks = openai_api.stream(job, req.model, chat=chat, include_usage=req.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)
        respond = openai_api.chat_response if chat else openai_api.completion_response
        return JSONResponse(respond(req.model, await _collect(job, request)))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await openai_generate(request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await openai_generate(request, chat=False)

    @app.post("/v1/messages", response_model=None)
    async def messages(request: Request) -> Response:
        req = parse_model(anthropic_api.MessagesRequest, await begin(request))
        check_model(req.model)
        ids = await run_in_threadpool(encode_chat, engine, req.chat_messages(), continue_last=True)
        sampler = sampler_for(engine, req.temperature, req.top_p, req.top_k, None, None)
        job = await submit(ids, req.max_tokens, sampler, list(req.stop_sequences or []))
        if req.stream:
            events = anthropic_api.stream(job, req.model, len(ids))
            return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
        return JSONResponse(anthropic_api.message_response(req.model, await _collect(job, request)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        req = parse_model(anthropic_api.CountTokensRequest, await begin(request))
        check_model(req.model)
        ids = await run_in_threadpool(encode_chat, engine, req.chat_messages(), continue_last=True)
        return JSONResponse({"input_tokens": len(ids)})

    return app


def _answer_errors_in_dialect(app: FastAPI) -> None:
    """Every error, ours or the framework's, in the envelope of the API the caller speaks."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, exc), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods, in the caller's envelope too.
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        err = ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}")
        return JSONResponse(  # exc.headers: a 405's Allow
            error_body(request.url.path, err), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", path=request.url.path, error=repr(exc))
        err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
        return JSONResponse(error_body(request.url.path, err), status_code=500)


def _health(engine: Engine, config: ServerConfig) -> dict[str, Any]:
    """/health's body: readiness, what is served, the queue, the cache and memory."""
    from dspark_flow.strategies.caches.prefix import active_memory_probe

    probe = active_memory_probe()
    return {
        "status": "ok" if engine.ready else ("error" if engine.load_error else "loading"),
        "ready": engine.ready,
        "model": config.model_id,
        "target": config.target,
        "mode": engine.drafter_kind,
        "cache": engine.cache_stats(),
        "queue": {
            "busy": engine.busy,
            "waiting": engine.waiting,
            "served": engine.served,
            "cancelled": engine.cancelled,
            "failed": engine.failed,
        },
        "memory": {
            "active_bytes": int(probe()) if probe else None,
            "ceiling_bytes": engine.max_active_bytes,
        },
    }


def _model_card(model_id: str, created: int) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "dspark-flow",
    }
