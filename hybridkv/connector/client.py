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

Every call raises `ServerError` (with the server's `ErrorCode`) on an error reply and
`ServerTimeout` when no reply came within `timeout_s`. After a timeout the socket is replaced,
so the next call reaches a restarted server; a call answered UNKNOWN_INSTANCE (the server
restarted and forgot this engine) re-registers the layout once and is sent again. Lookup ids
do not survive a restart: a retrieve of an old lookup fails with UNKNOWN_LOOKUP.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import xxhash
import zmq

from hybridkv.errors import HybridKVError
from hybridkv.wire import (
    AnyReply,
    BufferLayout,
    ClearReply,
    ClearRequest,
    ErrorCode,
    ErrorReply,
    GroupLayout,
    Layout,
    LookupReply,
    LookupRequest,
    ObjectGroupInfo,
    OkReply,
    RegisterReply,
    RegisterRequest,
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
)

__all__ = [
    "BufferLayout", "GroupLayout", "KVClient", "Layout", "LookupReply", "Registration", "RetrieveReply",
    "ServerError", "ServerTimeout", "SharedKVBuffers", "StoreReply", "chunk_hashes",
    "make_layout",
]

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


class SharedKVBuffers:
    """POSIX shared-memory segments an engine (or a test) owns: one per layer slot."""

    def __init__(self, segments: list[shared_memory.SharedMemory]) -> None:
        self._segments = segments
        self.arrays: list[npt.NDArray[np.uint8]] = [np.ndarray((s.size,), dtype=np.uint8, buffer=s.buf)
                                                    for s in segments]

    @classmethod
    def create(cls, *, num_buffers: int, size_bytes: int) -> SharedKVBuffers:
        segments: list[shared_memory.SharedMemory] = []
        try:
            for _ in range(num_buffers):
                segments.append(shared_memory.SharedMemory(create=True, size=size_bytes))
        except BaseException:
            for s in segments:
                s.close()
                s.unlink()
            raise
        return cls(segments)

    def buffer_layouts(self) -> list[BufferLayout]:
        return [BufferLayout(shm_name=s.name.lstrip("/"), size_bytes=s.size) for s in self._segments]

    def close(self) -> None:
        """Unlink every segment and unmap it (the server keeps its own mapping until it unregisters).
        A segment still viewed by an array or tensor elsewhere stays mapped until that view is gone."""
        self.arrays.clear()
        for s in self._segments:
            with contextlib.suppress(BufferError):  # views still alive: the mapping goes with the last one
                s.close()
            with contextlib.suppress(FileNotFoundError):
                s.unlink()
        self._segments.clear()


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
    chunk_tokens: int
    object_groups: list[ObjectGroupInfo]


class KVClient:
    """One engine's connection to the server (a ZeroMQ DEALER; one request in flight at a time,
    not thread-safe: use one client per thread)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._ids = itertools.count(1)
        self._layout: Layout | None = None
        self.registration: Registration | None = None

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | types.TracebackType | None) -> None:
        self.close()

    @property
    def chunk_tokens(self) -> int:
        return self._registered().chunk_tokens

    # ---- verbs ------------------------------------------------------------------------------

    def register(self, layout: Layout) -> Registration:
        reply = self._call(RegisterRequest(req_id=0, layout=layout), RegisterReply)
        self._layout = layout
        self.registration = Registration(instance_id=reply.instance_id, chunk_tokens=reply.chunk_tokens,
                                         object_groups=reply.object_groups)
        return self.registration

    def lookup(self, hashes: Sequence[bytes], *, num_tokens: int, cache_salt: str = "") -> LookupReply:
        """The longest prefix every object group serves (at most num_tokens - 1, in whole chunks); its
        chunks stay held until `retrieve`, `release` or the server's lock TTL."""
        return self._engine_call(lambda r: LookupRequest(
            req_id=0, instance_id=r.instance_id, fingerprint=self._fp(), chunk_hashes=list(hashes),
            num_tokens=num_tokens, cache_salt=cache_salt), LookupReply)

    def store(self, *, first_chunk: int, chunk_hashes: Sequence[bytes], block_ids: Sequence[Sequence[int]],
              cache_salt: str = "") -> StoreReply:
        """Store chunks first_chunk.. (block_ids[g]: group g's blocks of exactly those chunks).
        `reply.stored[i]` is True only when every object group committed chunk first_chunk + i."""
        return self._engine_call(lambda r: StoreRequest(
            req_id=0, instance_id=r.instance_id, fingerprint=self._fp(), first_chunk=first_chunk,
            chunk_hashes=list(chunk_hashes), block_ids=[list(b) for b in block_ids], cache_salt=cache_salt),
            StoreReply)

    def retrieve(self, lookup_id: int, *, block_ids: Sequence[Sequence[int]], num_tokens: int = -1,
                 skip_tokens: int = 0, instance_id: int = -1) -> RetrieveReply:
        """Copy the held hit into the engine's blocks (block_ids[g]: group g's blocks covering the tokens
        retrieved; only the blocks each group needs are written, none that ends at or before
        `skip_tokens`, the engine's own prefix hit). Consumes the lookup. `instance_id`: the registration
        that made the lookup, when another process registered the same layout over the same segments
        (vLLM's scheduler and worker in two processes); -1: this client's."""
        r = self._registered()
        instance_id = instance_id if instance_id >= 0 else r.instance_id
        return self._call(RetrieveRequest(req_id=0, instance_id=instance_id, fingerprint=self._fp(),
                                          lookup_id=lookup_id, block_ids=[list(b) for b in block_ids],
                                          num_tokens=num_tokens, skip_tokens=skip_tokens), RetrieveReply, retry=False)

    def release(self, lookup_id: int) -> None:
        r = self._registered()
        self._call(ReleaseRequest(req_id=0, instance_id=r.instance_id, lookup_id=lookup_id), OkReply, retry=False)

    def unregister(self) -> None:
        r = self._registered()
        self._call(UnregisterRequest(req_id=0, instance_id=r.instance_id), OkReply)
        self.registration = None

    def clear(self) -> int:
        """Drop every object of every tier; the number of L1 objects removed."""
        return self._call(ClearRequest(req_id=0), ClearReply).objects_removed

    def status(self) -> dict[str, Any]:
        return self._call(StatusRequest(req_id=0), StatusReply).status

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.term()

    # ---- transport --------------------------------------------------------------------------

    def _registered(self) -> Registration:
        if self.registration is None:
            raise HybridKVError("register a layout first (KVClient.register)")
        return self.registration

    def _fp(self) -> str:
        assert self._layout is not None  # set with the registration
        return self._layout.fingerprint

    def _engine_call(self, make: Any, reply_type: type[R]) -> R:
        try:
            return self._call(make(self._registered()), reply_type)
        except ServerError as e:
            if e.code is not ErrorCode.UNKNOWN_INSTANCE or self._layout is None:
                raise
            self.register(self._layout)  # the server restarted: register again, then send once more
            return self._call(make(self._registered()), reply_type)

    def _call(self, req: Request, reply_type: type[R], *, retry: bool = True) -> R:
        try:
            reply = self._roundtrip(req)
        except ServerTimeout:
            if not retry:
                raise
            reply = self._roundtrip(req)
        if isinstance(reply, ErrorReply):
            raise ServerError(reply.code, reply.message)
        if not isinstance(reply, reply_type):
            raise ServerError(ErrorCode.BAD_MESSAGE, f"expected a {reply_type.__name__}, got {type(reply).__name__}")
        return reply

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.endpoint)
        return self._sock

    def _roundtrip(self, req: Request) -> AnyReply:
        req.req_id = next(self._ids)
        sock = self._socket()
        sock.send(encode(req))
        deadline_ms = int(self.timeout_s * 1000)
        while sock.poll(deadline_ms):
            reply = decode_reply(sock.recv())
            if reply.req_id in (req.req_id, 0):  # 0: an error for a request the server could not read
                return reply
            # else: a late reply to an earlier request that timed out; skip it
        self._sock = None  # a fresh socket for the next call reaches a restarted server
        sock.close(linger=0)
        raise ServerTimeout(f"no reply from {self.endpoint} within {self.timeout_s} s to {type(req).__name__}")
