"""The HTTP face (/metrics, /status, POST /cache/clear, /healthz) and L1 under pressure: eviction
by LRU, locked chunks never evicted, a store that cannot be placed refused per chunk."""

from __future__ import annotations

import json
import urllib.error

import pytest

from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import chunk_hashes
from tests.cache_server.helpers import fake_engine, make_group, running_server

CHUNK = 8
GROUPS = [make_group(block=4, page=64)]  # one full group: an object = 2 blocks * 64 = 128 bytes
OBJECT = 128


def seq(i: int, chunks: int = 1) -> list[int]:
    return [i * 10_000 + t for t in range(chunks * CHUNK + 1)]


def test_http_endpoints() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server, fake_engine(GROUPS) as eng, \
            server.client() as c:
        c.register(eng.layout)
        c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(0, 3), CHUNK), block_ids=[list(range(1, 7))])
        assert server.http("/healthz") == "ok"
        metrics = server.http("/metrics")
        assert 'hybridkv_server_objects_stored_total{object_group="full"} 3.0' in metrics
        assert "hybridkv_server_l1_bytes_used 384.0" in metrics
        assert "hybridkv_server_l1_resumable_prefixes 3.0" in metrics  # one full group: every stored chunk ends one
        assert "hybridkv_server_l1_dead_bytes 0.0" in metrics
        status = json.loads(server.http("/status"))
        assert status["chunk_tokens"] == CHUNK and status["object_groups"] == "separate"
        assert status["engines"][0]["object_groups"] == [{"name": "full", "groups": [0]}]
        assert status["tiers"][0] == {"name": "l1", "objects": 3, "bytes_used": 384, "capacity_bytes": 1 << 20,
                                      "evictions": 0, "locked_objects": 0, "resumable_prefixes": 3,
                                      "dead_objects": 0, "dead_bytes": 0, "state_bytes": 0, "attention_bytes": 384}
        assert status["l2_sizing"] == "resumable"  # the default; no L2 tier here to size
        assert 'hybridkv_server_l1_bytes_by_kind{kind="attention"} 384.0' in metrics
        with pytest.raises(urllib.error.HTTPError) as e:
            server.http("/cache/clear")  # GET is not allowed: clearing must be a POST
        assert e.value.code == 405
        assert json.loads(server.http("/cache/clear", method="POST")) == {"objects_removed": 3}
        assert c.lookup(chunk_hashes(seq(0, 3), CHUNK), num_tokens=25).hit_tokens == 0


def test_l1_pressure_evicts_lru_and_never_locked_or_reports_false() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=4 * OBJECT)) as server, fake_engine(GROUPS) as eng, \
            server.client() as c:
        c.register(eng.layout)
        for i in range(4):
            assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(i), CHUNK), block_ids=[[1, 2]]).stored == [True]
        held = c.lookup(chunk_hashes(seq(0), CHUNK), num_tokens=CHUNK + 1)  # touches and locks seq 0
        assert held.hit_tokens == CHUNK
        assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(4), CHUNK), block_ids=[[1, 2]]).stored == [True]
        assert server.metric("hybridkv_server_l1_evictions_total") == 1
        hits = [c.lookup(chunk_hashes(seq(i), CHUNK), num_tokens=CHUNK + 1) for i in range(1, 5)]
        assert [h.hit_tokens for h in hits] == [0, CHUNK, CHUNK, CHUNK]  # seq 1 was least recently used
        # now everything is locked (seq 0 and seqs 2..4): a new store cannot be placed and says so
        reply = c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(5), CHUNK), block_ids=[[1, 2]])
        assert reply.stored == [False]
        assert reply.refusals[0].object_group == "full" and "full of locked objects" in reply.refusals[0].reason
        assert server.metric("hybridkv_server_refused_stores_total", object_group="full", reason="l1_full") == 1
        assert c.lookup(chunk_hashes(seq(5), CHUNK), num_tokens=CHUNK + 1).hit_tokens == 0
        for h in [held, *hits[1:]]:
            c.release(h.lookup_id)
        assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(5), CHUNK), block_ids=[[1, 2]]).stored == [True]
        status = c.status()
        assert status["tiers"][0]["bytes_used"] == 4 * OBJECT and status["tiers"][0]["evictions"] == 2
        server.store.check_integrity()


def test_lock_ttl_expires_and_releases() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=OBJECT, lock_ttl_s=0.2)) as server, \
            fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(0), CHUNK), block_ids=[[1, 2]])
        held = c.lookup(chunk_hashes(seq(0), CHUNK), num_tokens=CHUNK + 1)
        assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(1), CHUNK), block_ids=[[1, 2]]).stored == [False]
        import time

        time.sleep(0.3)
        assert c.store(first_chunk=0, chunk_hashes=chunk_hashes(seq(1), CHUNK), block_ids=[[1, 2]]).stored == [True]
        assert server.metric("hybridkv_server_lock_expired_total") == 1
        with pytest.raises(Exception, match="unknown_lookup"):
            c.retrieve(held.lookup_id, block_ids=[[3, 4]])
