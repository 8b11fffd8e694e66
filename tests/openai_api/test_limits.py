"""`hybridkv serve` under clients that misbehave: the API key, the body limit (413), header and idle
timeouts, the connection cap, and tokenization kept off the event loop."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.openai_api.http_server import ServeServer
from hybridkv.openai_api.limits import ServeLimits
from tests.openai_api.conftest import ENGINE, MODEL

openai = pytest.importorskip("openai")

KEY = "s3cret-key"
LIMITS = ServeLimits(api_key=KEY, max_body_bytes=2000, header_timeout_s=0.5, body_timeout_s=1.0, idle_timeout_s=1,
                     max_connections=4)


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServeServer]:
    serve = ServeServer(LLM(MODEL, **ENGINE), port=0, model_name=MODEL, limits=LIMITS)
    serve.start()
    yield serve
    serve.stop()


def _call(server: ServeServer, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
          *, chunked: bool = False) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        data: Any = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        if chunked and data is not None:
            data = iter([data[i : i + 500] for i in range(0, len(data), 500)])
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})},
                     encode_chunked=chunked)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode()


def test_the_api_key_guards_v1_and_reset_but_not_health(guarded: ServeServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, reply = _call(guarded, "POST", "/v1/completions", body, headers)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
        assert "Authorization: Bearer <key>" in reply["error"]["message"]
    assert _call(guarded, "GET", "/v1/models")[0] == 401
    assert _call(guarded, "POST", "/reset_prefix_cache")[0] == 401
    assert _call(guarded, "GET", "/health")[0] == 200 and _call(guarded, "GET", "/metrics")[0] == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert _call(guarded, "POST", "/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY}"})[0] == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413(guarded: ServeServer, chunked: bool) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": MODEL, "prompt": "x" * 3000, "max_tokens": 2}
    status, reply = _call(guarded, "POST", "/v1/completions", big, auth, chunked=chunked)
    assert status == 413, reply
    assert "this server accepts at most 2000 (hybridkv serve --max-body-bytes)" in reply["error"]["message"]
    small = {"model": MODEL, "prompt": "x" * 1000, "max_tokens": 2}
    assert _call(guarded, "POST", "/v1/completions", small, auth, chunked=chunked)[0] == 200


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes `sock` (EOF) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


@pytest.mark.slow
def test_slow_heads_are_closed_and_idle_connections_too(guarded: ServeServer) -> None:
    silent = socket.create_connection(("127.0.0.1", guarded.port))
    partial = socket.create_connection(("127.0.0.1", guarded.port))
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a request head that never ends
    started = time.monotonic()
    assert _closed_within(silent, 10) and _closed_within(partial, 10)
    assert time.monotonic() - started < 5  # the 0.5 s header timeout, not a default
    idle = socket.create_connection(("127.0.0.1", guarded.port))
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    idle.settimeout(10)
    assert idle.recv(4096).startswith(b"HTTP/1.1 200")
    assert _closed_within(idle, 10)  # the 1 s idle (keep-alive) timeout
    for sock in (silent, partial, idle):
        sock.close()


def test_connections_beyond_the_cap_get_503(guarded: ServeServer) -> None:
    held = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    status, _ = _call(guarded, "GET", "/health")
    assert status == 503  # uvicorn's limit_concurrency
    for sock in held:
        assert _closed_within(sock, 10)  # the header timeout frees them
        sock.close()
    assert _call(guarded, "GET", "/health")[0] == 200


def test_prompts_are_tokenized_off_the_event_loop(server: ServeServer, client: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.app.state.serve.llm.tokenizer
    threads: list[str] = []
    encode = tokenizer.encode

    def recording(text: str) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text)

    monkeypatch.setattr(tokenizer, "encode", recording)
    client.completions.create(model=MODEL, prompt="where am I tokenized?", max_tokens=1)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "and here?"}], max_tokens=1)
    assert len(threads) == 2 and "hybridkv-serve" not in threads, threads  # the event loop's thread


def test_connections_send_without_nagle_delay(server: ServeServer) -> None:
    """A stream's head goes out at once and its first token later: with Nagle's algorithm on, that token
    waited for the client's delayed ACK of the head on a keep-alive connection (vllm bench saw +15 ms)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        ours = sock.getsockname()
        connections = server._server.server_state.connections  # uvicorn's open connections (protocols)
        [protocol] = [c for c in connections if c.transport.get_extra_info("peername") == ours]
        accepted = protocol.transport.get_extra_info("socket")
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()


def test_the_bearer_scheme_is_case_insensitive(guarded: ServeServer) -> None:
    """RFC 9110: the auth scheme is case-insensitive (`bearer` was refused, issue 46)."""
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert _call(guarded, "GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})[0] == 200
    assert _call(guarded, "GET", "/v1/models", headers={"Authorization": f"basic {KEY}"})[0] == 401


def test_a_body_that_trickles_gets_408(guarded: ServeServer) -> None:
    """A head that promises 1,000 bytes, then 10: answered 408 after --body-timeout-s (it waited forever)."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        reply = sock.recv(4096)
        waited = time.monotonic() - t0
        while b"arrive within" not in reply and (more := sock.recv(4096)):
            reply += more
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"did not arrive within 1 s" in reply
    assert 0.9 < waited < 5
