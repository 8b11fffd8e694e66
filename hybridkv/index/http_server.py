"""`hybridkv index`'s HTTP/1.1 server: llhttp (httptools) on an asyncio protocol, routes called in line.

Why not uvicorn, which serves `route` and `serve`: a `/query` of a 32k-token prompt is a 234 KB body
and ~0.3 ms of work, and uvicorn spends ~0.25 ms of server CPU around any app for such a request (an
ASGI task and its messages, the body copied through a bytearray, two writes): 0.22-0.27 ms measured
for an app that answers `{}` at once, against ~0.08 ms for a bare protocol.

    a request    method, path and headers from llhttp's callbacks; the body's pieces collected
                 (Content-Length or chunked), at most `max_body_bytes` (past it: 413 once the request
                 ends, and the connection closes); `Expect: 100-continue` answered
    the answer   the route's handler called in line on the event loop (the index's handlers take the
                 service's lock for well under a millisecond and never wait on I/O); head and body in
                 one write; pipelined requests answered in order
    keep-alive   HTTP/1.1 unless `Connection: close`; an HTTP/1.0 request closes; a connection idle
                 for `idle_timeout_s` is closed; past `max_connections` a new one is closed at once
    errors       a malformed request: 400, then close; an unknown route: 404; every error one JSON line
    lifecycle    `run()` serves in this thread until SIGINT / SIGTERM (a second one: at once) or
                 `request_stop()`; `start()` / `stop()` on a background thread (tests, benchmarks)
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httptools
import msgspec

from hybridkv.http_serving import bearer_ok, bind_socket, http_url

__all__ = ["GetHandler", "IndexServer", "PostHandler", "Reply", "Routes", "json_error"]

_log = logging.getLogger(__name__)

Reply = tuple[int, bytes]  # (HTTP status, JSON body)
PostHandler = Callable[[bytes], Reply]
GetHandler = Callable[[], tuple[int, bytes, bytes]]  # -> (status, body, content type)
_DISCARD_BYTES = 64 << 20  # what a refused body may still send (read and dropped) before the connection is cut
_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def json_error(status: int, message: str) -> Reply:
    """`{"error": {"message": ..., "code": status}}` (the message one line, as every index error)."""
    return status, msgspec.json.encode({"error": {"message": message, "code": status}})


@dataclass(frozen=True, slots=True, kw_only=True)
class Routes:
    """What the server answers: POST routes (JSON in, JSON out; `secret`: their bearer token, empty
    for none), GET routes, the body cap, and the one-line message of a 404."""

    posts: dict[str, PostHandler]
    gets: dict[str, GetHandler] = field(default_factory=dict)
    secret: bytes = b""
    max_body_bytes: int = 16 << 20
    not_found: str = "no such route"
    on_error: Callable[[str, Exception], Reply] | None = None  # (an exception a handler raised -> a reply)


class _Connection(asyncio.Protocol):
    """One client connection: llhttp's callbacks gather a request, `_answer` replies to it."""

    def __init__(self, server: IndexServer) -> None:
        self._server = server
        self._routes = server.routes
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._refused: Reply | None = None
        self._closing = False
        self.last_active = time.monotonic()

    # -- the transport ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if len(self._server.connections) >= self._server.max_connections:
            transport.close()
            return
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._closing = True

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self.last_active = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reply(json_error(400, "protocol upgrades are not supported"), keep_alive=False)
        except httptools.HttpParserError as e:
            self._reply(json_error(400, f"malformed HTTP request: {str(e)[:200]}"), keep_alive=False)

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    # -- llhttp's callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size, self._refused = b"", {}, [], 0, None

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        limit = self._routes.max_body_bytes
        declared = self._headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            self._refused = json_error(413, f"request body of {int(declared)} bytes is over the limit of {limit}")
        elif self._headers.get(b"expect", b"").lower() == b"100-continue" and self._transport is not None:
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._refused is not None:
            if self._size > self._routes.max_body_bytes + _DISCARD_BYTES:  # (a client that does not stop: cut off)
                self.close()
            return
        if self._size > self._routes.max_body_bytes:
            self._refused = json_error(413, f"request body is over the limit of {self._routes.max_body_bytes} bytes")
            self._body = []
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._closing:
            return
        keep_alive = self._parser.should_keep_alive() and self._refused is None
        self._reply(self._refused or self._answer(), keep_alive=keep_alive,
                    head=self._parser.get_method() == b"HEAD")

    # -- the answer ---------------------------------------------------------------------------------

    def _answer(self) -> Reply | tuple[int, bytes, bytes]:
        routes = self._routes
        method = self._parser.get_method()
        try:
            path = httptools.parse_url(self._url).path.decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            return json_error(400, "malformed request target")
        if method == b"POST" and path in routes.posts:
            if not bearer_ok(routes.secret, self._headers.get(b"authorization", b"").decode("latin-1")):
                return json_error(401, f"{path} needs Authorization: Bearer <the index's token>")
            body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
            self._body = []
            try:
                return routes.posts[path](body)
            except Exception as e:
                if routes.on_error is not None:
                    return routes.on_error(path, e)
                _log.exception("%s failed", path)
                return json_error(500, f"internal error: {type(e).__name__}")
        if method in (b"GET", b"HEAD") and path in routes.gets:
            return routes.gets[path]()
        return json_error(404, routes.not_found)

    def _reply(self, reply: Reply | tuple[int, bytes, bytes], *, keep_alive: bool, head: bool = False) -> None:
        transport = self._transport
        if transport is None or self._closing:
            return
        status, body = reply[0], reply[1]
        kind = reply[2] if len(reply) == 3 else b"application/json"
        lines = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
            status, _REASONS.get(status, b"Unknown"), kind, len(body))]
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        if not head:
            lines.append(body)
        transport.write(b"".join(lines))
        if not keep_alive:
            self.close()


class IndexServer:
    """The HTTP/1.1 server of `routes` on a socket bound at construction (port 0 works; an address in
    use: ConfigError, as `bind_socket`)."""

    def __init__(self, routes: Routes, *, host: str = "127.0.0.1", port: int = 0, name: str = "hybridkv-index",
                 idle_timeout_s: float = 30.0, max_connections: int = 1024) -> None:
        self.routes = routes
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.connections: set[_Connection] = set()
        self._sock = bind_socket(host, port)
        self._name = name
        address = self._sock.getsockname()
        self.host: str = address[0]
        self.port: int = address[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def started(self) -> bool:
        return self._started.is_set()

    def run(self) -> None:
        """Serve in this thread until SIGINT / SIGTERM or `request_stop`; closes the socket."""
        try:
            asyncio.run(self._serve(signals=True))
        finally:
            self._sock.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve on a background thread; returns once it accepts requests (RuntimeError otherwise)."""
        def serve() -> None:
            try:
                asyncio.run(self._serve(signals=False))
            finally:
                self._sock.close()

        self._thread = threading.Thread(target=serve, name=self._name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError(f"{self._name} did not start within {timeout_s} s")

    def request_stop(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # (the loop already closed)
                loop.call_soon_threadsafe(stop.set)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)

    async def _serve(self, *, signals: bool) -> None:
        loop = asyncio.get_running_loop()
        self._loop, self._stop = loop, asyncio.Event()
        server = await loop.create_server(lambda: _Connection(self), sock=self._sock)
        if signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal, sig)
        sweep = loop.create_task(self._close_idle())
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            sweep.cancel()
            server.close()
            for connection in list(self.connections):
                connection.close()
            await server.wait_closed()

    def _on_signal(self, sig: signal.Signals) -> None:
        """The first signal stops the server gracefully; the next one ends the process at once."""
        assert self._loop is not None and self._stop is not None
        self._loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_DFL)
        self._stop.set()

    async def _close_idle(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.idle_timeout_s))
            cutoff = time.monotonic() - self.idle_timeout_s
            for connection in [c for c in self.connections if c.last_active < cutoff]:
                connection.close()
