"""Registrations cannot take the server's descriptors or connections (issue 46, items 7 and 8): the
server keeps no descriptor per mapped segment, a layout over Linux's 253 descriptors per message is
refused saying so, and another user's connections are closed at once, so the owner still registers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from hybridkv.connector.client import KVClient, chunk_hashes
from hybridkv.errors import ConfigError
from tests.cache_server.helpers import FakeEngine, make_engine, make_group, server_process

CHUNK = 16


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def engines(n: int, layers: int) -> Iterator[list[FakeEngine]]:
    made = [make_engine([make_group(block=16, layers=layers, page=64)], num_blocks=8, seed=i) for i in range(n)]
    try:
        yield made
    finally:
        for eng in made:
            eng.close()


def test_item7_registrations_keep_no_descriptor_per_segment() -> None:
    with server_process("--chunk-size", str(CHUNK)) as server, engines(6, 253) as made:
        before = _open_fds(server.proc.pid)
        clients = [KVClient(server.endpoint, timeout_s=30) for _ in made]
        try:
            for client, eng in zip(clients, made, strict=True):
                client.register(eng.layout)
            grown = _open_fds(server.proc.pid) - before
            # one registration connection per client, plus ZeroMQ's own; was 6 * 253 = 1,518 more
            assert grown < 40, f"{grown} descriptors more after 6 registrations of 253 segments"
            tokens = list(range(CHUNK + 1))
            reply = clients[0].store(first_chunk=0, chunk_hashes=chunk_hashes(tokens, CHUNK), block_ids=[[1]])
            assert reply.stored == [True]
            hit = clients[0].lookup(chunk_hashes(tokens, CHUNK), num_tokens=len(tokens))
            made[0].buffers.arrays[252][2 * 64:3 * 64] = 0
            clients[0].retrieve(hit.lookup_id, block_ids=[[2]])
            assert np.array_equal(made[0].buffers.arrays[252][2 * 64:3 * 64], made[0].buffers.arrays[252][64:128])
        finally:
            for client in clients:
                client.close()
        with KVClient(server.endpoint) as other, engines(1, 2) as small:
            other.register(small[0].layout)


def test_item7_a_layout_over_253_segments_is_refused_naming_the_limit() -> None:
    with server_process("--chunk-size", str(CHUNK)) as server, engines(1, 254) as made, \
            KVClient(server.endpoint) as client, \
            pytest.raises(ConfigError, match="254 segments; a registration passes at most 253"):
        client.register(made[0].layout)


HOLD = """
import os, socket, sys, time
os.setgid(65534); os.setuid(65534)
held = []
for _ in range(344):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(chr(0) + sys.argv[1])
    except OSError:
        continue
    held.append(s)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (nobody)")
def test_item8_another_users_idle_connections_do_not_block_the_owner() -> None:
    with server_process("--chunk-size", str(CHUNK)) as server, engines(1, 2) as made:
        with KVClient(server.endpoint) as probe:
            address = probe.hello().registration_socket[1:]
        hog = subprocess.Popen([sys.executable, "-c", HOLD, address], stdout=subprocess.PIPE, text=True)
        try:
            assert hog.stdout is not None and hog.stdout.readline().strip() == "held"
            with KVClient(server.endpoint, timeout_s=10, connect_timeout_s=5) as owner:
                owner.register(made[0].layout)  # was: connection reset (every slot taken)
        finally:
            hog.kill()
            hog.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (nobody)")
def test_item8_another_user_is_told_why() -> None:
    script = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(chr(0) + sys.argv[1]); s.settimeout(5)
print(s.recv(4096))
"""
    with server_process("--chunk-size", str(CHUNK)) as server:
        with KVClient(server.endpoint) as probe:
            address = probe.hello().registration_socket[1:]
        out = subprocess.run([sys.executable, "-c", script, address], capture_output=True, text=True, timeout=30)
        assert "runs as uid 65534" in out.stdout, out.stderr
