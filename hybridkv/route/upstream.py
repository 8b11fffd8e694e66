"""Blocking HTTP to engines and the index (the app runs these in threads): JSON calls and a
streamed body, with timeouts; every failure is an `UpstreamError` naming the engine."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

__all__ = ["UpstreamError", "call", "call_with_headers", "open_stream"]

MAX_RESPONSE_BYTES = 64 << 20


class UpstreamError(Exception):
    """An engine or the index could not be reached or answered garbage."""


def _connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UpstreamError(f"{url!r} is not an http://host:port URL")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s), parts.path.rstrip("/")


def call(url: str, path: str, body: Any = None, *, timeout_s: float = 30.0,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(status, body) of GET (body None) or POST JSON."""
    status, raw, _ = call_with_headers(url, path, body, timeout_s=timeout_s, headers=headers)
    return status, raw


def call_with_headers(url: str, path: str, body: Any = None, *, timeout_s: float = 30.0,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, response headers with lower-case names) of GET (body None) or POST JSON."""
    conn, prefix = _connection(url, timeout_s)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn.request("GET" if data is None else "POST", prefix + path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read(MAX_RESPONSE_BYTES + 1)
        if len(raw) > MAX_RESPONSE_BYTES:
            raise UpstreamError(f"{url}{path} answered over {MAX_RESPONSE_BYTES} bytes")
        return resp.status, raw, {k.lower(): v for k, v in resp.getheaders()}
    except (OSError, http.client.HTTPException) as e:
        raise UpstreamError(f"{url}{path}: {e!r}") from None
    finally:
        conn.close()


def open_stream(url: str, path: str, body: bytes, *, timeout_s: float = 300.0,
                headers: dict[str, str] | None = None) -> tuple[int, str, Iterator[bytes]]:
    """POST and return (status, content type, the body's chunks as they arrive)."""
    conn, prefix = _connection(url, timeout_s)
    try:
        conn.request("POST", prefix + path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise UpstreamError(f"{url}{path}: {e!r}") from None

    def chunks() -> Iterator[bytes]:
        try:
            while True:
                piece = resp.read1(65536)
                if not piece:
                    return
                yield piece
        except (OSError, http.client.HTTPException):
            return
        finally:
            conn.close()

    return resp.status, resp.getheader("Content-Type", "application/json"), chunks()
