"""The server process: the ZeroMQ ROUTER control loop, the HTTP thread, tiers, signals.

Lifecycle (as uvicorn's): startup -> one line saying what it listens on -> serve -> on the first
SIGINT/SIGTERM stop taking work: the request being handled finishes, requests already queued
get a SHUTTING_DOWN error reply, the write-behind flushes, tiers close; a second SIGINT forces
an immediate exit.

Engines register on the registration socket (registration.py: a Unix socket, descriptors
passed over it, the connection as the lease), polled by the same loop; the control channel
answers `hello` with its address. With a shared secret (auth.py) every request must carry it.

Requests are served fairly between connections (scheduler.py): a lookup, store or retrieve runs in
bounded slices, and the loop takes one slice of each busy connection's first request in turn, so a
client's small lookup is answered after at most one slice of another client's huge one.

Every request gets exactly one reply (its result or an `ErrorReply`): a malformed, truncated,
unknown or oversized message included, so no client is left waiting. Each message is handled
under one guard: whatever a bug raises becomes one INTERNAL reply, one log record and one count
in `hybridkv_server_internal_errors_total`; no input ends the loop. Messages over
`--max-message-mib` get TOO_LARGE; ZeroMQ itself drops a connection whose message exceeds four
times that (a guard against memory exhaustion).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType

import zmq

from hybridkv.cache_server import limits
from hybridkv.cache_server.auth import Authenticator, server_secret
from hybridkv.cache_server.config import GIB, ServerConfig
from hybridkv.cache_server.http import HTTPServer
from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.cache_server.registration import RegistrationSocket
from hybridkv.cache_server.scheduler import FairScheduler, Steps, Task
from hybridkv.cache_server.store import KVStore, run_steps
from hybridkv.cache_server.tier_events import TierEvents
from hybridkv.cache_server.tiers.base import L2Tier
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.cache_server.tiers.valkey import ValkeyTier
from hybridkv.errors import ConfigError
from hybridkv.host_memory import check_fits
from hybridkv.local_secret import remove_secret, write_secret
from hybridkv.wire import (
    AnyReply,
    AnyRequest,
    ClearReply,
    ClearRequest,
    ErrorCode,
    ErrorReply,
    HelloReply,
    HelloRequest,
    LookupReply,
    LookupRequest,
    OkReply,
    ProtocolError,
    RegisterReply,
    RegisterRequest,
    ReleaseRequest,
    RetrieveReply,
    RetrieveRequest,
    StatusReply,
    StatusRequest,
    StoreReply,
    StoreRequest,
    UnregisterRequest,
    decode_request,
    encode,
)

log = logging.getLogger("hybridkv.cache_server")

POLL_MS = 100
MAX_RECEIVED_PER_ROUND = 256  # messages taken off the socket between two slices


def handle(store: KVStore, req: AnyRequest, *, detail: bool = True) -> AnyReply:
    """The reply to one decoded request (errors become an ErrorReply); `detail`: whether a status
    reply may show the registered engines' models and fingerprints."""
    return run_steps(handle_steps(store, req, detail=detail))


def handle_steps(store: KVStore, req: AnyRequest, *, detail: bool = True) -> Steps:
    """`handle` as steps: a slice of a lookup, store or retrieve per step (store.py)."""
    try:
        return (yield from _dispatch(store, req, detail))
    except RequestError as e:
        store.metrics.errors.labels(e.code.value).inc()
        return ErrorReply(req_id=req.req_id, code=e.code, message=str(e))
    except Exception as e:  # a bug must not kill the loop or leave the client waiting
        return internal_error(store, req.req_id, type(req).__name__, e)


def done_steps(reply: AnyReply) -> Steps:
    """Steps that finish at the first with `reply`."""
    yield from ()
    return reply


def internal_error(store: KVStore, req_id: int, what: str, e: Exception) -> ErrorReply:
    """The one reply, log record and metric count of a bug met while handling `what`."""
    log.exception("internal error handling %s", what)
    store.metrics.errors.labels(ErrorCode.INTERNAL.value).inc()
    store.metrics.internal_errors.inc()
    return ErrorReply(req_id=req_id, code=ErrorCode.INTERNAL, message=f"internal error: {type(e).__name__}: {e}"[:500])


def _dispatch(store: KVStore, req: AnyRequest, detail: bool) -> Steps:
    rid = req.req_id
    match req:
        case RegisterRequest():  # in-process only (tests); the control loop sends these to the registration socket
            reg = store.register(req.layout)
            return RegisterReply(req_id=rid, instance_id=reg.instance_id, token=reg.token,
                                 chunk_tokens=store.config.chunk_tokens, object_groups=reg.object_groups)
        case LookupRequest():
            r = yield from store.lookup_steps(req)
            return LookupReply(req_id=rid, lookup_id=r.lookup_id, hit_tokens=r.hit_tokens,
                               object_group_hit_tokens=r.object_group_hit_tokens, lock_ttl_s=store.config.lock_ttl_s)
        case StoreRequest():
            s = yield from store.store_steps(req)
            return StoreReply(req_id=rid, stored=s.stored, refusals=s.refusals, refusals_left_out=s.refusals_left_out,
                              object_group_bytes=s.object_group_bytes)
        case RetrieveRequest():
            got = yield from store.retrieve_steps(req)
            return RetrieveReply(req_id=rid, retrieved_tokens=got.tokens, bytes_copied=got.bytes_copied,
                                 object_group_bytes=got.object_group_bytes)
        case ReleaseRequest():
            store.release(req.instance_id, req.token, req.lookup_id)
            return OkReply(req_id=rid)
        case UnregisterRequest():
            store.unregister(req.instance_id, req.token)
            return OkReply(req_id=rid)
        case ClearRequest():
            cleared = store.clear()
            return ClearReply(req_id=rid, objects_removed=cleared.objects_removed, problems=cleared.problems)
        case StatusRequest():
            return StatusReply(req_id=rid, status=store.status(detail=detail))
    raise RequestError(ErrorCode.UNKNOWN_OP, f"no handler for {type(req).__name__}")


class ControlServer:
    """The ROUTER socket and its loop; `serve()` returns after `stop()` (from any thread)."""

    def __init__(self, store: KVStore, host: str, port: int, max_message_bytes: int, *,
                 auth: Authenticator | None = None) -> None:
        self.store = store
        self.max_message_bytes = max_message_bytes
        self.auth = auth or Authenticator()
        self.registration = RegistrationSocket(store, self.auth, max_message_bytes,
                                               max_connections=store.config.max_registrations + 16)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes + 4096)
        host_part = f"[{host}]" if ":" in host else host
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(f"tcp://{host_part}:{port if port else '*'}")
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            self.registration.close()
            raise ConfigError(f"cannot bind the control port {host}:{port}: {e}") from None
        endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.decode().rsplit(":", 1)[1]) if isinstance(endpoint, bytes) else port
        self._stop = threading.Event()
        self.scheduler = FairScheduler(limits.MAX_QUEUED_PER_CONNECTION, store.metrics,
                                       lambda _task, e: internal_error(store, 0, "a request", e))

    def stop(self) -> None:
        self._stop.set()

    def serve(self) -> None:
        while not self._stop.is_set():
            poller = zmq.Poller()  # rebuilt each round: registration connections come and go
            poller.register(self._sock, zmq.POLLIN)
            for fd in self.registration.fds():
                poller.register(fd, zmq.POLLIN)
            for what, _ in poller.poll(0 if self.scheduler.busy else POLL_MS):
                if what is self._sock:
                    self._receive()
                elif isinstance(what, int):
                    self.registration.ready(what)
            self._run_slice()
        self._drain()

    def _receive(self) -> None:
        """Queue every request waiting on the socket (at most MAX_RECEIVED_PER_ROUND) as a task."""
        for _ in range(MAX_RECEIVED_PER_ROUND):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, payload = frames[0], frames[-1]
            try:
                steps = self.steps_for(payload, n_frames=len(frames))
            except Exception as e:  # the guard: a bug in decoding answers `internal`, never kills the loop
                steps = done_steps(internal_error(self.store, 0, "a message", e))
            if not self.scheduler.add(Task(identity=identity, steps=steps)):
                steps.close()
                self._send(identity, self._error(0, ErrorCode.LIMIT, f"this connection has {self.scheduler.max_queued} "
                                                 "requests waiting, the most one may; wait for their replies"))

    def _run_slice(self) -> None:
        finished = self.scheduler.run_slice()
        if finished is not None:
            self._send(finished[0].identity, finished[1])

    def _send(self, identity: bytes, reply: AnyReply) -> None:
        self._sock.send_multipart([identity, encode(reply)])

    def reply_to(self, payload: bytes, *, n_frames: int = 2) -> AnyReply:
        """The reply to one message, all its slices run now."""
        return run_steps(self.steps_for(payload, n_frames=n_frames))

    def steps_for(self, payload: bytes, *, n_frames: int = 2) -> Steps:
        """The steps that answer one message (checked and decoded now; the work in its slices)."""
        if n_frames != 2:
            return done_steps(self._error(0, ErrorCode.BAD_MESSAGE, f"expected one frame per request, got "
                                          f"{n_frames - 1}"))
        if len(payload) > self.max_message_bytes:
            return done_steps(self._error(0, ErrorCode.TOO_LARGE, f"message of {len(payload)} bytes exceeds the "
                                          f"limit of {self.max_message_bytes} bytes (--max-message-mib)"))
        try:
            req = decode_request(payload)
        except ProtocolError as e:
            return done_steps(self._error(e.req_id, e.code, str(e)))
        self.store.metrics.requests.labels(type(req).__name__.removesuffix("Request").lower()).inc()
        if not self.auth.ok(req.auth):
            return done_steps(self._error(req.req_id, ErrorCode.UNAUTHORIZED, "this server needs its auth secret in "
                                          "every request (set $HYBRIDKV_AUTH_TOKEN or $HYBRIDKV_AUTH_TOKEN_FILE for "
                                          "the client)"))
        if isinstance(req, HelloRequest):
            return done_steps(HelloReply(req_id=req.req_id, registration_socket=self.registration.address,
                                         auth_required=self.auth.required))
        if isinstance(req, RegisterRequest):
            return done_steps(self._error(req.req_id, ErrorCode.BAD_MESSAGE, "register on the registration socket "
                                          f"(the `hello` reply's {self.registration.address!r}), passing the "
                                          "segments' descriptors"))
        return handle_steps(self.store, req)  # it authenticated (or the server has no secret): full status

    def _error(self, req_id: int, code: ErrorCode, message: str) -> ErrorReply:
        self.store.metrics.errors.labels(code.value).inc()
        return ErrorReply(req_id=req_id, code=code, message=message)

    def _drain(self) -> None:
        """Finish the requests already started, answer every other one queued with SHUTTING_DOWN,
        then close the socket."""
        for task in self.scheduler.take_unstarted():
            task.steps.close()
            self._send(task.identity, self._error(0, ErrorCode.SHUTTING_DOWN, "the server is shutting down"))
        while self.scheduler.busy:
            self._run_slice()
        while self._sock.poll(0):
            frames = self._sock.recv_multipart()
            try:
                req_id = decode_request(frames[-1]).req_id
            except ProtocolError as e:
                req_id = e.req_id
            reply = ErrorReply(req_id=req_id, code=ErrorCode.SHUTTING_DOWN, message="the server is shutting down")
            self._sock.send_multipart([frames[0], encode(reply)])
        self._sock.close()
        self._ctx.term()
        self.registration.close()


def valkey_namespace(config: ServerConfig, configured_secret: str) -> str:
    """The namespace of this server's keys in a shared Valkey (a clear removes only these):
    --l2-valkey-namespace; else servers configured with one secret share one (a cluster); else this
    user's server on this host and control port (a restart on the same port finds its objects)."""
    if config.l2_valkey_namespace is not None:
        return config.l2_valkey_namespace
    if configured_secret:
        return "s-" + hashlib.sha256(configured_secret.encode()).hexdigest()[:16]
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:32]
    port = str(config.port) if config.port else "any-" + secrets.token_hex(4)
    return f"{host}-u{os.geteuid()}-p{port}"


def build_tiers(config: ServerConfig, configured_secret: str = "") -> list[L2Tier]:
    """The L2 tiers asked for, fastest first: local disk, then the shared Valkey."""
    tiers: list[L2Tier] = []
    if config.l2_disk is not None:
        tiers.append(DiskTier(config.l2_disk, int(config.l2_disk_size_gib * GIB)))
    if config.l2_valkey is not None:
        valkey = ValkeyTier(config.l2_valkey, namespace=valkey_namespace(config, configured_secret))
        if not valkey.ping():  # a wrong URL at start-up is a mistake; an outage later is served through
            valkey.close()
            raise ConfigError(f"--l2-valkey {config.l2_valkey}: no Valkey / Redis server answers there; expected a "
                              "running server at that URL (start it, or leave --l2-valkey out)")
        tiers.append(valkey)
    return tiers


def startup_line(config: ServerConfig, control_port: int, http_port: int, tiers: list[str]) -> str:
    l2 = f"{', '.join(tiers)} (sizing {config.l2_sizing.value})" if tiers else "none"
    return (f"hybridkv server listening on tcp://{config.host}:{control_port} (control) and "
            f"http://{config.host}:{http_port} (metrics, status); chunk {config.chunk_tokens} tokens, "
            f"L1 {config.l1_size_gib:g} GiB {config.eviction_policy.value}, object groups "
            f"{config.object_groups.value}, L2: {l2}")


def run_server(config: ServerConfig, *, on_ready: Callable[[str], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM (graceful; a second SIGINT forces)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    configured = server_secret(config.auth_token_file)
    secret = configured or secrets.token_hex(32)  # secure by default: a secret of this start, in a 0600 file
    auth = Authenticator(secret)
    check_fits(kv_cache_gib=config.l1_size_gib, weights_bytes=0, name="--l1-size-gib")
    kv_events = config.kv_events()
    events = None if kv_events is None else TierEvents(kv_events, config.chunk_tokens)
    store = KVStore(config.store_config(), build_tiers(config, configured), events=events)
    control = ControlServer(store, config.host, config.port, config.max_message_bytes, auth=auth)
    secret_file = None if configured else write_secret(control.port, secret)
    http = HTTPServer(store, config.host, config.http_port, auth=auth, allow_remote=not config.is_loopback)
    http.start()
    _install_signals(control)
    line = startup_line(config, control.port, http.port, store.tiers.names)
    if events is not None:
        replay = events.publisher.replay_endpoint
        line += f"; KV events (CPU, DISK) on {events.publisher.endpoint}" + (f", replay {replay}" * bool(replay))
    print(line, flush=True)
    if secret_file is not None:
        print(f"hybridkv server: secret for clients of uid {os.geteuid()} in {secret_file} (read there by KVClient, "
              "the vLLM connector and `hybridkv run`; curl: -H \"Authorization: Bearer $(cat FILE)\")", flush=True)
    if on_ready is not None:
        on_ready(line)
    try:
        control.serve()
    finally:
        http.stop()
        store.close()
        if events is not None:
            events.close()
        if secret_file is not None:
            remove_secret(secret_file)
        log.info("hybridkv server stopped")


def _install_signals(control: ControlServer) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    received: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if received and signum == signal.SIGINT:
            print("hybridkv server: second interrupt, exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        received.append(signum)
        print(f"hybridkv server: {signal.Signals(signum).name}, shutting down (interrupt again to force)",
              file=sys.stderr, flush=True)
        control.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
