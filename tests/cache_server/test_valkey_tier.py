"""The server with a real Valkey/Redis L2 tier: engines on two servers share one cache
(write-behind from L1, read-through on lookup); Valkey down or restarted: the server keeps
serving from L1 and disk, counts the errors, and uses Valkey again once it is back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np

from hybridkv.cache_server.store import StoreConfig
from hybridkv.cache_server.tiers import DiskTier, ValkeyTier
from hybridkv.connector.client import KVClient, chunk_hashes
from tests.cache_server.helpers import FakeEngine, RunningServer, fake_engine, make_group, running_server
from tests.redis_server import RedisServer

CHUNK = 8
GROUPS = [make_group(block=4, layers=2, page=64), make_group(kind="state", block=8, page=40)]
CONFIG = StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)
RETRY_AFTER_S = 0.2  # after a failure the tier skips the network this long


def tokens(i: int) -> list[int]:
    return [i * 1000 + t for t in range(3 * CHUNK + 1)]


def store(c: KVClient, i: int) -> list[bool]:
    return list(c.store(first_chunk=0, chunk_hashes=chunk_hashes(tokens(i), CHUNK),
                        block_ids=[list(range(1, 7)), list(range(11, 14))]).stored)


def hit_and_check(c: KVClient, eng: FakeEngine, i: int) -> int:
    """Hit tokens of sequence i; a hit is retrieved into blocks 21.. and compared with the stored pages."""
    hit = c.lookup(chunk_hashes(tokens(i), CHUNK), num_tokens=3 * CHUNK + 1)
    if hit.hit_tokens:
        chunks = hit.hit_tokens // CHUNK
        c.retrieve(hit.lookup_id, block_ids=[list(range(21, 21 + 2 * chunks)), list(range(31, 31 + chunks))])
        for layer in range(2):
            for b in range(2 * chunks):
                assert np.array_equal(eng.page(0, layer, 21 + b), eng.page(0, layer, 1 + b))
        assert np.array_equal(eng.page(1, 0, 30 + chunks), eng.page(1, 0, 10 + chunks))
    return hit.hit_tokens


def valkey(url: str, ns: str) -> ValkeyTier:
    return ValkeyTier(url, namespace=ns, timeout_s=1.0, retry_after_s=RETRY_AFTER_S, stats_refresh_s=0)


def test_two_servers_share_one_valkey(redis_url: str) -> None:
    ns = f"srv{uuid.uuid4().hex[:10]}"
    with fake_engine(GROUPS) as eng:
        with running_server(CONFIG, [valkey(redis_url, ns)]) as a, a.client() as c:
            c.register(eng.layout)
            assert store(c, 1) == [True] * 3
            assert a.store.tiers.flush(10.0)
        with running_server(CONFIG, [valkey(redis_url, ns)]) as b, b.client() as c:
            c.register(eng.layout)  # the same layout on another server: its L1 is empty
            assert hit_and_check(c, eng, 1) == 3 * CHUNK
            # read through: 3 full chunks + the last state chunk came from Valkey, nothing else
            assert b.metric("hybridkv_server_l2_promotions_total", tier="valkey") == 4
            assert hit_and_check(c, eng, 1) == 3 * CHUNK  # now from L1
            assert b.metric("hybridkv_server_l2_promotions_total", tier="valkey") == 4


def _metric(server: RunningServer, name: str, tier: str) -> float:
    return server.metric(name, tier=tier)


def test_valkey_down_and_back(redis_server: RedisServer, tmp_path: Path) -> None:
    ns = f"srv{uuid.uuid4().hex[:10]}"
    tiers = [DiskTier(tmp_path / "disk", 1 << 24), valkey(redis_server.url, ns)]
    with fake_engine(GROUPS) as eng, running_server(CONFIG, tiers) as server, server.client() as c:
        c.register(eng.layout)
        assert store(c, 1) == [True] * 3
        assert server.store.tiers.flush(10.0)
        redis_server.stop()
        assert store(c, 2) == [True] * 3  # L1 takes it; the Valkey write fails in the background
        server.store.tiers.flush(10.0)
        assert hit_and_check(c, eng, 1) == 3 * CHUNK  # served from L1
        while server.store.evict_one() is not None:  # L1 emptied: disk must serve, Valkey is down
            pass
        assert hit_and_check(c, eng, 2) == 3 * CHUNK
        assert hit_and_check(c, eng, 3) == 0  # never stored: a miss, not an error
        errors = _metric(server, "hybridkv_server_l2_errors_total", "valkey")
        tier_errors = _metric(server, "hybridkv_server_tier_errors_total", "valkey")
        assert errors >= 1 and tier_errors >= 1
        redis_server.restart()  # empty: nothing was persisted
        time.sleep(2 * RETRY_AFTER_S)  # past the tier's fail-fast window: it reconnects
        assert store(c, 4) == [True] * 3
        assert server.store.tiers.flush(10.0)
        assert hit_and_check(c, eng, 4) == 3 * CHUNK
    # the Valkey copy written after the restart serves a fresh server
    with fake_engine(GROUPS) as eng2, running_server(CONFIG, [valkey(redis_server.url, ns)]) as fresh, \
            fresh.client() as c2:
        c2.register(eng2.layout)  # seeded like the first engine: the same pages
        assert hit_and_check(c2, eng2, 4) == 3 * CHUNK
        assert hit_and_check(c2, eng2, 1) == 0  # written while Valkey was down, or before its restart: gone


def test_cli_flags_disk_and_valkey(redis_url: str, tmp_path: Path) -> None:
    from tests.cache_server.helpers import server_process

    args = ("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01", "--l2-disk", str(tmp_path / "d"), "--l2-valkey",
            redis_url)
    with fake_engine(GROUPS) as eng, server_process(*args) as server, server.client() as c:
        assert "L2: disk, valkey" in server.line
        c.register(eng.layout)
        assert store(c, 7) == [True] * 3
        status = c.status()
        assert [t["name"] for t in status["tiers"]] == ["l1", "disk", "valkey"]
