"""Binding and lifecycle of `hybridkv serve`: uvicorn on a socket bound first (so port 0 works).

`ServeServer(llm, host=..., port=...)` binds at once (an address in use fails here, before the
engine thread starts). `run()` serves in the calling thread until SIGINT / SIGTERM: the first
signal stops accepting connections and lets the requests in flight finish (at most
`graceful_s`, then they are cancelled and aborted), the second forces the exit; then the engine
thread stops. `run` then returns: after SIGINT `interrupted` is set and the command exits 130; after
SIGTERM it exits 0, as `hybridkv server` does. `start()` /
`stop()` do the same on a background thread (tests, benchmarks).
Loopback only unless `allow_remote`; `ServeLimits` (limits.py) sets the API key, the body limit,
the header and idle timeouts and the connection cap.
"""

from __future__ import annotations

import ipaddress
import signal
from types import FrameType

import uvicorn

from hybridkv.engine.llm import LLM
from hybridkv.errors import ConfigError
from hybridkv.http_serving import BoundServer, bind_socket
from hybridkv.openai_api.app import make_app
from hybridkv.openai_api.limits import ServeLimits, with_header_timeout

DEFAULT_GRACEFUL_S = 30.0


def check_host(host: str, *, allow_remote: bool) -> bool:
    """Whether `host` is a loopback address; ConfigError for another one unless `allow_remote`."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ConfigError(f"--host must be an IP address or localhost, got {host!r}") from None
    if not loopback and not allow_remote:
        raise ConfigError(f"--host {host} is not a loopback address; pass --allow-remote to serve other machines "
                          "(and --api-key, or anyone who can reach it may use it)")
    return loopback


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal it shut down for is not raised again afterwards: `run`
    returns, and `interrupted` says whether a SIGINT came (re-raised inside asyncio's runner, it was lost
    when the serving task ended before the runner's cancel reached it: exit 0 instead of 130)."""

    interrupted = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.remove(sig)
        self.interrupted = self.interrupted or sig == signal.SIGINT


class ServeServer(BoundServer):
    """uvicorn serving `make_app(llm)` on an already bound socket."""

    def __init__(self, llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 allow_remote: bool = False, graceful_s: float = DEFAULT_GRACEFUL_S,
                 log_level: str = "warning", limits: ServeLimits | None = None) -> None:
        limits = limits or ServeLimits()
        self.loopback = check_host(host, allow_remote=allow_remote)
        sock = bind_socket(host, port)
        self.app = make_app(llm, model_name=model_name or str(llm.model_spec.name), limits=limits)
        # asyncio + h11 explicitly: with uvloop or httptools installed (uvicorn[standard]) streamed
        # requests stalled here (bench_serve: 2x the wall time at the same CPU time).
        config = uvicorn.Config(self.app, log_level=log_level, access_log=False, lifespan="on", loop="asyncio",
                                http=with_header_timeout(limits.header_timeout_s),
                                timeout_keep_alive=limits.idle_timeout_s, limit_concurrency=limits.max_connections,
                                timeout_graceful_shutdown=int(graceful_s))
        self._uvicorn = _Server(config)
        super().__init__(self._uvicorn, sock, name="hybridkv-serve")

    @property
    def interrupted(self) -> bool:
        """Whether a SIGINT stopped `run` (the command then exits 130)."""
        return self._uvicorn.interrupted
