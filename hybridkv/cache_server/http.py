"""The server's HTTP face (Starlette on uvicorn, in a background thread): Prometheus `/metrics`,
`/status` (JSON), `POST /cache/clear`, `/healthz`."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hybridkv.cache_server.store import KVStore


def make_app(store: KVStore) -> Starlette:
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(store.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(_: Request) -> Response:
        return JSONResponse(store.status())

    async def clear(_: Request) -> Response:
        return JSONResponse({"objects_removed": store.clear()})

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/metrics", metrics), Route("/status", status), Route("/cache/clear", clear, methods=["POST"]),
        Route("/healthz", healthz),
    ])


class HTTPServer:
    """uvicorn serving `make_app(store)` on an already bound socket (so port 0 works)."""

    def __init__(self, store: KVStore, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(128)  # connections wait in the backlog until uvicorn accepts them
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(make_app(store), log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="hybridkv-http", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()
