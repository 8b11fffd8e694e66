"""The Starlette application of `hybridkv serve`: the OpenAI routes over one engine loop.

    POST /v1/completions           prompt (text or token ids) -> text; SSE when "stream": true
    POST /v1/chat/completions      messages -> the assistant's answer (the chat template: chat.py)
    GET  /v1/models                the served model
    GET  /v1/models/{id}           that model (404 for another id)
    GET  /health                   200 while the engine thread runs, else 503
    GET  /metrics                  Prometheus (metrics.py)
    POST /reset_prefix_cache       forget the local prefix cache (`?external=true`: also the KV cache server)

Bodies are read up to `ServeLimits.max_body_bytes` (413 beyond), then decoded and tokenized on a
worker thread, so a large prompt never stalls the event loop; with an API key, /v1/* and POST
/reset_prefix_cache need it (limits.py). Every refusal is an OpenAI-style error body
(`{"error": {"message", "type", "param", "code"}}`) with a 4xx status; the server keeps serving.
A client that disconnects (mid-stream or while waiting for a whole answer) has its request
aborted, which frees its KV cache blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from hybridkv.engine.llm import LLM
from hybridkv.errors import HybridKVError
from hybridkv.openai_api.chat import ChatTemplate
from hybridkv.openai_api.engine_loop import EngineLoop
from hybridkv.openai_api.events_seq import EventsSeqHeader
from hybridkv.openai_api.generation import Generation
from hybridkv.openai_api.limits import ApiKeyGuard, ServeLimits, read_body
from hybridkv.openai_api.metrics import EngineSnapshot, ServeMetrics
from hybridkv.openai_api.responses import ResponseWriter
from hybridkv.openai_api.schemas import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    completion_prompt,
    decode_body,
    to_job,
)
from hybridkv.openai_api.tokenize import tokenize

log = logging.getLogger("hybridkv.openai_api")


@dataclass(slots=True, kw_only=True)
class ServeState:
    """What the handlers share: the engine loop, its model's facts, metrics."""

    engine: EngineLoop
    model_name: str
    chat_template: ChatTemplate
    metrics: ServeMetrics
    limits: ServeLimits

    @property
    def llm(self) -> LLM:
        return self.engine.llm


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def make_app(llm: LLM, *, model_name: str, limits: ServeLimits | None = None) -> Starlette:
    """The app serving `llm`; the engine thread starts with the app's lifespan and stops with it, and
    then the app closes `llm` (it owns it from here on)."""
    limits = limits or ServeLimits()
    state = ServeState(engine=EngineLoop(llm), model_name=model_name, limits=limits,
                       chat_template=ChatTemplate(llm.model_dir, llm.tokenizer), metrics=ServeMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            llm.close()  # detach from the KV cache server (and stop the one "auto" started)

    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "hybridkv",
            "max_model_len": llm.max_model_len}

    async def models(_: Request) -> Response:
        return json_response({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model_name:
            return _refuse(state, BadRequest(f"the model {name!r} does not exist; this server serves {model_name!r}",
                                             param="model", status=404, kind="not_found_error",
                                             code="model_not_found"))
        return json_response(card)

    async def health(_: Request) -> Response:
        return Response(status_code=200 if state.engine.alive else 503)

    async def metrics(_: Request) -> Response:
        state.metrics.set_engine(await state.engine.call(EngineSnapshot.of))
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(request: Request) -> Response:
        return await _reset_prefix_cache(state, request)

    async def tokenize_route(request: Request) -> Response:
        try:
            raw = await read_body(request, state.limits.max_body_bytes)
            return json_response(await asyncio.to_thread(
                tokenize, raw, model_name=model_name, chat_template=state.chat_template, tokenizer=llm.tokenizer,
                max_model_len=llm.max_model_len))
        except BadRequest as exc:
            return _refuse(state, exc)

    middleware = [Middleware(ApiKeyGuard, api_key=limits.api_key)] if limits.api_key else []
    if llm.kv_events is not None:
        middleware.append(Middleware(EventsSeqHeader, publisher=llm.kv_events.publisher))
    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models), Route("/v1/models/{name:path}", model),
        Route("/health", health), Route("/metrics", metrics),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: _http_error}, middleware=middleware)
    app.state.serve = state
    return app


async def _http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own refusals (404, 405) in the OpenAI error shape."""
    assert isinstance(exc, HTTPException)
    return json_response(BadRequest(str(exc.detail), status=exc.status_code,
                                    kind="not_found_error" if exc.status_code == 404 else "invalid_request_error")
                         .body(), exc.status_code)


def _refuse(state: ServeState, exc: BadRequest) -> Response:
    state.metrics.bad_requests.labels(str(exc.status)).inc()
    return json_response(exc.body(), exc.status)


async def _generate(state: ServeState, request: Request, *, chat: bool) -> Response:
    try:
        raw = await read_body(request, state.limits.max_body_bytes, state.limits.body_timeout_s)
        gen, writer = await asyncio.to_thread(_prepare, state, raw, chat=chat)  # decode + tokenize off the loop
    except BadRequest as exc:
        return _refuse(state, exc)
    if gen.job.stream:
        return StreamingResponse(_sse(gen, writer), media_type="text/event-stream")
    run = asyncio.ensure_future(gen.run())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({run, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not run.done():  # the client left: cancelling the run aborts the request
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        return Response(status_code=499)
    gone.cancel()
    if run.exception() is not None:
        return _engine_error(state, run.exception())
    return json_response(writer.full())


def _prepare(state: ServeState, raw: bytes, *, chat: bool) -> tuple[Generation, ResponseWriter]:
    """The generation a body asks for; BadRequest for anything that cannot run."""
    llm = state.llm
    body = decode_body(raw, ChatCompletionRequest if chat else CompletionRequest)
    if body.model is not None and body.model != state.model_name:
        raise BadRequest(f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                         param="model", status=404, kind="not_found_error", code="model_not_found")
    if isinstance(body, ChatCompletionRequest):
        ids = state.chat_template.prompt_ids(body.messages)
    else:
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            encode = llm.tokenizer.encode if body.add_special_tokens else llm.tokenizer.encode_continuation
            ids = encode(prompt)
        else:
            ids = prompt
    try:
        ids = llm.check_prompt(ids, label="prompt")
    except HybridKVError as exc:
        raise BadRequest(str(exc), param="messages" if chat else "prompt") from None
    job = to_job(body, ids, max_model_len=llm.max_model_len, vocab_size=int(llm.model.hf_config["vocab_size"]))
    if (llm.config.cache.turn_checkpoints and isinstance(body, ChatCompletionRequest)
            and len(body.messages) > 1):  # the chat's turns: where the next resumes
        turns = state.chat_template.turn_ends(body.messages, ids)
        job = dataclasses.replace(job, cache_checkpoints=tuple(sorted({*job.cache_checkpoints, *turns})))
    gen = Generation(state.engine, llm.tokenizer, state.metrics, job,
                     endpoint="chat_completions" if chat else "completions")
    prefix = "chatcmpl" if chat else "cmpl"
    return gen, ResponseWriter(gen, llm.tokenizer, model=state.model_name, request_id=f"{prefix}-{uuid.uuid4().hex}",
                               chat=chat)


def _engine_error(state: ServeState, exc: BaseException | None) -> Response:
    if isinstance(exc, HybridKVError):  # e.g. CapacityError: the request can never get blocks
        return _refuse(state, BadRequest(str(exc)))
    log.error("request failed: %r", exc)
    return json_response(BadRequest(f"the engine failed: {exc!r}", status=500, kind="server_error").body(), 500)


def _event(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _sse(gen: Generation, writer: ResponseWriter) -> AsyncIterator[bytes]:
    """The SSE stream of one generation; Starlette cancels it when the client disconnects."""
    first = True
    try:
        async for piece in gen.pieces():
            chunk = writer.chunk(piece, first=first)
            if chunk is not None:
                first = False
                yield _event(chunk)
    except HybridKVError as exc:
        yield _event(BadRequest(str(exc)).body())
    except Exception as exc:
        log.error("stream failed: %r", exc)
        yield _event(BadRequest(f"the engine failed: {exc!r}", status=500, kind="server_error").body())
    else:
        if gen.job.include_usage:
            yield _event(writer.usage_chunk())
    yield b"data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (uvicorn sends http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _reset_prefix_cache(state: ServeState, request: Request) -> Response:
    value = request.query_params.get("external", "false").lower()
    if value not in ("true", "false", "1", "0"):
        return _refuse(state, BadRequest(f"external must be true or false, got {value!r}", param="external"))
    external = value in ("true", "1")
    if external and state.llm.transfer is None:
        return _refuse(state, BadRequest("external=true clears the KV cache server, but none is attached "
                                         "(start `hybridkv serve` with --kv-server URL|auto)", param="external"))

    def reset(llm: LLM) -> tuple[bool, int]:
        return llm.reset_prefix_cache(external=external), len(llm.scheduler.running)

    done, running = await state.engine.call(reset)
    if not done:
        return _refuse(state, BadRequest(f"{running} running request(s) hold KV cache blocks; the prefix cache can "
                                         "be reset only while no request runs", status=409, kind="conflict"))
    return json_response({"reset": True, "external": external})
