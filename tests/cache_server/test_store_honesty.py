"""A store reply says exactly what is kept (issue 25): a store larger than L1 keeps its first chunks
and refuses the rest (never evicting its own prefix), counted per reason; a chunk of null blocks
only is not "stored"; a client that sends a new cache salt every time cannot grow the server."""

from __future__ import annotations

import hybridkv.cache_server.engines as engines_module
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import chunk_hashes
from tests.cache_server.helpers import fake_engine, make_group, running_server

CHUNK = 8
PAGE = 256
GROUPS = [make_group(block=4, page=PAGE)]
OBJECT = 2 * PAGE  # one chunk = 2 blocks of one layer


def test_a_store_larger_than_l1_keeps_its_prefix_and_says_which_chunks() -> None:
    capacity = 5 * OBJECT  # holds 5 of the 12 chunks
    tokens = list(range(12 * CHUNK + 1))
    hashes = chunk_hashes(tokens, CHUNK)
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=capacity)) as server, \
            fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        reply = c.store(first_chunk=0, chunk_hashes=hashes, block_ids=[list(range(1, 25))])
        assert reply.stored == [True] * 5 + [False] * 7
        assert [r.chunk for r in reply.refusals] == list(range(5, 12))
        assert all("L1 cannot place" in r.reason for r in reply.refusals)
        assert server.metric("hybridkv_server_refused_stores_total", object_group="full", reason="l1_full") == 7
        assert server.metric("hybridkv_server_l1_evictions_total") == 0  # it evicted none of its own chunks
        hit = c.lookup(hashes, num_tokens=len(tokens))  # (the old server: every chunk "stored", a hit of 0)
        assert hit.hit_tokens == 5 * CHUNK
        got = c.retrieve(hit.lookup_id, block_ids=[list(range(41, 51))])
        assert got.bytes_copied == 5 * OBJECT
        # a later store may evict those chunks (they are no longer the request's own): LRU as before
        other = chunk_hashes([t + 10_000 for t in tokens[:3 * CHUNK + 1]], CHUNK)
        assert c.store(first_chunk=0, chunk_hashes=other, block_ids=[list(range(60, 66))]).stored == [True] * 3
        assert server.metric("hybridkv_server_l1_evictions_total") == 3


def test_a_chunk_of_null_blocks_only_is_not_stored() -> None:
    tokens = list(range(2 * CHUNK + 1))
    hashes = chunk_hashes(tokens, CHUNK)
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server, \
            fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        reply = c.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[0, 0, 0, 0]])
        assert reply.stored == [False, False]
        assert [(r.chunk, r.object_group) for r in reply.refusals] == [(0, "full"), (1, "full")]
        assert "null block" in reply.refusals[0].reason
        assert server.metric("hybridkv_server_chunks_stored_total") == 0
        assert c.lookup(hashes, num_tokens=len(tokens)).hit_tokens == 0


def test_per_salt_state_is_bounded(monkeypatch: object) -> None:
    monkeypatch.setattr(engines_module, "MAX_NAMESPACES", 16)  # type: ignore[attr-defined]
    tokens = list(range(CHUNK + 1))
    hashes = chunk_hashes(tokens, CHUNK)
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server, \
            fake_engine(GROUPS) as eng, server.client() as c:
        reg = c.register(eng.layout)
        for salt in range(100):
            c.lookup(hashes, num_tokens=len(tokens), cache_salt=f"salt-{salt}")
        engine = server.store._engines.get(reg.instance_id, reg.token, None)
        assert 0 < len(engine.namespaces) <= 16
        c.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[1, 2]], cache_salt="kept")
        for salt in range(40):  # the cache was cleared in between: keys are recomputed, still the same
            c.lookup(hashes, num_tokens=len(tokens), cache_salt=f"again-{salt}")
        assert c.lookup(hashes, num_tokens=len(tokens), cache_salt="kept").hit_tokens == CHUNK
