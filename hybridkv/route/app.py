"""The router's HTTP app: OpenAI's routes in front of N engines.

    POST /v1/completions, /v1/chat/completions   tokenize (prompt ids as given, else the engine's
                                                 /tokenize) -> ask the index -> rank (picker.py) ->
                                                 forward; a refused connection or a 5xx before the
                                                 first byte fails over to the next engine; streams
                                                 pass through chunk by chunk
    GET  /v1/models                              the first engine up's answer
    GET  /route/stats                            per engine: routed, failures, predicted and cached tokens
    GET  /health, /metrics                       the router's own

Every routed response carries `x-hybridkv-instance` and `x-hybridkv-predicted-tokens` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from hybridkv.route.picker import Engine, Policy, rank
from hybridkv.route.upstream import ConnectionPool, UpstreamError

__all__ = ["RouteConfig", "index_behind", "make_app"]

log = logging.getLogger("hybridkv.route")
EVENTS_SEQ_HEADER = "x-hybridkv-kv-events-seq"  # (hybridkv serve's: openai_api/events_seq.py)
MAX_BODY_BYTES = 16 << 20


@dataclass(slots=True, kw_only=True)
class RouteConfig:
    """The router's settings and its view of the engines."""

    engines: list[Engine]
    index_url: str | None
    model: str
    policy: Policy = Policy.JOINT
    index_token: str = ""
    max_skew: int = 2
    max_share: float = 1.25
    down_for_s: float = 5.0
    poll_every_s: float = 1.0
    timeout_s: float = 300.0
    sync_wait_s: float = 0.05  # how long to ask the index again while it is behind an engine's events
    index_errors: int = 0
    stale_answers: int = 0  # queries answered from an index still behind after sync_wait_s
    no_engine: int = 0
    pool: ConnectionPool = field(default_factory=ConnectionPool)  # kept-alive connections to engines and index
    _polling: asyncio.Task[None] | None = field(default=None, repr=False)


def _decode(raw: bytes) -> Any:
    """JSON text as Python values (msgspec: a 32k-token prompt in ~0.3 ms, json.loads takes ~2 ms);
    ValueError (msgspec.DecodeError) when it is not JSON."""
    return msgspec.json.decode(raw)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "router_error", "code": status}}, status_code=status)


def _load_of(metrics_text: str) -> int:
    """running + waiting from an engine's Prometheus text (hybridkv's or vLLM's names)."""
    total = 0.0
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("num_requests_running", "num_requests_waiting")):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _prompt_tokens(cfg: RouteConfig, body: dict[str, Any], chat: bool) -> list[int] | None:
    """The prompt's token ids: as sent, or from an engine's /tokenize (None when unknown)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # (a batch: routed by its first prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    ask: dict[str, Any] = {"model": body.get("model", cfg.model)}
    if chat:
        ask["messages"] = body.get("messages")
    elif isinstance(prompt, str):
        ask["prompt"] = prompt
    else:
        return None
    now = time.monotonic()
    for engine in sorted((e for e in cfg.engines if e.up(now)), key=lambda e: e.load):
        try:
            status, raw, _ = cfg.pool.call(engine.url, "/tokenize", ask, timeout_s=10.0)
        except UpstreamError:
            continue
        if status == 200:
            tokens = _decode(raw).get("tokens")
            return tokens if isinstance(tokens, list) else None
        return None
    return None


def _hits(cfg: RouteConfig, body: dict[str, Any], tokens: list[int] | None) -> dict[str, tuple[int, int]]:
    """Per instance: (joint hit, attention-only hit) from the index ({} without an answer)."""
    if cfg.policy is Policy.ROUND_ROBIN or cfg.index_url is None or not tokens:
        return {}
    query = {"model": body.get("model", cfg.model), "token_ids": tokens}
    if isinstance(body.get("cache_salt"), str):
        query["cache_salt"] = body["cache_salt"]
    headers = {"Authorization": f"Bearer {cfg.index_token}"} if cfg.index_token else None
    deadline = time.monotonic() + cfg.sync_wait_s
    while True:
        try:
            status, raw, _ = cfg.pool.call(cfg.index_url, "/query", query, timeout_s=2.0, headers=headers)
            answer = _decode(raw) if status == 200 else {}
        except (UpstreamError, ValueError):
            answer = {}
        if not answer:
            cfg.index_errors += 1
            return {}
        entries = {inst: v for tenant in answer.values() for inst, v in tenant.items()}
        if not index_behind(cfg, entries):
            break
        if time.monotonic() >= deadline:
            cfg.stale_answers += 1
            break
        time.sleep(0.002)
    return {inst: (int(v.get("longest_matched", 0)), int(v.get("attention_matched", 0))) for inst, v in entries.items()}


def index_behind(cfg: RouteConfig, entries: dict[str, Any]) -> bool:
    """Whether the index has not yet applied an event batch some engine's answers already counted
    (`x-hybridkv-kv-events-seq` of its responses vs the index's `events_seq` for it)."""
    for engine in cfg.engines:
        seq = entries.get(engine.instance_id, {}).get("events_seq")
        if isinstance(seq, int) and seq < engine.events_seq:
            return True
    return False


def _record_usage(engine: Engine, raw: bytes, predicted: int | None) -> None:
    """Tally the response's prompt and cached tokens (and whether the index predicted them)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        usage = _decode(raw).get("usage") or {}
        engine.prompt_tokens += int(usage.get("prompt_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        engine.cached_tokens += cached
        if predicted is not None:
            engine.checked += 1
            engine.exact += cached == predicted
            engine.over += cached < predicted
            engine.under += cached > predicted


async def _forward(cfg: RouteConfig, path: str, raw: bytes, body: dict[str, Any], chat: bool) -> Response:
    tokens = await asyncio.to_thread(_prompt_tokens, cfg, body, chat)
    hits = await asyncio.to_thread(_hits, cfg, body, tokens)
    stream = bool(body.get("stream"))
    field = 1 if cfg.policy is Policy.ATTENTION else 0  # (the number the policy routes by)
    predicted = {inst: pair[field] for inst, pair in hits.items()}
    for engine in rank(cfg.engines, hits, cfg.policy, max_skew=cfg.max_skew, max_share=cfg.max_share):
        headers = {"x-hybridkv-instance": engine.instance_id,
                   "x-hybridkv-predicted-tokens": str(predicted.get(engine.instance_id, 0))}
        engine.in_flight += 1
        try:
            if stream:
                status, kind, chunks = await asyncio.to_thread(cfg.pool.open_stream, engine.url, path, raw,
                                                               timeout_s=cfg.timeout_s)
            else:
                status, answer, answer_headers = await asyncio.to_thread(cfg.pool.call, engine.url, path, raw,
                                                                         timeout_s=cfg.timeout_s)
                _note_events_seq(engine, answer_headers)
        except UpstreamError as e:
            engine.in_flight -= 1
            engine.failures += 1
            engine.down_until = time.monotonic() + cfg.down_for_s
            log.warning("engine %s failed, trying the next: %s", engine.instance_id, e)
            continue
        if status >= 500:
            engine.in_flight -= 1
            engine.failures += 1
            engine.down_until = time.monotonic() + cfg.down_for_s
            continue
        engine.routed += 1
        engine.predicted_tokens += predicted.get(engine.instance_id, 0)
        if stream:
            return StreamingResponse(_relay(engine, chunks), status_code=status, media_type=kind, headers=headers)
        engine.in_flight -= 1
        _record_usage(engine, answer, predicted.get(engine.instance_id) if hits else None)
        return Response(answer, status_code=status, media_type="application/json", headers=headers)
    cfg.no_engine += 1
    return _error(503, f"no engine answered ({len(cfg.engines)} tried)")


def _note_events_seq(engine: Engine, headers: dict[str, str]) -> None:
    """Remember the KV event count of an engine's latest response (hybridkv serve's header). The
    latest, not the largest: a restarted engine counts from 0 again (a response overtaken by an older
    one only makes the next wait shorter)."""
    with contextlib.suppress(ValueError):
        engine.events_seq = int(headers.get(EVENTS_SEQ_HEADER, "0"))


async def _relay(engine: Engine, chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    done = object()
    try:
        while True:
            piece = await asyncio.to_thread(next, chunks, done)
            if piece is done:
                return
            assert isinstance(piece, bytes)
            yield piece
    finally:
        engine.in_flight -= 1


async def _poll(cfg: RouteConfig) -> None:
    while True:
        for engine in cfg.engines:
            try:
                status, raw, _ = await asyncio.to_thread(cfg.pool.call, engine.url, "/metrics", None, timeout_s=2.0)
            except UpstreamError:
                engine.down_until = time.monotonic() + cfg.down_for_s
                continue
            if status == 200:
                engine.reported_load = _load_of(raw.decode(errors="replace"))
                engine.down_until = 0.0
        await asyncio.sleep(cfg.poll_every_s)


def _stats(cfg: RouteConfig) -> dict[str, Any]:
    return {"policy": cfg.policy.value, "index_errors": cfg.index_errors, "stale_answers": cfg.stale_answers,
            "no_engine": cfg.no_engine,
            "engines": [{"instance_id": e.instance_id, "url": e.url, "routed": e.routed, "failures": e.failures,
                         "in_flight": e.in_flight, "load": e.load, "predicted_tokens": e.predicted_tokens,
                         "cached_tokens": e.cached_tokens, "prompt_tokens": e.prompt_tokens,
                         "predictions_checked": e.checked, "predictions_exact": e.exact,
                         "predicted_over": e.over, "predicted_under": e.under} for e in cfg.engines]}


def make_app(cfg: RouteConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        cfg._polling = asyncio.ensure_future(_poll(cfg))
        try:
            yield
        finally:
            cfg._polling.cancel()
            cfg.pool.close()

    def openai_route(path: str, chat: bool) -> Any:
        async def handler(request: Request) -> Response:
            chunks, size = [], 0
            async for chunk in request.stream():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    return _error(413, f"request body is over the limit of {MAX_BODY_BYTES} bytes")
            raw = b"".join(chunks)
            try:
                body = _decode(raw)
            except ValueError as e:
                return _error(400, f"the body is not JSON: {e}")
            if not isinstance(body, dict):
                return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
            return await _forward(cfg, path, raw, body, chat)
        return handler

    async def models(_: Request) -> Response:
        for engine in cfg.engines:
            try:
                status, raw, _headers = await asyncio.to_thread(cfg.pool.call, engine.url, "/v1/models", None,
                                                                timeout_s=5.0)
            except UpstreamError:
                continue
            return Response(raw, status_code=status, media_type="application/json")
        return _error(503, "no engine answered")

    async def stats(_: Request) -> Response:
        return JSONResponse(_stats(cfg))

    async def health(_: Request) -> Response:
        up = any(e.up(time.monotonic()) for e in cfg.engines)
        return PlainTextResponse("ok" if up else "no engine up", status_code=200 if up else 503)

    async def metrics(_: Request) -> Response:
        lines = []
        for e in cfg.engines:
            label = f'{{instance="{e.instance_id}"}}'
            lines += [f"hybridkv_route_requests_total{label} {e.routed}",
                      f"hybridkv_route_failures_total{label} {e.failures}",
                      f"hybridkv_route_predicted_tokens_total{label} {e.predicted_tokens}",
                      f"hybridkv_route_cached_tokens_total{label} {e.cached_tokens}",
                      f"hybridkv_route_in_flight{label} {e.in_flight}"]
        lines.append(f"hybridkv_route_index_errors_total {cfg.index_errors}")
        return PlainTextResponse("\n".join(lines) + "\n")

    async def not_found(_: Request, exc: Exception) -> Response:
        return _error(404, "no such route; expected /v1/completions, /v1/chat/completions, /v1/models")

    return Starlette(routes=[
        Route("/v1/completions", openai_route("/v1/completions", False), methods=["POST"]),
        Route("/v1/chat/completions", openai_route("/v1/chat/completions", True), methods=["POST"]),
        Route("/v1/models", models), Route("/route/stats", stats), Route("/health", health),
        Route("/metrics", metrics),
    ], lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
