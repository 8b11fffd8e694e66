"""Scale-out (issue 25): two `hybridkv server` processes (two nodes) on one Valkey/Redis L2 at the
same time. An engine on the second hits what an engine on the first stored, byte for byte, and a
cache salt still isolates tenants across nodes."""

from __future__ import annotations

import json
import socket
import time
import uuid

import numpy as np
import pytest

from hybridkv.connector.client import KVClient, chunk_hashes
from hybridkv.connector.server_process import ServerProcess
from tests.cache_server.helpers import fake_engine, make_group, server_process

CHUNK = 16
GROUPS = [make_group(block=16, layers=2, page=128), make_group(kind="sliding", block=16, window=17, page=128)]
TOKENS = list(range(4 * CHUNK + 1))


def _drained(server: ServerProcess, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(t.get("write_behind_pending", 0) == 0 for t in json.loads(server.http("/status"))["tiers"]):
            return
        time.sleep(0.02)
    raise AssertionError("the write-behind to Valkey did not drain")


def _ids(base: int, chunks: int = 4) -> list[list[int]]:
    return [[base + c for c in range(chunks)], [base + 20 + c for c in range(chunks)]]


@pytest.mark.slow
def test_two_server_processes_on_one_valkey(redis_url: str) -> None:
    model = f"scale-out-{uuid.uuid4().hex[:8]}"  # keys of this test only, in the session's shared Valkey
    # one cluster: the two nodes name one namespace (else each keeps its own, issue 46)
    args = ("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01", "--l2-valkey", redis_url, "--l2-valkey-namespace",
            model)
    with server_process(*args) as node1, server_process(*args) as node2, \
            fake_engine(GROUPS, seed=3, model=model) as a, fake_engine(GROUPS, seed=None, model=model) as b, \
            KVClient(node1.endpoint) as ca, KVClient(node2.endpoint) as cb:
        ca.register(a.layout)
        cb.register(b.layout)  # another engine process: its memory starts zeroed
        hashes = chunk_hashes(TOKENS, CHUNK)
        assert ca.store(first_chunk=0, chunk_hashes=hashes, block_ids=_ids(1)).stored == [True] * 4
        assert ca.store(first_chunk=0, chunk_hashes=hashes, block_ids=_ids(1), cache_salt="tenant-a").stored \
            == [True] * 4
        _drained(node1)
        hit = cb.lookup(hashes, num_tokens=len(TOKENS))
        assert hit.hit_tokens == 4 * CHUNK  # read through from Valkey on the other node
        got = cb.retrieve(hit.lookup_id, block_ids=_ids(41))
        assert got.retrieved_tokens == 4 * CHUNK
        for layer in range(2):  # full group: every block, byte-exact
            for c in range(4):
                assert np.array_equal(b.page(0, layer, 41 + c), a.page(0, layer, 1 + c))
        assert np.array_equal(b.page(1, 0, 61 + 3), a.page(1, 0, 21 + 3))  # window 17: the last block
        assert np.array_equal(b.page(1, 0, 61), np.zeros_like(b.page(1, 0, 61)))  # not needed: not written
        # salts isolate across nodes: another tenant misses, the same tenant hits
        assert cb.lookup(hashes, num_tokens=len(TOKENS), cache_salt="tenant-b").hit_tokens == 0
        same = cb.lookup(hashes, num_tokens=len(TOKENS), cache_salt="tenant-a")
        assert same.hit_tokens == 4 * CHUNK
        cb.release(same.lookup_id)
        metrics = node2.http("/metrics")
        assert 'hybridkv_server_l2_promotions_total{tier="valkey"}' in metrics


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_item14_a_clear_removes_only_its_own_servers_valkey_keys(redis_url: str) -> None:
    """Two servers on one Valkey, each in its default namespace: a clear on one (POST /cache/clear)
    leaves what the other stored there (it used to delete every server's chunks): the other, restarted
    on its port (its namespace), still hits from Valkey."""
    args = ("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01", "--l2-valkey", redis_url)
    model = f"clear-{uuid.uuid4().hex[:8]}"
    hashes = chunk_hashes(TOKENS, CHUNK)
    port2 = str(_free_port())
    with server_process(*args) as node1, fake_engine(GROUPS, seed=3, model=model) as a, \
            KVClient(node1.endpoint) as ca:
        ca.register(a.layout)
        with server_process(*args, "--port", port2) as node2, KVClient(node2.endpoint) as cb:
            cb.register(a.layout)
            assert cb.store(first_chunk=0, chunk_hashes=hashes, block_ids=_ids(1)).stored == [True] * 4
            _drained(node2)
        assert ca.store(first_chunk=0, chunk_hashes=hashes, block_ids=_ids(1)).stored == [True] * 4
        _drained(node1)
        assert json.loads(node1.http("/cache/clear", method="POST"))["objects_removed"] == 8  # its 8 L1 objects
        assert ca.lookup(hashes, num_tokens=len(TOKENS)).hit_tokens == 0  # its own Valkey keys went too
        with server_process(*args, "--port", port2) as node2, KVClient(node2.endpoint) as cb:
            cb.register(a.layout)
            assert cb.lookup(hashes, num_tokens=len(TOKENS)).hit_tokens == 4 * CHUNK
