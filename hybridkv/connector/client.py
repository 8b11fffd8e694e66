"""The KV cache server's client library: pure Python + numpy, no torch, no engine.

    buffers = SharedKVBuffers.create(num_buffers=2, size_bytes=num_blocks * page_stride)
    layout = make_layout(model="m", groups=[...], buffers=buffers, num_blocks=..., page_stride_bytes=...)
    with KVClient("tcp://127.0.0.1:5555") as client:
        client.register(layout)                                   # -> Registration
        hashes = chunk_hashes(token_ids, client.chunk_tokens)      # chained, one per full chunk
        client.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[...], [...]])  # per engine group
        hit = client.lookup(hashes, num_tokens=len(token_ids))   # hit.hit_tokens; chunks held
        client.retrieve(hit.lookup_id, block_ids=[[...], [...]])  # pages copied into those blocks
        # or client.release(hit.lookup_id) when the engine will not load them

Registering hands the layout's segments (SharedKVBuffers of this process, segments.py) to the
server as file descriptors over its registration socket, whose address the control channel's
`hello` gives; that connection stays open as the registration's lease, and the reply's secret
token goes with every later request. The server's shared secret, when it has one, is read from
$HYBRIDKV_AUTH_TOKEN (or the file named by $HYBRIDKV_AUTH_TOKEN_FILE) unless given, else, for a loopback
endpoint, from the file the same user's server wrote (hybridkv/local_secret.py).

Every call raises `ServerError` (with the server's `ErrorCode`) on an error reply,
`ServerUnreachable` within `connect_timeout_s` when no server is connected (nothing listens, it
died), and `ServerTimeout` when no reply came within `timeout_s`. After a failure the socket is
replaced, so the next call reaches a restarted server; a call answered UNKNOWN_INSTANCE (the
server restarted and forgot this engine) re-registers the layout once and is sent again. Lookup
ids do not survive a restart: a retrieve of an old lookup fails with UNKNOWN_LOOKUP.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import xxhash
import zmq

from hybridkv.connector.segments import SharedKVBuffers, segment_fds
from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.local_secret import secret_for_endpoint
from hybridkv.wire import (
    AUTH_TOKEN_ENV,
    AUTH_TOKEN_FILE_ENV,
    AnyReply,
    BufferLayout,
    ClearReply,
    ClearRequest,
    ErrorCode,
    ErrorReply,
    GroupLayout,
    HelloReply,
    HelloRequest,
    Layout,
    LookupReply,
    LookupRequest,
    ObjectGroupInfo,
    OkReply,
    RegisterReply,
    RegisterRequest,
    RegistrationAccess,
    ReleaseRequest,
    Request,
    RetrieveReply,
    RetrieveRequest,
    StatusReply,
    StatusRequest,
    StoreReply,
    StoreRequest,
    UnregisterRequest,
    decode_reply,
    encode,
    layout_fingerprint,
    segment_labels,
)

__all__ = [
    "BufferLayout", "GroupLayout", "KVClient", "Layout", "LookupReply", "Registration", "RegistrationAccess",
    "RetrieveReply", "ServerError", "ServerTimeout", "ServerUnreachable", "SharedKVBuffers", "StoreReply",
    "auth_token_from_env", "chunk_hashes", "make_layout",
]

MAX_SEGMENTS = 253  # descriptors Linux passes in one message (SCM_MAX_FD): the server takes no more

R = TypeVar("R", bound=AnyReply)


class ServerError(HybridKVError, RuntimeError):
    """The server answered with an error (`code`: the server's ErrorCode)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


class ServerTimeout(ServerError):
    """No reply within the client's timeout (server down, restarting or overloaded)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.INTERNAL, message)


class ServerUnreachable(ServerTimeout):
    """No server is connected: nothing listens at the endpoint, or it died (found within connect_timeout_s)."""


def auth_token_from_env() -> str:
    """The server's shared secret for a client: $HYBRIDKV_AUTH_TOKEN, else the contents of the file
    $HYBRIDKV_AUTH_TOKEN_FILE names, else "" (a server without a secret)."""
    token = os.environ.get(AUTH_TOKEN_ENV, "").strip()
    path = os.environ.get(AUTH_TOKEN_FILE_ENV, "").strip()
    if token or not path:
        return token
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"${AUTH_TOKEN_FILE_ENV}: cannot read {path!r}: {e.strerror}") from None


def chunk_hashes(token_ids: Sequence[int] | npt.NDArray[np.int64], chunk_tokens: int, *, seed: int = 0) -> list[bytes]:
    """Chained xxh3-128 hash of every full chunk: h_i = H(h_{i-1} | little-endian int64 tokens of chunk i).

    The cache salt is not hashed here: it travels with each request and is part of the server's keys."""
    tokens = np.asarray(token_ids, dtype="<i8")
    parent = seed.to_bytes(16, "little")
    out = []
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        parent = xxhash.xxh3_128_digest(parent + tokens[start:start + chunk_tokens].tobytes())
        out.append(parent)
    return out


def make_layout(*, model: str, groups: Sequence[GroupLayout], buffers: SharedKVBuffers | Sequence[BufferLayout],
                num_blocks: int, page_stride_bytes: int, rank: int = 0, world_size: int = 1,
                fingerprint: str | None = None) -> Layout:
    specs = buffers.buffer_layouts() if isinstance(buffers, SharedKVBuffers) else list(buffers)
    return Layout(model=model, rank=rank, world_size=world_size, groups=list(groups), buffers=specs,
                  num_blocks=num_blocks, page_stride_bytes=page_stride_bytes,
                  fingerprint=fingerprint or layout_fingerprint(model, groups))


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    instance_id: int
    token: str  # the registration's secret (sent with every request on it)
    chunk_tokens: int
    object_groups: list[ObjectGroupInfo]


def _register_roundtrip(lease: socket.socket, payload: bytes, fds: list[int]) -> AnyReply:
    """Send a register request and read its reply. A server that refuses a connection as soon as it
    accepts it (another user's, one too many) has queued its refusal and closed: the send may then
    fail (EPIPE) and the first read report a reset, and the refusal is still there to read."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        socket.send_fds(lease, [payload], fds)
    try:
        data = lease.recv(1 << 20)
    except ConnectionResetError:  # reported once, ahead of the messages still queued
        data = lease.recv(1 << 20)
    if not data:
        raise ConnectionError("the server closed the connection without a reply")
    return decode_reply(data)


class KVClient:
    """One engine's connection to the server (a ZeroMQ DEALER; one request in flight at a time,
    not thread-safe: use one client per thread). `auth_token`: the server's shared secret (None:
    from the environment, `auth_token_from_env`, else the secret file of a local server)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout_s: float = 10.0,
                 connect_timeout_s: float = 0.5, auth_token: str | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        given = auth_token_from_env() if auth_token is None else auth_token
        self._auth_from_file = auth_token is None and not given  # read again after a restart
        self._auth = secret_for_endpoint(endpoint) if self._auth_from_file else given
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._lease: socket.socket | None = None  # the registration connection
        self._ids = itertools.count(1)
        self._layout: Layout | None = None
        self._access = RegistrationAccess.COPY
        self.registration: Registration | None = None

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | types.TracebackType | None) -> None:
        self.close()

    @property
    def chunk_tokens(self) -> int:
        return self._registered().chunk_tokens

    # ---- verbs ------------------------------------------------------------------------------

    def hello(self, *, timeout_s: float | None = None) -> HelloReply:
        """Where to register; also a cheap probe of a server that failed (`timeout_s`: this call's bound)."""
        return self._call(HelloRequest(req_id=0), HelloReply, timeout_s=timeout_s)

    def register(self, layout: Layout, *, access: RegistrationAccess = RegistrationAccess.COPY) -> Registration:
        """Register `layout`, passing its segments (SharedKVBuffers of this process) to the server;
        LOOKUP_ONLY passes none (a process that only looks up, e.g. vLLM's scheduler)."""
        fds = segment_fds(segment_labels(layout)) if access is RegistrationAccess.COPY else []
        if len(fds) > MAX_SEGMENTS:
            raise ConfigError(f"the layout has {len(fds)} segments; a registration passes at most {MAX_SEGMENTS} (one "
                              "descriptor each: Linux passes at most 253 in one message); pack layers into fewer")
        address = self.hello().registration_socket
        self._close_lease()
        lease = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lease.settimeout(self.timeout_s)
        try:
            self._connect_lease(lease, "\0" + address[1:] if address.startswith("@") else address)
            reply = _register_roundtrip(lease, encode(RegisterRequest(req_id=next(self._ids), auth=self._auth,
                                                                      layout=layout, access=access)), fds)
        except (OSError, ValueError) as e:
            lease.close()
            raise ServerUnreachable(f"cannot register at {address!r} (the server's registration socket, on this "
                                    f"machine): {e}") from None
        if isinstance(reply, ErrorReply) or not isinstance(reply, RegisterReply):
            lease.close()
            if isinstance(reply, ErrorReply):
                raise ServerError(reply.code, reply.message)
            raise ServerError(ErrorCode.BAD_MESSAGE, f"expected a RegisterReply, got {type(reply).__name__}")
        self._lease, self._layout, self._access = lease, layout, access
        self.registration = Registration(instance_id=reply.instance_id, token=reply.token,
                                         chunk_tokens=reply.chunk_tokens, object_groups=reply.object_groups)
        return self.registration

    def lookup(self, hashes: Sequence[bytes], *, num_tokens: int, cache_salt: str = "") -> LookupReply:
        """The longest prefix every object group serves (at most num_tokens - 1, in whole chunks); its
        chunks stay held until `retrieve`, `release` or the server's lock TTL."""
        return self._engine_call(lambda r: LookupRequest(
            req_id=0, instance_id=r.instance_id, token=r.token, fingerprint=self._fp(), chunk_hashes=list(hashes),
            num_tokens=num_tokens, cache_salt=cache_salt), LookupReply)

    def store(self, *, first_chunk: int, chunk_hashes: Sequence[bytes], block_ids: Sequence[Sequence[int]],
              cache_salt: str = "", parent_hash: bytes = b"") -> StoreReply:
        """Store chunks first_chunk.. (block_ids[g]: group g's blocks of exactly those chunks;
        `parent_hash`: chunk first_chunk - 1's hash, which lets the server evict by resumable prefix).
        `reply.stored[i]` is True only when every object group committed chunk first_chunk + i."""
        return self._engine_call(lambda r: StoreRequest(
            req_id=0, instance_id=r.instance_id, token=r.token, fingerprint=self._fp(), first_chunk=first_chunk,
            chunk_hashes=list(chunk_hashes), block_ids=[list(b) for b in block_ids], cache_salt=cache_salt,
            parent_hash=parent_hash), StoreReply)

    def retrieve(self, lookup_id: int, *, block_ids: Sequence[Sequence[int]], num_tokens: int = -1,
                 skip_tokens: int = 0) -> RetrieveReply:
        """Copy the held hit into this registration's blocks (block_ids[g]: group g's blocks covering the
        tokens retrieved; only the blocks each group needs are written, none that ends at or before
        `skip_tokens`, the engine's own prefix hit). Consumes the lookup, which may have been made by
        another registration of the same layout (vLLM's scheduler in another process)."""
        r = self._registered()
        return self._call(RetrieveRequest(req_id=0, instance_id=r.instance_id, token=r.token, fingerprint=self._fp(),
                                          lookup_id=lookup_id, block_ids=[list(b) for b in block_ids],
                                          num_tokens=num_tokens, skip_tokens=skip_tokens), RetrieveReply)

    def release(self, lookup_id: int) -> None:
        r = self._registered()
        self._call(ReleaseRequest(req_id=0, instance_id=r.instance_id, token=r.token, lookup_id=lookup_id), OkReply)

    def unregister(self) -> None:
        r = self._registered()
        try:
            self._call(UnregisterRequest(req_id=0, instance_id=r.instance_id, token=r.token), OkReply)
        finally:
            self.registration = None
            self._close_lease()

    def clear(self) -> int:
        """Drop every object of every tier; the number of L1 objects removed."""
        reply = self._call(ClearRequest(req_id=0), ClearReply)
        if reply.problems:
            raise ServerError(ErrorCode.INTERNAL, "the clear was partial: " + "; ".join(reply.problems))
        return reply.objects_removed

    def status(self) -> dict[str, Any]:
        return self._call(StatusRequest(req_id=0), StatusReply).status

    def close(self) -> None:
        self._close_lease()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()

    # ---- transport --------------------------------------------------------------------------

    def _close_lease(self) -> None:
        if self._lease is not None:
            self._lease.close()
            self._lease = None

    def _registered(self) -> Registration:
        if self.registration is None:
            raise HybridKVError("register a layout first (KVClient.register)")
        return self.registration

    def _fp(self) -> str:
        assert self._layout is not None  # set with the registration
        return self._layout.fingerprint

    def _connect_lease(self, lease: socket.socket, address: str) -> None:
        """Connect, waiting out a full backlog (EAGAIN: other processes' connections are being
        accepted) for up to `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                lease.connect(address)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _engine_call(self, make: Any, reply_type: type[R]) -> R:
        try:
            return self._call(make(self._registered()), reply_type)
        except ServerError as e:
            if e.code is not ErrorCode.UNKNOWN_INSTANCE or self._layout is None:
                raise
            self.register(self._layout, access=self._access)  # the server restarted: register again, send once more
            return self._call(make(self._registered()), reply_type)

    def _call(self, req: Request, reply_type: type[R], *, timeout_s: float | None = None) -> R:
        reply = self._roundtrip(req, self.timeout_s if timeout_s is None else timeout_s)
        if isinstance(reply, ErrorReply) and reply.code is ErrorCode.UNAUTHORIZED and self._auth_from_file:
            fresh = secret_for_endpoint(self.endpoint)  # a restarted local server wrote a new one
            if fresh and fresh != self._auth:
                self._auth = fresh
                reply = self._roundtrip(req, self.timeout_s if timeout_s is None else timeout_s)
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        if not isinstance(reply, reply_type):
            raise ServerError(ErrorCode.BAD_MESSAGE, f"expected a {reply_type.__name__}, got {type(reply).__name__}")
        return reply

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only on a connection that exists: fail fast without
            self._sock.connect(self.endpoint)
        return self._sock

    def _roundtrip(self, req: Request, timeout_s: float) -> AnyReply:
        req.req_id = next(self._ids)
        req.auth = self._auth
        sock = self._socket()
        if not sock.poll(int(min(self.connect_timeout_s, timeout_s) * 1000), zmq.POLLOUT):
            self._reset(sock)
            raise ServerUnreachable(f"no KV cache server is connected at {self.endpoint} (nothing listens, or it "
                                    f"died; waited {self.connect_timeout_s:g} s)")
        try:
            sock.send(encode(req), zmq.NOBLOCK)
        except zmq.Again:
            self._reset(sock)
            raise ServerUnreachable(f"the KV cache server at {self.endpoint} takes no requests now") from None
        deadline_ms = int(timeout_s * 1000)
        while sock.poll(deadline_ms):
            reply = decode_reply(sock.recv())
            if reply.req_id in (req.req_id, 0):  # 0: an error for a request the server could not read
                return reply
            # else: a late reply to an earlier request that timed out; skip it
        self._reset(sock)
        raise ServerTimeout(f"no reply from {self.endpoint} within {timeout_s:g} s to {type(req).__name__}")

    def _reset(self, sock: zmq.Socket[bytes]) -> None:
        """A fresh socket for the next call (it reaches a restarted server; late replies are dropped)."""
        self._sock = None
        sock.close(linger=0)
