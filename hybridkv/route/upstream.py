"""Blocking HTTP to engines and the index (the app runs these in threads): JSON calls and a
streamed body, with timeouts; every failure is an `UpstreamError` naming the engine.

`ConnectionPool` keeps connections alive between calls, as a router must: a 32k-token prompt's
`/query` on a new connection pays the TCP handshake and a cold socket each time, and a busy
router would otherwise leave thousands of sockets in TIME_WAIT. The module-level `call` /
`call_with_headers` open one connection per call (scripts, one-off checks).

    pool = ConnectionPool()
    status, body, headers = pool.call(url, "/query", {"model": ..., "token_ids": ...}, timeout_s=2.0)
    status, kind, chunks = pool.open_stream(url, "/v1/completions", raw)   # back to the pool once read whole
"""

from __future__ import annotations

import http.client
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["ConnectionPool", "UpstreamError", "call", "call_with_headers"]

MAX_RESPONSE_BYTES = 64 << 20
# (a reused connection that the server had closed fails at once, before any response byte: the
# request is sent again once, on a new connection)
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class UpstreamError(Exception):
    """An engine or the index could not be reached or answered garbage."""


def _split(url: str) -> tuple[str, int, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"{url!r} is not an http://host:port URL")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def _encode(body: Any) -> bytes | None:
    """The body as JSON (msgspec: a 32k-token `/query` in ~0.1 ms, json.dumps takes ~2 ms)."""
    return None if body is None else (body if isinstance(body, bytes) else msgspec.json.encode(body))


def _send(conn: http.client.HTTPConnection, path: str, data: bytes | None,
          headers: dict[str, str] | None) -> http.client.HTTPResponse:
    conn.request("GET" if data is None else "POST", path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def _read(resp: http.client.HTTPResponse, where: str) -> bytes:
    raw = resp.read(MAX_RESPONSE_BYTES + 1)
    if len(raw) > MAX_RESPONSE_BYTES:
        raise UpstreamError(f"{where} answered over {MAX_RESPONSE_BYTES} bytes")
    return raw


@dataclass(slots=True)
class _Idle:
    conn: http.client.HTTPConnection
    since: float


class ConnectionPool:
    """Kept-alive connections per host:port, shared by threads. A call takes the most recently used
    idle connection (or opens one) and gives it back once its response is read whole and the server
    keeps it open; at most `max_idle_per_host` wait, and one idle for over `max_idle_s` is closed
    instead of reused (servers close idle connections: uvicorn after 5 s, `hybridkv serve`'s
    `--idle-timeout-s`). A reused connection that fails before any response byte (the server closed
    it meanwhile) is retried once on a new one."""

    def __init__(self, *, max_idle_per_host: int = 32, max_idle_s: float = 2.0) -> None:
        self._idle: dict[tuple[str, int], list[_Idle]] = {}
        self._lock = threading.Lock()
        self._max_idle = max_idle_per_host
        self._max_idle_s = max_idle_s
        self.opened = 0  # connections opened so far (tests, /metrics)

    def _take(self, host: str, port: int, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection, whether it was reused)."""
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get((host, port), [])
            while idle:
                entry = idle.pop()
                if now - entry.since <= self._max_idle_s:
                    entry.conn.timeout = timeout_s
                    if entry.conn.sock is not None:
                        entry.conn.sock.settimeout(timeout_s)
                    return entry.conn, True
                entry.conn.close()
        return self._new(host, port, timeout_s), False

    def _new(self, host: str, port: int, timeout_s: float) -> http.client.HTTPConnection:
        with self._lock:
            self.opened += 1
        return http.client.HTTPConnection(host, port, timeout=timeout_s)

    def _give_back(self, host: str, port: int, conn: http.client.HTTPConnection,
                   resp: http.client.HTTPResponse) -> None:
        if resp.will_close or conn.sock is None:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault((host, port), [])
            if len(idle) < self._max_idle:
                idle.append(_Idle(conn, time.monotonic()))
                return
        conn.close()

    def _open(self, url: str, path: str, data: bytes | None, timeout_s: float,
              headers: dict[str, str] | None) -> tuple[str, int, http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request (again on a new connection when a reused one was stale): its response head."""
        host, port, prefix = _split(url)
        conn, reused = self._take(host, port, timeout_s)
        try:
            try:
                return host, port, conn, _send(conn, prefix + path, data, headers)
            except _STALE:
                conn.close()
                if not reused:
                    raise
                conn = self._new(host, port, timeout_s)
                return host, port, conn, _send(conn, prefix + path, data, headers)
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UpstreamError(f"{url}{path}: {e!r}") from None

    def call(self, url: str, path: str, body: Any = None, *, timeout_s: float = 30.0,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, response headers with lower-case names) of GET (body None) or POST JSON."""
        host, port, conn, resp = self._open(url, path, _encode(body), timeout_s, headers)
        try:
            raw = _read(resp, f"{url}{path}")
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UpstreamError(f"{url}{path}: {e!r}") from None
        except UpstreamError:
            conn.close()
            raise
        self._give_back(host, port, conn, resp)
        return resp.status, raw, {k.lower(): v for k, v in resp.getheaders()}

    def open_stream(self, url: str, path: str, body: bytes, *, timeout_s: float = 300.0,
                    headers: dict[str, str] | None = None) -> tuple[int, str, Iterator[bytes]]:
        """POST and return (status, content type, the body's chunks as they arrive); the connection
        goes back to the pool when the body was read to its end, and is closed otherwise."""
        host, port, conn, resp = self._open(url, path, body, timeout_s, headers)

        def chunks() -> Iterator[bytes]:
            whole = False
            try:
                while True:
                    piece = resp.read1(65536)
                    if not piece:
                        whole = True
                        return
                    yield piece
            except (OSError, http.client.HTTPException):
                return
            finally:
                if whole:
                    self._give_back(host, port, conn, resp)
                else:
                    conn.close()

        return resp.status, resp.getheader("Content-Type", "application/json"), chunks()

    def close(self) -> None:
        """Close every idle connection."""
        with self._lock:
            idle = [entry for entries in self._idle.values() for entry in entries]
            self._idle.clear()
        for entry in idle:
            entry.conn.close()


def call(url: str, path: str, body: Any = None, *, timeout_s: float = 30.0,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of GET (body None) or POST JSON, on a connection of its own."""
    status, raw, _ = call_with_headers(url, path, body, timeout_s=timeout_s, headers=headers)
    return status, raw


def call_with_headers(url: str, path: str, body: Any = None, *, timeout_s: float = 30.0,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, response headers with lower-case names) of GET (body None) or POST JSON, on a
    connection of its own."""
    pool = ConnectionPool(max_idle_per_host=0)
    return pool.call(url, path, body, timeout_s=timeout_s, headers=headers)
