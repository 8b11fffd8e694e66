"""A live KV cache server (auth on) publishes its tiers' chunks (L1: `CPU`, a sized disk tier:
`DISK`); the index, asked with a prompt's token ids, answers the server's own lookup
(`longest_matched`: from either tier), per tenant: a prompt stored under one cache salt is found only
with that salt, never with another or none. The chunk ids the index computes are the connector's
chunk hashes (the server's keys), computed independently."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cache_server.store import StoreConfig
from hybridkv.cache_server.tier_events import SERVER_TYPE, TierEvents
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.connector.client import chunk_hashes
from hybridkv.index.http import AppServer, make_app
from hybridkv.index.seq_hash import token_bytes
from hybridkv.index.service import IndexService
from hybridkv.kv_events.chunk_ids import chunk_hash_chain
from hybridkv.kv_events.wire import KVEventsConfig
from tests.cache_server.helpers import RunningServer, fake_engine, make_group, running_server
from tests.index.test_index_service import TOKEN, post, wait_for

SECRET = "s3cret-" + "y" * 24
CHUNK = 8
# full attention, a sliding window of 9 and a state: the server's three hit rules at chunk granularity
GROUPS = [make_group(block=4, page=64), make_group(kind="sliding", block=4, window=9, page=64),
          make_group(kind="state", block=8, page=64)]


@pytest.fixture(params=["memory", "disk"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, RunningServer, Any]]:
    """(the index's URL, a server publishing its tier events registered there, a registered fake engine);
    "disk": with a small sized disk tier behind L1 (objects L1 lets go stay on disk until it is full)."""
    service = IndexService(probe_every_s=0.2, dead_after_s=5.0)
    index = AppServer(make_app(service, token=TOKEN))
    index.start()
    events = TierEvents(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                                       replay_endpoint="tcp://127.0.0.1:*"), CHUNK)
    config = StoreConfig(chunk_tokens=CHUNK, l1_bytes=4 << 10)  # (~12 chunks of 3 objects: evictions)
    tiers = [DiskTier(tmp_path, 12 << 10)] if request.param == "disk" else []  # (~20 chunks: deletions too)
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
    assert entry["DISK"] == (24 if server.store.tiers.sized else 0)  # (written behind to the disk tier too)
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
    # with a disk tier some hits came from it alone (and the sized tier deleted objects to fit)
    assert seen_disk_only == bool(server.store.tiers.sized)
