"""What every hybridkv HTTP service shares: uvicorn on a socket bound first, and the bearer check.

    sock = bind_socket(host, port, what="--http-port")     an address in use fails here, at once
    server = BoundServer(uvicorn.Server(config), sock, name="hybridkv-index")
    server.run()                       serve in this thread (uvicorn's signals: graceful, then forced)
    server.start() / server.stop()     the same on a background thread (tests, benchmarks)

Binding before uvicorn starts is what makes port 0 work (the port is known before serving) and
turns "address in use" into a ConfigError the CLI prints in one line. `bearer_ok` is the one
constant-time comparison of an `Authorization: Bearer <secret>` header (`hybridkv serve`'s API
key, the KV cache server's secret and the index's token all go through it).

Users: `hybridkv serve` (openai_api.http_server), `hybridkv server`'s HTTP face (cache_server.http),
`hybridkv index` and `hybridkv route` (index.http).
"""

from __future__ import annotations

import gc
import hmac
import importlib.util
import socket
import sys
import threading
import time
from typing import Literal

import uvicorn

from hybridkv.errors import ConfigError

__all__ = ["BoundServer", "bearer_ok", "bind_socket", "event_loop", "tune_for_latency"]


def bind_socket(host: str, port: int, *, what: str = "--port", backlog: int = 256) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when `host` has a colon); ConfigError naming `what`
    (the flag that set the port) when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # (proto IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP; with
    # Nagle on, a response's body waits behind its headers for the client's delayed ACK, 40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port} ({what}): {exc.strerror}; expected a free port "
                          "(0: any free port)") from None
    sock.listen(backlog)  # (connections wait in the backlog until uvicorn accepts them)
    return sock


def http_url(host: str, port: int) -> str:
    """The base URL of a server bound to `host` (an IPv6 address in brackets) and `port`."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bearer_ok(secret: bytes, header: str | None) -> bool:
    """Whether an `Authorization` header carries `secret` as a bearer token (always, when `secret` is
    empty: authentication off). The scheme is matched in any case; the comparison is constant-time."""
    if not secret:
        return True
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), secret)


def event_loop() -> Literal["uvloop", "asyncio"]:
    """uvicorn's `loop` for `hybridkv route`: uvloop when it is installed (libuv's loop: ~0.06 ms less
    server CPU than asyncio's per request with a 200 KB body, measured on uvicorn serving the index's
    `/query` before the index got its own server), else asyncio's own."""
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


#: the GIL's switch interval of a latency-bound service: Python's 5 ms default lets a request's thread wait
#: that long behind a busy one (an event ingest thread). `bench_routing.py --part scale` on an idle machine,
#: `/query`'s p99 over HTTP: 0.83-3.03 ms in 4 runs (2 under 1 ms) with 5 ms; 0.64-1.11 ms in 7 (6 under 1 ms)
SWITCH_INTERVAL_S = 0.0005


def tune_for_latency() -> None:
    """Before serving: collect once, then move every object alive now out of the collector's generations
    (gc.freeze: a full collection then walks what requests allocated, not all that startup built), and a
    short GIL switch interval (`SWITCH_INTERVAL_S`)."""
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class BoundServer:
    """A uvicorn server on an already bound socket, run here or on a background thread."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, *, name: str = "hybridkv-http") -> None:
        self._server = server
        self._sock = sock
        self._name = name
        self._thread: threading.Thread | None = None
        address = sock.getsockname()
        self.host: str = address[0]
        self.port: int = address[1]

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    def run(self) -> None:
        """Serve in this thread until uvicorn exits (a signal, or `request_stop`); closes the socket."""
        try:
            self._server.run(sockets=[self._sock])
        finally:
            self._sock.close()

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve on a background thread; returns once it accepts requests (RuntimeError otherwise)."""
        self._thread = threading.Thread(target=self.run, name=self._name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"{self._name} did not start within {timeout_s} s")

    def request_stop(self) -> None:
        """Ask the server to stop gracefully (safe before `run` starts: it then stops at once)."""
        self._server.should_exit = True

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop and wait for the background thread (at most `timeout_s`)."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
