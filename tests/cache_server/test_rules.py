"""Store / lookup / retrieve rules over the real control channel, hand-checked through the
metrics and the bytes that land in the engine's buffers (docs/design.md §6)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache_server.store import ObjectGroupMode, StoreConfig
from hybridkv.connector.client import ServerError, chunk_hashes
from hybridkv.wire import ErrorCode
from tests.cache_server.helpers import FakeEngine, RunningServer, fake_engine, make_group, running_server

CHUNK = 8
# full: B=4, 2 layers (2 blocks per chunk); sliding W=17, B=4 (needs 16 tokens = the last 2 chunks);
# short sliding W=5, B=2 (keeps 2 of its 4 blocks per chunk); state: B=8 (1 block per chunk)
GROUPS = [make_group(block=4, layers=2, page=64), make_group(kind="sliding", block=4, window=17, page=64),
          make_group(kind="sliding", block=2, window=5, page=32), make_group(kind="state", block=8, page=48)]
N_CHUNKS = 6


def blocks(engine: FakeEngine, gid: int, chunks: int, base: int) -> list[int]:
    per = CHUNK // engine.layout.groups[gid].block_tokens
    return [base + gid * 32 + i for i in range(chunks * per)]


def store_all(client: object, engine: FakeEngine, hashes: list[bytes], *, salt: str = "",
              null_state_chunk: int | None = None) -> list[bool]:
    ids = [blocks(engine, g, len(hashes), 1) for g in range(len(GROUPS))]
    if null_state_chunk is not None:
        ids[3][null_state_chunk] = 0
    reply = client.store(first_chunk=0, chunk_hashes=hashes, block_ids=ids, cache_salt=salt)  # type: ignore[attr-defined]
    return list(reply.stored)


@pytest.fixture
def server() -> object:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 22)) as s:
        yield s


def test_retrieve_moves_only_what_each_object_group_needs(server: RunningServer) -> None:
    tokens = list(range(100, 100 + N_CHUNKS * CHUNK + 1))
    with fake_engine(GROUPS) as src, fake_engine(GROUPS, seed=None) as dst, server.client() as c1, \
            server.client() as c2:
        c1.register(src.layout)
        reg = c2.register(dst.layout)
        assert [og.name for og in reg.object_groups] == ["full", "window:2", "window:1", "state:g3"]
        hashes = chunk_hashes(tokens, CHUNK)
        assert len(hashes) == N_CHUNKS
        assert store_all(c1, src, hashes) == [True] * N_CHUNKS
        # bytes in: full 6 chunks * 2 blocks * 2 layers * 64; sliding 6 * 2 * 64; short 6 * 2 * 32; state 6 * 48
        assert server.metric("hybridkv_server_bytes_in_total") == 6 * 256 + 6 * 128 + 6 * 64 + 6 * 48
        hit = c2.lookup(hashes, num_tokens=len(tokens))
        assert hit.hit_tokens == N_CHUNKS * CHUNK
        assert hit.object_group_hit_tokens == [48, 48, 48, 48]
        dst_ids = [blocks(dst, g, N_CHUNKS, 2) for g in range(len(GROUPS))]
        got = c2.retrieve(hit.lookup_id, block_ids=dst_ids)
        m = server.metric
        assert m("hybridkv_server_retrieved_chunks_total", object_group="full") == 6
        assert m("hybridkv_server_retrieved_chunks_total", object_group="window:2") == 2  # ceil(16 / 8)
        assert m("hybridkv_server_retrieved_chunks_total", object_group="window:1") == 1
        assert m("hybridkv_server_retrieved_chunks_total", object_group="state:g3") == 1  # only the last
        # full 6 * 256 + sliding 2 chunks * 2 blocks * 64 + short: last 2 blocks * 32 + state 48
        assert got.bytes_copied == 6 * 256 + 256 + 64 + 48 == m("hybridkv_server_bytes_out_total")
        _check_copied(src, dst, dst_ids)


def _check_copied(src: FakeEngine, dst: FakeEngine, dst_ids: list[list[int]]) -> None:
    src_ids = [blocks(src, g, N_CHUNKS, 1) for g in range(len(GROUPS))]
    wanted = {0: range(12), 1: range(8, 12), 2: range(22, 24), 3: range(5, 6)}  # block positions needed
    for gid, g in enumerate(GROUPS):
        for pos, (s, d) in enumerate(zip(src_ids[gid], dst_ids[gid], strict=True)):
            for layer in range(g.num_layers):
                if pos in wanted[gid]:
                    assert np.array_equal(dst.page(gid, layer, d), src.page(gid, layer, s)), (gid, pos, layer)
                else:
                    assert not dst.page(gid, layer, d).any(), f"group {gid} block {pos} was written"


def test_lookup_rules_missing_state_and_last_token(server: RunningServer) -> None:
    tokens = list(range(N_CHUNKS * CHUNK + 1))
    with fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        hashes = chunk_hashes(tokens, CHUNK)
        stored = store_all(c, eng, hashes, null_state_chunk=5)  # the state of chunk 5 is null: skipped
        assert stored == [True] * N_CHUNKS  # skipping a null object is not a refusal
        assert server.metric("hybridkv_server_objects_skipped_total", object_group="state:g3") == 1
        hit = c.lookup(hashes, num_tokens=len(tokens))
        assert hit.hit_tokens == 5 * CHUNK  # the state group serves 5 chunks (its chunk 4), not 6
        assert hit.object_group_hit_tokens == [48, 48, 48, 40]
        c.release(hit.lookup_id)
        # the last token is never counted: 48 tokens -> at most 47 -> 5 whole chunks
        hit = c.lookup(hashes, num_tokens=N_CHUNKS * CHUNK)
        assert hit.object_group_hit_tokens[0] == 40
        c.release(hit.lookup_id)
        # another salt never hits; another prefix hits only where the chain agrees
        assert c.lookup(hashes, num_tokens=len(tokens), cache_salt="tenant-b").hit_tokens == 0
        other = chunk_hashes([*tokens[:16], *[t + 1 for t in tokens[16:]]], CHUNK)
        hit = c.lookup(other, num_tokens=len(tokens))
        assert hit.object_group_hit_tokens == [16, 16, 16, 16] and hit.hit_tokens == 16
        with pytest.raises(ServerError) as e:
            c.retrieve(hit.lookup_id, block_ids=[[0] * 4, [0] * 4, [0] * 8, [0] * 2])
        assert e.value.code is ErrorCode.BAD_REQUEST and "null block" in str(e.value)
        with pytest.raises(ServerError) as e2:  # the failed retrieve consumed the lookup
            c.release(hit.lookup_id)
        assert e2.value.code is ErrorCode.UNKNOWN_LOOKUP


def test_window_gap_and_full_gap() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 22)) as server, fake_engine(GROUPS) as eng, \
            server.client() as c:
        c.register(eng.layout)
        hashes = chunk_hashes(list(range(N_CHUNKS * CHUNK + 1)), CHUNK)
        ids = [blocks(eng, g, N_CHUNKS, 1) for g in range(len(GROUPS))]
        per = [CHUNK // g.block_tokens for g in GROUPS]
        for g in (0, 1, 2, 3):  # chunk 2 of every group missing: store chunks 0, 1 and 3..5 only
            del ids[g][2 * per[g]:3 * per[g]]
        c.store(first_chunk=0, chunk_hashes=hashes[:2], block_ids=[i[:2 * p] for i, p in zip(ids, per, strict=True)])
        c.store(first_chunk=3, chunk_hashes=hashes[3:], block_ids=[i[2 * p:] for i, p in zip(ids, per, strict=True)])
        hit = c.lookup(hashes, num_tokens=N_CHUNKS * CHUNK + 1)
        # full stops at chunk 2; the 2-chunk window serves 6 (needs 4, 5) and 2 (needs 0, 1), not 3..5
        assert hit.object_group_hit_tokens == [16, 48, 48, 48] and hit.hit_tokens == 16


def test_no_separate_object_groups_one_object_per_chunk() -> None:
    config = StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 22, object_groups=ObjectGroupMode.ONE)
    with running_server(config) as server, fake_engine(GROUPS) as eng, server.client() as c:
        reg = c.register(eng.layout)
        assert [og.name for og in reg.object_groups] == ["all"]
        hashes = chunk_hashes(list(range(3 * CHUNK + 1)), CHUNK)
        assert store_all(c, eng, hashes) == [True] * 3
        assert server.metric("hybridkv_server_objects_stored_total", object_group="all") == 3
        assert server.metric("hybridkv_server_bytes_in_total") == 3 * (256 + 128 + 64 + 48)
        hit = c.lookup(hashes, num_tokens=3 * CHUNK + 1)
        assert hit.hit_tokens == 24
        got = c.retrieve(hit.lookup_id, block_ids=[blocks(eng, g, 3, 2) for g in range(len(GROUPS))])
        assert got.bytes_copied == 3 * 256 + 2 * 128 + 64 + 48  # still only what each group needs


def test_a_group_that_is_never_cached_does_not_gate_stores_or_lookups() -> None:
    groups = [make_group(block=4, page=64), make_group(kind="cross", block=4, page=64)]
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 22)) as server, fake_engine(groups) as eng, \
            server.client() as c:
        reg = c.register(eng.layout)
        assert [og.groups for og in reg.object_groups] == [[0]]
        hashes = chunk_hashes(list(range(2 * CHUNK + 1)), CHUNK)
        reply = c.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[1, 2, 3, 4], []])
        assert reply.stored == [True, True] and not reply.refusals
        hit = c.lookup(hashes, num_tokens=2 * CHUNK + 1)
        assert hit.hit_tokens == 2 * CHUNK
        assert c.retrieve(hit.lookup_id, block_ids=[[5, 6, 7, 8], []]).bytes_copied == 4 * 64
