"""What `hybridkv serve` lets a client do: the API key, the body size, header and idle timeouts, connections.

    ServeLimits        the options (`hybridkv serve --api-key/--max-body-bytes/...`), checked
    ApiKeyGuard        ASGI middleware: with an API key, /v1/* and POST /reset_prefix_cache need
                       `Authorization: Bearer <key>` (vLLM's rule; /health and /metrics stay open), else 401
    read_body          the request body, 413 once it passes the limit (Content-Length or counted)
    read_body          ... and 408 when it has not all arrived within `body_timeout_s`
    HeaderTimeoutH11   uvicorn's h11 protocol plus a header timeout: a connection that has not sent a
                       whole request head within `header_timeout_s` of connecting (or of starting its
                       next request) is closed, so slow clients cannot hold connections open

The idle timeout (between requests of a keep-alive connection) and the connection cap are
uvicorn's own `timeout_keep_alive` and `limit_concurrency` (503 once that many connections or
requests are open).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridkv.errors import ConfigError
from hybridkv.http_serving import bearer_ok
from hybridkv.openai_api.schemas import BadRequest

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeLimits:
    """The client-facing limits of `hybridkv serve` (see the module docstring)."""

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # the whole body must arrive within this time of its head (408 after)
    idle_timeout_s: int = 5
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key is empty; expected a non-empty token (or leave it out)")
        checks = [("--max-body-bytes", self.max_body_bytes, 1), ("--header-timeout-s", self.header_timeout_s, 0.001),
                  ("--body-timeout-s", self.body_timeout_s, 0.001), ("--idle-timeout-s", self.idle_timeout_s, 1),
                  ("--max-connections", self.max_connections, 1)]
        for flag, value, least in checks:
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= least:
                raise ConfigError(f"{flag} must be at least {least}, got {value!r}")


class ApiKeyGuard:
    """401 for a guarded route without the right bearer token (see the module docstring)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _guarded(scope) and not self._authorized(scope):
            body = BadRequest("missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                              "the key `hybridkv serve --api-key` was given", status=401,
                              kind="authentication_error", code="invalid_api_key").body()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": msgspec.json.encode(body)})
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return bearer_ok(self._expected, given.decode("latin-1"))  # (the scheme in any case: RFC 9110 11.1)


def _guarded(scope: Scope) -> bool:
    path: str = scope["path"]
    if scope["method"] == "OPTIONS":
        return False
    return path.startswith("/v1") or (path == "/reset_prefix_cache" and scope["method"] == "POST")


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The whole body; BadRequest 413 as soon as it is known to pass `limit` bytes, 408 when it has
    not all arrived within `timeout_s` (a client that trickles a body must not hold a connection and
    its buffer forever)."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {timeout_s:g} s (hybridkv serve --body-timeout-s)",
                         status=408, code="request_timeout") from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"the request body has {'at least ' if size <= limit else ''}{size} bytes; this server accepts "
                      f"at most {limit} (hybridkv serve --max-body-bytes)", status=413, code="request_too_large")


class HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose request head is late (module docstring)."""

    header_timeout_s = 10.0  # set per server by `with_header_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # A stream writes its response head long before its first token: with Nagle on, that token waited
            # for the client's delayed ACK of the head (~15-40 ms on a keep-alive connection).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a whole request head arrived
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:  # (part of) the next request's head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutH11]:
    """A HeaderTimeoutH11 subclass with this timeout (uvicorn takes a protocol class)."""
    return type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})
