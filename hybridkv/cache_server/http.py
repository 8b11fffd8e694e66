"""The server's HTTP face (Starlette on uvicorn, in a background thread): Prometheus `/metrics`,
`/status` (JSON), `POST /cache/clear`, `/healthz`.

Every route but `/healthz` reveals or changes state and needs `Authorization: Bearer <secret>`
(the scheme in any case) when the server has a secret, which a server process always has
(auth.py). Every POST is refused (403) when it carries an `Origin` header (a browser page: another
site must not clear the cache through the user's browser) or, on a loopback server, a `Host` that
is not a loopback name (DNS rebinding)."""

from __future__ import annotations

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from hybridkv.cache_server.auth import Authenticator
from hybridkv.cache_server.store import KVStore
from hybridkv.http_serving import BoundServer, bind_socket

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]", "::1"})


def _host_name(header: str) -> str:
    """The host of a `Host` header (`name:port`, `[v6]:port`)."""
    if header.startswith("["):
        return header[:header.find("]") + 1]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def post_refusal(request: Request, auth: Authenticator, *, allow_remote: bool) -> Response | None:
    """Why a POST is refused (a 401/403 response), or None when it may go on."""
    if "origin" in request.headers:
        return JSONResponse({"error": "cross-origin requests are refused (a POST carried an Origin header)"}, 403)
    if not allow_remote and _host_name(request.headers.get("host", "")).lower() not in LOOPBACK_HOSTS:
        return JSONResponse({"error": f"Host {request.headers.get('host', '')!r:.100} is not a loopback name"}, 403)
    if not auth.ok_bearer(request.headers.get("authorization")):
        return _unauthorized()
    return None


def _unauthorized() -> Response:
    return JSONResponse({"error": "this server needs `Authorization: Bearer <secret>` (a server started without "
                                  "--auth-token-file writes its secret to $XDG_RUNTIME_DIR/hybridkv/server-<control "
                                  "port>.secret, else /tmp/hybridkv-<uid>/)"}, 401,
                        headers={"WWW-Authenticate": "Bearer"})


def make_app(store: KVStore, auth: Authenticator | None = None, *, allow_remote: bool = False) -> Starlette:
    auth = auth or Authenticator()

    async def metrics(request: Request) -> Response:
        if not auth.ok_bearer(request.headers.get("authorization")):
            return _unauthorized()
        return Response(generate_latest(store.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request) -> Response:
        if not auth.ok_bearer(request.headers.get("authorization")):
            return _unauthorized()
        return JSONResponse(store.status(detail=True))

    async def clear(request: Request) -> Response:
        refused = post_refusal(request, auth, allow_remote=allow_remote)
        if refused is not None:
            return refused
        if request.query_params:  # e.g. ?model=: clearing one model's objects is not offered; never widen it
            return JSONResponse({"error": f"POST /cache/clear takes no parameters (it clears every model's objects "
                                          f"in L1 and L2); got {', '.join(sorted(request.query_params))}"}, 400)
        cleared = store.clear()
        if cleared.problems:  # never "removed" for what is still there
            return JSONResponse({"error": "; ".join(cleared.problems), "objects_removed": cleared.objects_removed}, 500)
        return JSONResponse({"objects_removed": cleared.objects_removed})

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(routes=[
        Route("/metrics", metrics), Route("/status", status), Route("/cache/clear", clear, methods=["POST"]),
        Route("/healthz", healthz),
    ])


class HTTPServer(BoundServer):
    """uvicorn serving `make_app(store)` on an already bound socket (so port 0 works)."""

    def __init__(self, store: KVStore, host: str, port: int, *, auth: Authenticator | None = None,
                 allow_remote: bool = False) -> None:
        sock = bind_socket(host, port, what="--http-port", backlog=128)
        config = uvicorn.Config(make_app(store, auth, allow_remote=allow_remote), log_level="warning", lifespan="off",
                                access_log=False)
        super().__init__(uvicorn.Server(config), sock, name="hybridkv-http")

    def stop(self, timeout_s: float = 5.0) -> None:
        super().stop(timeout_s)
