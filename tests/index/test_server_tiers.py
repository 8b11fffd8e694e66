"""A live KV cache server (auth on) publishes its tiers' chunks (L1: `CPU`, a sized disk tier:
`DISK`); the index, asked with a prompt's token ids, answers the server's own lookup
(`longest_matched`: from either tier), per tenant: a prompt stored under one cache salt is found only
with that salt, never with another or none. The chunk ids the index computes are the connector's
chunk hashes (the server's keys), computed independently."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import valkey

from hybridkv.cache_server.l2 import TierSet
from hybridkv.cache_server.l2_sizing import L2Sizing
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.store import StoreConfig
from hybridkv.cache_server.tier_events import SERVER_TYPE, TierEvents
from hybridkv.cache_server.tiers import L2Tier, ValkeyTier
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.connector.client import chunk_hashes
from hybridkv.index.http import IndexServer, make_routes
from hybridkv.index.seq_hash import token_bytes
from hybridkv.index.service import IndexService
from hybridkv.kv_events.chunk_ids import chunk_hash_chain
from hybridkv.kv_events.wire import KVEventsConfig
from tests.cache_server.helpers import RunningServer, fake_engine, make_group, running_server
from tests.index.test_index_service import TOKEN, post, wait_for
from tests.redis_server import RedisServer

SECRET = "s3cret-" + "y" * 24
CHUNK = 8
VALKEY_PASSWORD = "valkey-" + "p" * 24
VALKEY_NS = "idx"
# full attention, a sliding window of 9 and a state: the server's three hit rules at chunk granularity
GROUPS = [make_group(block=4, page=64), make_group(kind="sliding", block=4, window=9, page=64),
          make_group(kind="state", block=8, page=64)]


def l2_tiers(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[list[L2Tier], L2Sizing]:
    """The tiers behind L1 of each stack: none; a small disk tier the server sizes (~20 chunks: it
    deletes to fit); one that bounds itself (its own LRU evictions, watched); a Valkey with a password
    (watched through keyspace notifications, which the server turns on)."""
    if kind == "valkey":
        redis: RedisServer = request.getfixturevalue("redis_server")
        valkey.Valkey(port=redis.port).config_set("requirepass", VALKEY_PASSWORD)
        url = f"redis://:{VALKEY_PASSWORD}@127.0.0.1:{redis.port}/0"
        return [ValkeyTier(url, namespace=VALKEY_NS, timeout_s=1.0, retry_after_s=0.2)], L2Sizing.OBJECTS
    if kind == "memory":
        return [], L2Sizing.RESUMABLE
    return [DiskTier(tmp_path, 12 << 10)], L2Sizing.RESUMABLE if kind == "disk" else L2Sizing.OBJECTS


@pytest.fixture(params=["memory", "disk", "disk-objects", "valkey"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, RunningServer, Any]]:
    """(the index's URL, a server publishing its tier events registered there, a registered fake engine)
    over each of `l2_tiers`."""
    service = IndexService(probe_every_s=0.2, dead_after_s=5.0)
    index = IndexServer(make_routes(service, token=TOKEN))
    index.start()
    events = TierEvents(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                                       replay_endpoint="tcp://127.0.0.1:*"), CHUNK)
    tiers, sizing = l2_tiers(request.param, tmp_path, request)
    config = StoreConfig(chunk_tokens=CHUNK, l1_bytes=4 << 10, l2_sizing=sizing)  # (~12 chunks of 3 objects)
    with running_server(config, tiers, auth_token=SECRET, events=events) as server, \
            fake_engine(GROUPS) as engine:
        status, body = post(index.url + "/register", {
            "endpoint": events.publisher.endpoint, "replay_endpoint": events.publisher.replay_endpoint,
            "type": SERVER_TYPE, "modelname": "toy", "instance_id": "kv-server", "block_size": CHUNK})
        assert status == 200, body
        yield index.url, server, engine
    events.close()
    index.stop()
    service.close()


def index_hit(url: str, tokens: list[int], salt: str, medium: str = "longest_matched") -> int:
    status, body = post(url + "/query", {"model": "toy", "token_ids": tokens, **({"cache_salt": salt} if salt else {})})
    assert status == 200, body
    return int(body["default"].get("kv-server", {}).get(medium, 0))


def store(client: Any, tokens: list[int], salt: str, first_block: int) -> None:
    hashes = chunk_hashes(tokens, CHUNK)
    n = len(hashes)
    blocks = [[first_block + 2 * j + b for j in range(n) for b in range(2)]] * 2 + [[first_block + j for j in range(n)]]
    client.store(first_chunk=0, chunk_hashes=hashes, block_ids=blocks, cache_salt=salt)


def server_hit(client: Any, tokens: list[int], salt: str) -> int:
    reply = client.lookup(chunk_hashes(tokens, CHUNK), num_tokens=len(tokens), cache_salt=salt)
    if reply.hit_tokens:  # (a hit holds its chunks until released)
        client.release(reply.lookup_id)
    return int(reply.hit_tokens)


def test_the_index_computes_the_connectors_chunk_hashes() -> None:
    rng = random.Random(1)
    tokens = [rng.randrange(1 << 18) for _ in range(1000)]
    assert chunk_hash_chain(token_bytes(tokens), 256) == chunk_hashes(tokens, 256)


def test_a_tenants_chunks_are_found_with_its_salt_only(stack: tuple[str, RunningServer, Any]) -> None:
    url, server, engine = stack
    prompt, other = list(range(100, 125)), list(range(300, 325))  # 3 full chunks and a token each
    with server.client() as c:
        c.register(engine.layout)
        store(c, prompt, "tenant-a", 1)
        store(c, other, "", 40)
        wait_for(lambda: index_hit(url, prompt, "tenant-a", "CPU") == 24)
        wait_for(lambda: index_hit(url, other, "") == 24)
    status, body = post(url + "/query", {"model": "toy", "token_ids": prompt, "cache_salt": "tenant-a"})
    entry = body["default"]["kv-server"]
    assert status == 200 and entry["longest_matched"] == entry["CPU"] == 24 and entry["GPU"] == 0
    published = server.store.tiers.sized or server.store.tiers.watched
    wait_for(lambda: index_hit(url, prompt, "tenant-a", "DISK") == (24 if published else 0))  # (written behind)
    assert index_hit(url, prompt, "tenant-b") == 0 and index_hit(url, prompt, "") == 0
    assert index_hit(url, other, "tenant-a") == 0
    assert post(url + "/query", {"model": "toy", "token_ids": prompt}, token=None)[0] == 401


def test_the_index_answers_the_servers_lookup(stack: tuple[str, RunningServer, Any]) -> None:
    """Random prompts on shared prefixes, stored under two salts into an L1 that evicts: after every
    store, the index's CPU hit equals the server's own lookup for a few prompts (once its events
    arrived)."""
    url, server, engine = stack
    rng = random.Random(0)
    bases = [[rng.randrange(1, 5000) for _ in range(rng.randrange(1, 5) * CHUNK)] for _ in range(4)]
    prompts = [b + [rng.randrange(1, 5000) for _ in range(rng.randrange(0, 3 * CHUNK) + 1)] for b in bases * 3]
    seen_evictions = seen_disk_only = False
    with server.client() as c:
        c.register(engine.layout)
        for step in range(30):
            prompt, salt = rng.choice(prompts), rng.choice(["", "t1"])
            store(c, prompt, salt, 1 + (step % 4) * 30)
            for probe in rng.sample(prompts, 3):
                want = server_hit(c, probe, salt)
                try:
                    wait_for(lambda p=probe, w=want, s=salt: index_hit(url, p, s) == w, timeout_s=5.0)
                except AssertionError:
                    raise AssertionError(f"step {step}: index {index_hit(url, probe, salt)}, server {want}") from None
                seen_disk_only = seen_disk_only or index_hit(url, probe, salt, "CPU") < want
            seen_evictions = seen_evictions or server.metric("hybridkv_server_l1_evictions_total") > 0
    assert seen_evictions  # (the removals were exercised too)
    # with an L2 tier some hits came from it alone (and the tier deleted objects to fit)
    assert seen_disk_only == bool(server.store.tiers.sized or server.store.tiers.watched)


@pytest.mark.parametrize("stack", ["valkey"], indirect=True)
def test_valkeys_own_deletions_reach_the_index(stack: tuple[str, RunningServer, Any],
                                               request: pytest.FixtureRequest) -> None:
    """Valkey drops objects on its own (another client's DEL, an expiry, maxmemory eviction): the
    index learns each from the keyspace notifications, so its hit falls with the server's lookup."""
    url, server, engine = stack
    port = request.getfixturevalue("redis_server").port
    other = valkey.Valkey(port=port, password=VALKEY_PASSWORD)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 5000) for _ in range(3 * CHUNK + 1)] for _ in range(12)]
    with server.client() as c:
        c.register(engine.layout)
        for i, prompt in enumerate(prompts):
            store(c, prompt, "t1" if i % 2 else "", 1 + (i % 4) * 30)
        server.store.tiers.flush(10.0)

        def agree() -> bool:
            return all(index_hit(url, p, "t1" if i % 2 else "") == server_hit(c, p, "t1" if i % 2 else "")
                       for i, p in enumerate(prompts))

        wait_for(agree, timeout_s=10.0)
        before = sum(index_hit(url, p, "t1" if i % 2 else "") for i, p in enumerate(prompts))
        ours = sorted(other.scan_iter(match=f"hybridkv:{VALKEY_NS}:*".encode()))
        assert len(ours) > 20, ours
        other.delete(*ours[0:len(ours):5])  # (del)
        for key in ours[1:len(ours):5]:  # (expired)
            other.pexpire(key, 1)
        used = int(other.info("memory")["used_memory"])
        other.config_set("maxmemory-policy", "allkeys-random")
        other.config_set("maxmemory", str(used + 4096))
        for n in range(300):  # (evicted: a filler that does not fit)
            other.set(f"filler:{n}", b"x" * 200)
        other.config_set("maxmemory", "0")
        assert int(other.info("stats")["evicted_keys"]) > 0
        wait_for(agree, timeout_s=10.0)
        after = sum(index_hit(url, p, "t1" if i % 2 else "") for i, p in enumerate(prompts))
    assert after < before  # (the index saw the deletions)


def test_a_valkey_that_refuses_config_is_not_published(redis_server: RedisServer,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Without CONFIG (renamed away, as managed services do) the notifications cannot be turned on:
    a startup warning says so, and the tier's objects are not published (never a stale DISK hit)."""
    user = valkey.Valkey(port=redis_server.port)
    user.acl_setuser("limited", enabled=True, passwords=["+pw-limited"], keys=["*"], channels=["*"],
                     commands=["+@all", "-config"])
    tier = ValkeyTier(f"redis://limited:pw-limited@127.0.0.1:{redis_server.port}/0", namespace=VALKEY_NS)
    events = TierEvents(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*"),
                        CHUNK)
    try:
        with caplog.at_level(logging.WARNING, logger="hybridkv.cache_server.l2"):
            tiers = TierSet([tier], ServerMetrics(), L2Sizing.OBJECTS, events)
        assert not tiers.watched
        assert any("CONFIG" in r.getMessage() and "not published" in r.getMessage() for r in caplog.records)
        tiers.close(1.0)
    finally:
        events.close()
