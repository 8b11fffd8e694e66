"""Bounds per client (issue 46, items 2-6): integers outside their real range, oversized chunk hashes
and salts, lookups and stores past the per-request cap, replies that would dwarf their request, and
held lookups past a registration's budget: each refused with BAD_REQUEST or LIMIT naming the bound,
nothing stored lost, and no other client kept waiting long."""

from __future__ import annotations

import threading
import time

import pytest

from hybridkv.cache_server import limits
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import KVClient, ServerError, chunk_hashes
from hybridkv.wire import ErrorCode
from tests.cache_server.helpers import fake_engine, make_group, running_server

CHUNK = 8
GROUPS = [make_group(block=4, page=64)]
TOKENS = list(range(3 * CHUNK + 1))
HASHES = chunk_hashes(TOKENS, CHUNK)


def refusal(call: object, code: ErrorCode, text: str) -> str:
    assert callable(call)
    with pytest.raises(ServerError) as info:
        call()
    assert info.value.code is code, str(info.value)
    assert text in str(info.value), str(info.value)
    return str(info.value)


def still_hits(client: KVClient) -> None:
    hit = client.lookup(HASHES, num_tokens=len(TOKENS))
    assert hit.hit_tokens == 3 * CHUNK
    client.release(hit.lookup_id)


@pytest.fixture
def victim():  # type: ignore[no-untyped-def]
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20), max_message_bytes=64 << 20) as server, \
            fake_engine(GROUPS, num_blocks=128) as eng, \
            KVClient(server.endpoint, timeout_s=60, connect_timeout_s=5) as client:
        client.register(eng.layout)
        assert client.store(first_chunk=0, chunk_hashes=HASHES, block_ids=[list(range(1, 7))]).stored == [True] * 3
        yield server, client


@pytest.mark.parametrize(("first_chunk", "chunks"), [(2**32, 1), (2**32 - 1, 2), (2**63 - 1, 1), (2**64 - 1, 1),
                                                     (-1, 1)])
def test_item2_chunk_index_out_of_range_is_bad_request(victim, first_chunk: int, chunks: int) -> None:  # type: ignore[no-untyped-def]
    server, client = victim
    hashes = [bytes([i]) * 16 for i in range(chunks)]
    refusal(lambda: client.store(first_chunk=first_chunk, chunk_hashes=hashes, block_ids=[[1, 2] * chunks]),
            ErrorCode.BAD_REQUEST, "must lie in [0, 2**32)")
    assert server.metric("hybridkv_server_internal_errors_total") == 0
    still_hits(client)


@pytest.mark.parametrize("tokens", [2**62, 2**63 - 1, 2**64 - 1])
def test_item2_token_counts_out_of_range_are_bad_request(victim, tokens: int) -> None:  # type: ignore[no-untyped-def]
    server, client = victim
    refusal(lambda: client.lookup(HASHES, num_tokens=tokens), ErrorCode.BAD_REQUEST, "num_tokens must be in [0, 2**62)")
    hit = client.lookup(HASHES, num_tokens=len(TOKENS))
    refusal(lambda: client.retrieve(hit.lookup_id, block_ids=[list(range(7, 13))], skip_tokens=tokens),
            ErrorCode.BAD_REQUEST, "skip_tokens must be in [0, 2**62)")
    assert server.metric("hybridkv_server_internal_errors_total") == 0


def test_item3_chunk_hashes_of_a_mebibyte_are_refused(victim) -> None:  # type: ignore[no-untyped-def]
    server, client = victim
    huge = [bytes([i]) * (1 << 20) for i in range(16)]
    message = refusal(lambda: client.store(first_chunk=0, chunk_hashes=huge, block_ids=[[1, 2] * 16]),
                      ErrorCode.BAD_REQUEST, "chunk hash 0 has 1048576 bytes, expected at most 64")
    assert message.count("\n") == 0
    refusal(lambda: client.lookup(huge, num_tokens=16 * CHUNK + 1), ErrorCode.BAD_REQUEST, "expected at most 64")
    assert server.store.status()["tiers"][0]["objects"] == 3  # the victim's three chunks, nothing more
    still_hits(client)


def test_item4_salts_are_counted_in_bytes(victim) -> None:  # type: ignore[no-untyped-def]
    _, client = victim
    refusal(lambda: client.lookup(HASHES, num_tokens=len(TOKENS), cache_salt="s" * (1 << 20)), ErrorCode.BAD_REQUEST,
            "cache_salt has 1048576 bytes, expected at most 256")
    refusal(lambda: client.store(first_chunk=0, chunk_hashes=HASHES, block_ids=[list(range(1, 7))],
                                 cache_salt="é" * 129), ErrorCode.BAD_REQUEST, "cache_salt has 258 bytes")
    assert client.lookup(HASHES, num_tokens=len(TOKENS), cache_salt="s" * 256).hit_tokens == 0  # at the bound: fine
    still_hits(client)


def test_item5_one_lookup_is_bounded_and_nobody_waits_long_behind_it(victim) -> None:  # type: ignore[no-untyped-def]
    server, client = victim
    over = [i.to_bytes(16, "little") for i in range(limits.MAX_CHUNKS_PER_REQUEST + 1)]
    refusal(lambda: client.lookup(over, num_tokens=len(over) * CHUNK + 1), ErrorCode.BAD_REQUEST,
            f"{limits.MAX_CHUNKS_PER_REQUEST + 1} chunk hashes, at most {limits.MAX_CHUNKS_PER_REQUEST} per request")
    biggest = over[:-1]
    stop = threading.Event()

    def hog() -> None:
        with KVClient(server.endpoint, timeout_s=60, connect_timeout_s=5) as other, fake_engine(GROUPS, seed=3) as eng:
            other.register(eng.layout)
            while not stop.is_set():
                other.lookup(biggest, num_tokens=len(biggest) * CHUNK + 1)

    thread = threading.Thread(target=hog)
    thread.start()
    waits = []
    try:
        time.sleep(0.2)
        for _ in range(20):
            t0 = time.perf_counter()
            still_hits(client)
            waits.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join(60)
    print(f"worst wait of a 3-chunk lookup behind {len(biggest)}-chunk lookups: {max(waits) * 1e3:.0f} ms")
    assert max(waits) < 1.0


def test_item6_a_store_reply_stays_the_size_of_its_request() -> None:
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=4096), max_message_bytes=64 << 20) as server, \
            fake_engine(GROUPS, num_blocks=128) as eng, \
            KVClient(server.endpoint, timeout_s=60, connect_timeout_s=5) as client:
        client.register(eng.layout)
        n = limits.MAX_CHUNKS_PER_REQUEST
        hashes = [i.to_bytes(16, "little") for i in range(n)]
        reply = client.store(first_chunk=0, chunk_hashes=hashes, block_ids=[[1, 2] * n])
        assert sum(reply.stored) == 4096 // 128  # the L1 holds 32 objects of 2 pages of 64 bytes
        assert len(reply.refusals) == limits.MAX_REFUSALS_REPLIED
        assert reply.refusals_left_out == n - 32 - limits.MAX_REFUSALS_REPLIED
        assert reply.refusals[0].chunk == 32
        over = [i.to_bytes(16, "little") for i in range(10**6)]
        refusal(lambda: client.store(first_chunk=0, chunk_hashes=over, block_ids=[[1, 2] * 10**6]),
                ErrorCode.BAD_REQUEST, "1000000 chunk hashes, at most 16384 per request")


def test_held_lookups_are_capped_per_registration(victim) -> None:  # type: ignore[no-untyped-def]
    server, client = victim
    held = [client.lookup(HASHES, num_tokens=len(TOKENS)).lookup_id
            for _ in range(limits.MAX_HELD_LOOKUPS_PER_REGISTRATION)]
    refusal(lambda: client.lookup(HASHES, num_tokens=len(TOKENS)), ErrorCode.LIMIT,
            f"holds {limits.MAX_HELD_LOOKUPS_PER_REGISTRATION} lookups, the limit per registration")
    client.release(held[0])
    still_hits(client)
    assert server.store.status()["held_lookups"] == limits.MAX_HELD_LOOKUPS_PER_REGISTRATION - 1
