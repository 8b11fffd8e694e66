"""The registration socket: where an engine hands its KV cache segments to the server.

A Unix domain socket (SOCK_SEQPACKET, so one message is one `RegisterRequest`) in Linux's
abstract namespace, polled by the control loop. The engine sends its layout with one file
descriptor per segment (SCM_RIGHTS; sealed memfds, see shm.py) and gets a `RegisterReply` (its
instance id and secret token) or an `ErrorReply` on the same connection.

    client                                   server
    hello (control channel)           ->     HelloReply(registration_socket="@hybridkv-...")
    connect, RegisterRequest + fds    ->     SO_PEERCRED: the same user (or root), else refused
                                      <-     RegisterReply(instance_id, token, ...)
    ... lookup / store / retrieve on the control channel, each with the token ...
    close (exit, kill -9, crash)      ->     every registration of this connection is dropped

The connection is the lease: nothing needs a heartbeat, and an engine killed with -9 loses its
registration (and the server its mapping of that engine's memory) as soon as the kernel closes
its socket. Connections are capped; every received descriptor is closed after the message (the
mapping keeps the memory); a truncated message or descriptor list is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import secrets
import socket
import struct
from typing import Any

from hybridkv.cache_server.auth import Authenticator
from hybridkv.cache_server.limits import MAX_SEGMENTS_PER_REGISTRATION
from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.cache_server.store import KVStore
from hybridkv.wire import (
    AnyReply,
    ErrorCode,
    ErrorReply,
    ProtocolError,
    RegisterReply,
    RegisterRequest,
    decode_request,
    encode,
)

log = logging.getLogger("hybridkv.cache_server")

MAX_FDS = MAX_SEGMENTS_PER_REGISTRATION  # Linux passes at most 253 descriptors in one message (SCM_MAX_FD)
MAX_REGISTER_BYTES = 1 << 20  # one register message (a layout of hundreds of buffers is tens of KiB)
BACKLOG = 1024  # connections waiting to be accepted
ACCEPT_BATCH = 256  # accepted per poll round
REFUSED_EXTRA = 64  # connections past the limit that are still answered (with LIMIT) before closing
MAX_DRAINED = 1024  # messages read and dropped from a connection being closed (a peer's queue is kernel-bounded)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RegistrationSocket:
    """The listening socket and its connections; the control loop polls `fds()` and calls `ready(fd)`."""

    def __init__(self, store: KVStore, auth: Authenticator, max_message_bytes: int, max_connections: int) -> None:
        self.store = store
        self.auth = auth
        # a layout is kilobytes; the kernel bounds one datagram by the socket buffer anyway
        self.max_message_bytes = min(max_message_bytes, MAX_REGISTER_BYTES)
        self.max_connections = max_connections
        name = f"hybridkv-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind("\0" + name)
        self._listener.listen(BACKLOG)
        self._listener.setblocking(False)
        self.address = "@" + name  # "@": the abstract namespace, as `ss -x` prints it
        # fd -> (connection, owner id, the refusal its first message gets)
        self._conns: dict[int, tuple[socket.socket, int, tuple[ErrorCode, str] | None]] = {}
        self._owners = itertools.count(1)

    def fds(self) -> list[int]:
        return [self._listener.fileno(), *self._conns]

    def ready(self, fd: int) -> None:
        """Accept a connection or handle one message (or a close) on `fd`; never raises."""
        try:
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._conns:
                self._receive(fd)
        except Exception:  # the guard: a bug here must not end the control loop
            log.exception("registration socket: internal error")
            self.store.metrics.internal_errors.inc()
            self._drop(fd)

    def _accept(self) -> None:
        """Accept what waits in the backlog (up to ACCEPT_BATCH), so another user's connections, each
        refused at once, cannot keep it full while the owner's connect waits."""
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid not in (os.geteuid(), 0):  # another user: told at once and closed, so it holds nothing here
            self._refuse_now(conn, ErrorCode.UNAUTHORIZED, f"process {pid} runs as uid {uid}; this server serves "
                             f"its own user (uid {os.geteuid()}) only")
            return
        if len(self._conns) >= self.max_connections + REFUSED_EXTRA:
            close_quietly(conn)  # far over the limit: not even answered
            return
        # a refused connection is answered at its first message (closing it now, with that message unread,
        # would reset it and lose the reply)
        refusal: tuple[ErrorCode, str] | None = None
        if len(self._conns) >= self.max_connections:
            refusal = (ErrorCode.LIMIT, f"{len(self._conns)} registration connections are open, the limit")
        self._conns[conn.fileno()] = (conn, next(self._owners), refusal)

    def _refuse_now(self, conn: socket.socket, code: ErrorCode, message: str) -> None:
        """Answer a connection before it read anything, and close it (see `close_quietly`)."""
        with contextlib.suppress(OSError):
            conn.send(encode(self._error(0, code, message)))
        close_quietly(conn)

    def _receive(self, fd: int) -> None:
        conn, owner, refusal = self._conns[fd]
        try:
            msg, fds, flags, _ = socket.recv_fds(conn, self.max_message_bytes + 1, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(fd)
            return
        try:
            if not msg and not fds:  # the peer closed: its registrations go
                self._drop(fd)
                return
            reply = self._error(0, *refusal) if refusal else self._reply(msg, fds, flags, owner)
        finally:
            for received in fds:
                os.close(received)
        try:
            conn.send(encode(reply))
        except OSError:  # the peer is gone or does not read: its lease ends
            self._drop(fd)
            return
        if refusal:
            self._drop(fd)

    def _reply(self, msg: bytes, fds: list[int], flags: int, owner: int) -> AnyReply:
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
            return self._error(0, ErrorCode.TOO_LARGE, f"a registration passes at most {MAX_FDS} descriptors (one "
                               f"per segment; Linux passes at most 253 in one message), got more")
        if flags & socket.MSG_TRUNC or len(msg) > self.max_message_bytes:
            return self._error(0, ErrorCode.TOO_LARGE, f"registration message over {self.max_message_bytes} bytes")
        try:
            req = decode_request(msg)
        except ProtocolError as e:
            return self._error(e.req_id, e.code, str(e))
        if not isinstance(req, RegisterRequest):
            return self._error(req.req_id, ErrorCode.BAD_MESSAGE, f"the registration socket takes `register` "
                               f"requests only, got {type(req).__name__}")
        if not self.auth.ok(req.auth):
            return self._error(req.req_id, ErrorCode.UNAUTHORIZED, "this server needs its auth secret "
                               "($HYBRIDKV_AUTH_TOKEN or --auth-token-file)")
        self.store.metrics.requests.labels("register").inc()
        try:
            r = self.store.register(req.layout, fds, access=req.access, owner=owner)
        except RequestError as e:
            return self._error(req.req_id, e.code, str(e))
        return RegisterReply(req_id=req.req_id, instance_id=r.instance_id, token=r.token,
                             chunk_tokens=self.store.config.chunk_tokens, object_groups=r.object_groups)

    def _error(self, req_id: int, code: ErrorCode, message: str) -> ErrorReply:
        self.store.metrics.errors.labels(code.value).inc()
        return ErrorReply(req_id=req_id, code=code, message=message)

    def _drop(self, fd: int) -> None:
        entry = self._conns.pop(fd, None)
        if entry is None:
            return
        conn, owner, _ = entry
        close_quietly(conn)
        released = self.store.release_owner(owner)
        if released:
            log.info("registration connection closed: released %d registration(s)", released)

    def close(self) -> None:
        for fd in list(self._conns):
            close_quietly(self._conns.pop(fd)[0])
        self._listener.close()

    def status(self) -> dict[str, Any]:
        return {"registration_socket": self.address, "registration_connections": len(self._conns)}


def close_quietly(conn: socket.socket) -> None:
    """Close a connection so that the peer still reads what was sent to it (a refusal), then EOF.

    Closing a Unix socket with messages unread in its queue (a register request sent just after a
    refusal at accept) resets the peer: its next recv fails with ECONNRESET before the reply queued
    for it. So shut both directions first (the peer's later sends fail with EPIPE, its reads get the
    queued reply and then EOF), read and drop what is queued (recv without a control buffer: the
    kernel closes any passed descriptors), then close. Never blocks: the socket is non-blocking and
    after the shutdown nothing more can arrive."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.shutdown(socket.SHUT_RDWR)
        for _ in range(MAX_DRAINED):
            if not conn.recv(1):
                break
    conn.close()
