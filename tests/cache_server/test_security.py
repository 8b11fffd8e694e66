"""Hostile local clients against the KV cache server's shared memory and registrations (issue 25):
another client's registration, segments it does not hold, symlinks, shrinking, read-only and
foreign-user descriptors, killed engines, the registration cap, garbage on the registration
socket. Every attack gets a clear error for its sender only; the victim's bytes stay intact."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import KVClient, ServerError, chunk_hashes, make_layout
from hybridkv.connector.segments import SharedKVBuffers, create_segment
from hybridkv.wire import (
    AnyReply,
    ErrorCode,
    ErrorReply,
    Layout,
    LookupRequest,
    RegisterReply,
    RegisterRequest,
    ReleaseRequest,
    RetrieveRequest,
    StoreRequest,
    UnregisterRequest,
    decode_reply,
    encode,
)
from tests.cache_server.helpers import FakeEngine, RunningServer, fake_engine, make_group, running_server

CHUNK = 8
GROUPS = [make_group(block=4, page=64)]
TOKENS = list(range(3 * CHUNK + 1))
HASHES = chunk_hashes(TOKENS, CHUNK)


@contextlib.contextmanager
def victim_and_server(**config: int) -> Iterator[tuple[RunningServer, FakeEngine, KVClient]]:
    """A server holding 3 chunks stored by a victim engine (its blocks 1..6)."""
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20, **config)) as server, \
            fake_engine(GROUPS) as eng, server.client() as client:
        client.register(eng.layout)
        assert client.store(first_chunk=0, chunk_hashes=HASHES, block_ids=[list(range(1, 7))]).stored == [True] * 3
        yield server, eng, client


def register_raw(server: RunningServer, layout: Layout, fds: list[int], *, auth: str = "") -> AnyReply:
    """A register request with these descriptors, sent as a hostile client would (no client library)."""
    with server.client() as c:
        address = c.hello().registration_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect("\0" + address[1:])
        socket.send_fds(sock, [encode(RegisterRequest(req_id=1, auth=auth, layout=layout))], fds)
        return decode_reply(sock.recv(1 << 16))


def refused(reply: AnyReply, code: ErrorCode, text: str) -> bool:
    return isinstance(reply, ErrorReply) and reply.code is code and text in reply.message


def test_another_client_cannot_act_on_a_registration() -> None:
    with victim_and_server() as (server, eng, victim), fake_engine(GROUPS, seed=7) as mine, server.client() as c:
        reg = victim.registration
        assert reg is not None
        c.register(mine.layout)  # the attacker registers an engine of its own (the same layout)
        fp = eng.layout.fingerprint
        for forged in ("", "0" * 32, (c.registration.token if c.registration else "")):
            attacks = [
                LookupRequest(req_id=0, instance_id=reg.instance_id, token=forged, fingerprint=fp,
                              chunk_hashes=HASHES, num_tokens=len(TOKENS)),
                StoreRequest(req_id=0, instance_id=reg.instance_id, token=forged, fingerprint=fp, first_chunk=0,
                             chunk_hashes=[b"\x01" * 16], block_ids=[[1, 2]]),
                RetrieveRequest(req_id=0, instance_id=reg.instance_id, token=forged, fingerprint=fp, lookup_id=1,
                                block_ids=[[1, 2]]),
                UnregisterRequest(req_id=0, instance_id=reg.instance_id, token=forged),
                ReleaseRequest(req_id=0, instance_id=reg.instance_id, token=forged, lookup_id=1),
            ]
            for attack in attacks:
                with pytest.raises(ServerError) as e:
                    c._call(attack, type(None))  # type: ignore[arg-type]
                assert e.value.code is ErrorCode.UNAUTHORIZED, (type(attack).__name__, e.value)
        # the victim's lookup id cannot be guessed, nor retrieved into the attacker's memory
        hit = victim.lookup(HASHES, num_tokens=len(TOKENS))
        assert hit.hit_tokens == 3 * CHUNK and hit.lookup_id > 1 << 20
        for guess in (hit.lookup_id - 1, hit.lookup_id + 1, 1, 2):
            with pytest.raises(ServerError) as e:
                c.retrieve(guess, block_ids=[list(range(11, 17))])
            assert e.value.code is ErrorCode.UNKNOWN_LOOKUP
        # nothing the attacker did reached the victim: still registered, its hit intact
        before = [eng.page(0, 0, b).copy() for b in range(1, 7)]
        got = victim.retrieve(hit.lookup_id, block_ids=[list(range(21, 27))])
        assert got.retrieved_tokens == 3 * CHUNK
        assert all(np.array_equal(eng.page(0, 0, 20 + b), ref) for b, ref in zip(range(1, 7), before, strict=True))
        assert server.metric("hybridkv_server_registered_engines") == 2


def test_segments_are_descriptors_never_names(tmp_path: Path) -> None:
    """The old attacks: naming another engine's /dev/shm segment, or a symlink there to a file elsewhere."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x00" * 4096)
    link = Path("/dev/shm") / f"hybridkv-test-link-{os.getpid()}"
    link.symlink_to(outside)
    try:
        with victim_and_server() as (server, eng, _):
            for name in (eng.layout.buffers[0].shm_name, link.name):  # a name, no descriptor
                layout = Layout(**{**_fields(eng.layout), "buffers": [
                    eng.layout.buffers[0].__class__(shm_name=name, size_bytes=4096)], "num_blocks": 64})
                reply = register_raw(server, layout, [])
                assert refused(reply, ErrorCode.BAD_LAYOUT, "passed 0 file descriptors"), reply
            fd = os.open(link, os.O_RDWR)  # the attacker opens the symlink itself: a regular file, not sealed
            try:
                reply = register_raw(server, _one_segment(eng.layout, 4096), [fd])
            finally:
                os.close(fd)
            assert refused(reply, ErrorCode.BAD_LAYOUT, "not sealed against shrinking"), reply
            assert outside.read_bytes() == b"\x00" * 4096  # never written
            assert server.metric("hybridkv_server_registered_engines") == 1
    finally:
        link.unlink()


def _fields(layout: Layout) -> dict[str, object]:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}


def _one_segment(layout: Layout, size: int) -> Layout:
    buf = layout.buffers[0].__class__(shm_name="seg", size_bytes=size)
    return Layout(**{**_fields(layout), "buffers": [buf], "num_blocks": size // layout.page_stride_bytes})


def test_unsealed_shrinkable_readonly_and_short_segments_are_refused() -> None:
    with victim_and_server() as (server, eng, victim):
        layout = _one_segment(eng.layout, 64 * 64)
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(unsealed, 64 * 64)
        sealed = create_segment("sealed", 64 * 64)
        short = create_segment("short", 64 * 8)
        readonly = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)
        try:
            assert refused(register_raw(server, layout, [unsealed]), ErrorCode.BAD_LAYOUT, "not sealed")
            assert refused(register_raw(server, layout, [short]), ErrorCode.BAD_LAYOUT, "has 512 bytes")
            assert refused(register_raw(server, layout, [readonly]), ErrorCode.BAD_LAYOUT, "read-write")
            sock_a, sock_b = socket.socketpair()
            with sock_a, sock_b:
                assert refused(register_raw(server, layout, [sock_a.fileno()]), ErrorCode.BAD_LAYOUT,
                               "not a regular file")
            reply = register_raw(server, layout, [sealed])  # accepted: and now it cannot shrink (no SIGBUS)
            assert isinstance(reply, RegisterReply)
            with pytest.raises(PermissionError):
                os.ftruncate(sealed, 0)
            assert os.fstat(sealed).st_size == 64 * 64
        finally:
            for fd in (unsealed, sealed, short, readonly):
                os.close(fd)
        # the server is alive and the victim unaffected
        assert victim.lookup(HASHES, num_tokens=len(TOKENS)).hit_tokens == 3 * CHUNK


def test_old_code_sigbus_scenario_the_segment_cannot_shrink_under_the_server() -> None:
    """A client that registered and then tries to shrink its segment (SIGBUS on the old server's next
    store): the seal refuses the shrink; the store then copies every byte."""
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server, fake_engine(GROUPS) as eng, \
            server.client() as c:
        c.register(eng.layout)
        for fd in eng.buffers.fds:
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
        assert c.store(first_chunk=0, chunk_hashes=HASHES, block_ids=[list(range(120, 126))]).stored == [True] * 3


def as_nobody(act: Callable[[], bytes]) -> bytes:
    """What `act` returns, run in a forked child as nobody (uid 65534); b"" when it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setuid(65534)
            os.write(write, act())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return f.read()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_register() -> None:
    """Refused at accept, while its register request (with a descriptor) may already be on the way:
    the refusal must still arrive whole (closing with that request unread used to reset the
    connection, and the child read nothing in about 1 of 5 tries under load)."""
    with victim_and_server() as (server, eng, _):
        with server.client() as c:
            address = c.hello().registration_socket

        def attack() -> bytes:
            fd = create_segment("mine", 64 * 64)
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                sock.connect("\0" + address[1:])
                with contextlib.suppress(OSError):  # refused at connect: the reply is already there
                    socket.send_fds(sock, [encode(RegisterRequest(
                        req_id=1, layout=_one_segment(eng.layout, 4096)))], [fd])
                return sock.recv(1 << 16)

        for _ in range(20):
            reply = decode_reply(as_nobody(attack))
            assert refused(reply, ErrorCode.UNAUTHORIZED, "uid 65534"), reply
        assert server.metric("hybridkv_server_registered_engines") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_another_user_is_told_why_by_the_client() -> None:
    """Through the client library: the refusal's own message, never "broken pipe" or a decode error."""
    with victim_and_server() as (server, _, _):
        def attack() -> bytes:
            buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=64 * 64)
            layout = make_layout(model="toy", groups=GROUPS, buffers=buffers, num_blocks=64, page_stride_bytes=64)
            with KVClient(server.endpoint, auth_token=server.auth_token or "") as client:
                try:
                    client.register(layout)
                except Exception as e:  # told to the parent as text
                    return f"{type(e).__name__}: {e}".encode()
            return b"registered"

        for _ in range(10):
            told = as_nobody(attack).decode()
            assert told.startswith("ServerError: unauthorized: ") and "runs as uid 65534" in told, told
        assert server.metric("hybridkv_server_registered_engines") == 1


ENGINE_SCRIPT = """
import sys, time
from hybridkv.connector.client import KVClient, make_layout
from hybridkv.connector.segments import SharedKVBuffers
from hybridkv.wire import GroupKind, GroupLayout
buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=64 * 64)
group = GroupLayout(kind=GroupKind.FULL, num_layers=1, block_tokens=4, page_bytes=64)
client = KVClient(sys.argv[1])
client.register(make_layout(model="toy", groups=[group], buffers=buffers, num_blocks=64, page_stride_bytes=64))
print("registered", flush=True)
time.sleep(600)
"""


def test_a_killed_engine_is_unregistered_and_unmapped() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server:
        procs = [subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, server.endpoint], stdout=subprocess.PIPE,
                                  text=True) for _ in range(3)]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline().strip() == "registered"
            assert server.metric("hybridkv_server_registered_engines") == 3
            maps_before = _memfd_maps()
            for p in procs:
                p.send_signal(signal.SIGKILL)
                p.wait()
            deadline = time.monotonic() + 10
            while server.metric("hybridkv_server_registered_engines") and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.metric("hybridkv_server_registered_engines") == 0
            assert server.metric("hybridkv_server_leases_released_total") == 3
            assert _memfd_maps() == maps_before - 3  # the server let go of their memory
        finally:
            for p in procs:
                p.kill()
                p.wait()
                if p.stdout is not None:
                    p.stdout.close()


def _memfd_maps() -> int:
    """This process's (the in-process server's) mappings of memfd segments registered by others."""
    return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if "/memfd:hybridkv-" in line
               and f"/memfd:hybridkv-{os.getpid()}-" not in line)


def test_registration_cap_and_garbage_on_the_registration_socket() -> None:
    with victim_and_server(max_registrations=2) as (server, _, victim), fake_engine(GROUPS) as a, \
            fake_engine(GROUPS) as b, server.client() as ca, server.client() as cb:
        ca.register(a.layout)
        with pytest.raises(ServerError) as e:
            cb.register(b.layout)
        assert e.value.code is ErrorCode.LIMIT and "--max-registrations 2" in str(e.value)
        ca.unregister()
        cb.register(b.layout)  # room again
        address = ca.hello().registration_socket
        rng = random.Random(5)
        sealed = create_segment("g", 4096)
        fds_before = len(os.listdir("/proc/self/fd"))
        try:
            for i in range(60):
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                    sock.settimeout(5)
                    sock.connect("\0" + address[1:])
                    frame = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300)))
                    if i % 3 == 0:
                        socket.send_fds(sock, [frame or b"\x00"], [sealed] * rng.randrange(1, 4))
                    elif frame:
                        sock.send(frame)
                    else:
                        continue  # connect and leave
                    reply = decode_reply(sock.recv(1 << 16))
                    assert isinstance(reply, ErrorReply), reply
            deadline = time.monotonic() + 5  # the server sees each close on its next poll
            while len(os.listdir("/proc/self/fd")) != fds_before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(os.listdir("/proc/self/fd")) == fds_before  # every descriptor it received was closed
        finally:
            os.close(sealed)
        assert victim.lookup(HASHES, num_tokens=len(TOKENS)).hit_tokens == 3 * CHUNK
        assert server.metric("hybridkv_server_internal_errors_total") == 0


def test_idle_registration_connections_are_capped() -> None:
    """Connections that register nothing still count: past the cap a client is told `limit`."""
    with victim_and_server(max_registrations=1) as (server, _, victim), fake_engine(GROUPS) as mine, \
            server.client() as c:
        address = c.hello().registration_socket
        idle = []
        try:
            for _ in range(1 + 16 - 1):  # the cap: max_registrations + 16 (the victim holds one)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.connect("\0" + address[1:])
                idle.append(sock)
            time.sleep(0.3)  # the server accepts them
            with pytest.raises(ServerError) as e:
                c.register(mine.layout)
            assert e.value.code is ErrorCode.LIMIT and "registration connections are open" in str(e.value)
        finally:
            for sock in idle:
                sock.close()
        assert victim.lookup(HASHES, num_tokens=len(TOKENS)).hit_tokens == 3 * CHUNK


def test_a_segment_with_holes_is_not_allocated_by_the_registration() -> None:
    """The server maps a segment the engine never touched without allocating it (the kernel's count of
    the memfd's allocated blocks stays 0: gigabytes allocated inside the control loop would hold every
    client for seconds), and one the engine allocated (SharedKVBuffers does) stays fully allocated."""
    size = 256 << 20
    with victim_and_server() as (server, eng, victim):
        layout = _one_segment(eng.layout, size)
        sparse = create_segment("sparse", size)
        try:
            assert isinstance(register_raw(server, layout, [sparse]), RegisterReply)
            assert os.fstat(sparse).st_blocks == 0
        finally:
            os.close(sparse)
        held = SharedKVBuffers.create(num_buffers=1, size_bytes=size)
        try:
            assert os.fstat(held.fds[0]).st_blocks * 512 == size
            assert isinstance(register_raw(server, layout, held.fds), RegisterReply)
        finally:
            held.close()
        assert victim.lookup(HASHES, num_tokens=len(TOKENS)).hit_tokens == 3 * CHUNK
