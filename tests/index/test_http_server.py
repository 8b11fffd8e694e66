"""The index's own HTTP/1.1 server (index/http_server.py) speaks HTTP as clients expect: checked
over raw sockets against the RFC's rules (keep-alive, `Connection: close`, HTTP/1.0, `Expect:
100-continue`, pipelining, HEAD, malformed requests, idle and connection limits)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from hybridkv.index.http_server import IndexServer, Routes


def echo(raw: bytes) -> tuple[int, bytes]:
    return 200, json.dumps({"got": len(raw)}).encode()


@pytest.fixture
def server() -> Iterator[IndexServer]:
    routes = Routes(posts={"/echo": echo}, gets={"/health": lambda: (200, b"ok", b"text/plain")},
                    max_body_bytes=1000, not_found="no such route; expected POST /echo")
    s = IndexServer(routes, idle_timeout_s=0.5, max_connections=4)
    s.start()
    yield s
    s.stop()


def connect(server: IndexServer) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=5)


def read_reply(sock: socket.socket, buffered: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One reply (status, lower-case headers, body) from `buffered` + the socket; the rest stays buffered."""
    while b"\r\n\r\n" not in buffered:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; had {bytes(buffered)!r}"
        buffered += chunk
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    end = len(head) + 4 + int(headers.get("content-length", "0"))
    while len(buffered) < end:
        buffered += sock.recv(65536)
    body = bytes(buffered[len(head) + 4 : end])
    del buffered[:end]
    return int(lines[0].split()[1]), headers, body


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def test_keep_alive_pipelining_and_close(server: IndexServer) -> None:
    with connect(server) as sock:
        buf = bytearray()
        sock.sendall(post("/echo", b"abc") + post("/echo", b"abcdef") + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_reply(sock, buf)[::2] == (200, b'{"got": 3}')  # (in order, on one connection)
        assert read_reply(sock, buf)[::2] == (200, b'{"got": 6}')
        status, headers, body = read_reply(sock, buf)
        assert (status, body, headers["content-type"]) == (200, b"ok", "text/plain")
        sock.sendall(post("/echo", b"x", "Connection: close"))
        status, headers, _ = read_reply(sock, buf)
        assert status == 200 and headers["connection"] == "close" and closed(sock)
    with connect(server) as sock:  # (HTTP/1.0: one request per connection)
        sock.sendall(post("/echo", b"x", version="1.0"))
        assert read_reply(sock, bytearray())[0] == 200 and closed(sock)


def test_expect_100_continue_head_and_chunked(server: IndexServer) -> None:
    with connect(server) as sock:
        buf = bytearray()
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"hello")
        assert read_reply(sock, buf)[::2] == (200, b'{"got": 5}')
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        assert read_reply(sock, buf)[::2] == (200, b'{"got": 5}')
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")  # (no body after a HEAD's head)


def test_errors_are_one_json_line(server: IndexServer) -> None:
    cases = [(post("/nowhere", b"{}"), 404, "no such route; expected POST /echo"),
             (b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n", 404, "no such route"),
             (post("/echo", b"x" * 1001), 413, "over the limit of 1000")]
    for request, status, needle in cases:
        with connect(server) as sock:
            sock.sendall(request)
            got, headers, body = read_reply(sock, bytearray())
            message = json.loads(body)["error"]["message"]
            assert got == status and needle in message and "\n" not in message
            assert headers["content-type"] == "application/json"
    with connect(server) as sock:  # (a request line that is not HTTP: 400, then the connection closes)
        sock.sendall(b"HELLO THERE\r\n\r\n")
        got, _, body = read_reply(sock, bytearray())
        assert got == 400 and "malformed HTTP request" in json.loads(body)["error"]["message"] and closed(sock)


def test_idle_and_surplus_connections_are_closed(server: IndexServer) -> None:
    socks = [connect(server) for _ in range(4)]
    try:
        for sock in socks:  # (each one used, so all four are held)
            sock.sendall(post("/echo", b"x"))
            assert read_reply(sock, bytearray())[0] == 200
        with connect(server) as fifth:  # (past max_connections: closed at once)
            assert closed(fifth)
        time.sleep(1.5)  # (idle past idle_timeout_s, 0.5 s; the sweep runs every min(5 s, the timeout))
        assert all(closed(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()


def test_a_route_that_raises_is_a_500_line() -> None:
    def broken(_: bytes) -> tuple[int, bytes]:
        raise RuntimeError("a bug")

    s = IndexServer(Routes(posts={"/x": broken}))
    s.start()
    try:
        with connect(s) as sock:
            sock.sendall(post("/x", b"{}"))
            status, _, body = read_reply(sock, bytearray())
        assert status == 500 and json.loads(body)["error"]["message"] == "internal error: RuntimeError"
    finally:
        s.stop()
