"""Block pool vectors: LRU order, touch, eviction, duplicates, reset, usage, events, integrity."""

from __future__ import annotations

import pytest

from hybridkv.kvcache.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    IntegrityError,
    KVEvents,
)
from hybridkv.kvcache.eviction import LRUPolicy
from hybridkv.kvcache.ids import GroupId
from hybridkv.plan.specs import SpecKind
from tests.factories import make_group
from tests.kvcache.pool_helpers import allocate, cache_blocks, cached_map, free_order, touch


def make_pool(*, num_blocks: int = 11, events: KVEvents = KVEvents.OFF, two_groups: bool = False) -> BlockPool:
    groups = [make_group(kind="full", block_size=4, group_id=0)]
    if two_groups:
        groups.append(make_group(kind="sliding", block_size=4, window_tokens=8, group_id=1))
    return BlockPool(num_blocks=num_blocks, groups=groups, policy_factory=LRUPolicy,
                     events=events)


def hashes(*names: str) -> list[bytes]:
    return [name.encode() for name in names]


def test_lru_order_after_freeing_two_requests() -> None:
    """A holds 1-5 full + 6 partial, B holds 7-9, 10 unused; free A then B, each tail first.

    Cached blocks go to the back in release order (A: 5,4,3,2,1 then B: 9,8,7), so a chain's
    tail is evicted before its head. Block 6 is partial (no hash): it holds nothing reusable,
    so it goes to the front, ahead of the never-used block 10 — evicting it loses nothing.
    vLLM 0.32's free queue also puts hash-less blocks first and gives the same order.
    """
    pool = make_pool()
    a = allocate(pool, 6, 0)
    cache_blocks(pool, 0, a, hashes("a1", "a2", "a3", "a4", "a5"), 0, 5, [])
    b = allocate(pool, 3, 0)
    cache_blocks(pool, 0, b, hashes("b1", "b2", "b3"), 0, 3, [])
    assert a == [1, 2, 3, 4, 5, 6] and b == [7, 8, 9]
    assert free_order(pool) == [10]
    pool.free(a[::-1])
    pool.free(b[::-1])
    assert free_order(pool) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    pool.check_integrity({})


def test_allocation_pops_the_front_and_drops_the_stale_hash() -> None:
    pool = make_pool(num_blocks=4, events=KVEvents.ON)
    blocks = allocate(pool, 3, 0)
    cache_blocks(pool, 0, blocks, hashes("x", "y", "z"), 0, 3, list(range(12)))
    pool.free(blocks[::-1])  # free order: 3, 2, 1
    assert cached_map(pool, 0)[b"z"] == 3
    events = pool.take_events()
    assert events == [BlockStored(group_id=GroupId(0), kind=SpecKind.FULL, window_tokens=0, block_size=4,
                                  block_hashes=(b"x", b"y", b"z"), parent_hash=None, token_ids=tuple(range(12)))]
    evictions = pool.evictions
    (reused,) = allocate(pool, 1, 0)
    assert reused == 3 and pool.block_hash[reused] is None and pool.ref_cnt[reused] == 1
    assert b"z" not in cached_map(pool, 0) and b"x" in cached_map(pool, 0)
    assert pool.evictions == evictions + 1
    assert pool.take_events() == [BlockRemoved(group_id=GroupId(0), kind=SpecKind.FULL, window_tokens=0,
                                               block_hashes=(b"z",))]
    assert pool.take_events() == []
    pool.check_integrity({3: 1})


def test_touch_takes_a_free_block_back_and_raises_its_ref_count() -> None:
    pool = make_pool(num_blocks=5)
    blocks = allocate(pool, 2, 0)
    cache_blocks(pool, 0, blocks, hashes("p", "q"), 0, 2, [])
    pool.free(blocks[::-1])
    assert pool.num_free == 4
    hit = cached_map(pool, 0)[b"p"]
    touch(pool, [hit, pool.null_block], 0)
    assert pool.ref_cnt[hit] == 1 and pool.num_free == 3 and hit not in free_order(pool)
    touch(pool, [hit], 0)  # a second holder: no queue change
    assert pool.ref_cnt[hit] == 2 and pool.num_free == 3
    pool.check_integrity({hit: 2})
    pool.free([hit, hit])
    assert free_order(pool)[-1] == hit  # cached: back of the queue


def cache_same_content_twice(pool: BlockPool) -> tuple[list[int], list[int]]:
    """Two requests compute the same block concurrently: both blocks carry the hash "same"."""
    first = allocate(pool, 1, 0)
    second = allocate(pool, 1, 0)
    cache_blocks(pool, 0, first, hashes("same"), 0, 1, [])
    cache_blocks(pool, 0, second, hashes("same"), 0, 1, [])
    return first, second


def test_identical_content_cached_twice_survives_eviction_of_the_first() -> None:
    pool = make_pool(num_blocks=4)
    first, second = cache_same_content_twice(pool)
    assert cached_map(pool, 0)[b"same"] == first[0]
    assert pool.block_hash[second[0]] == b"same"
    pool.check_integrity({first[0]: 1, second[0]: 1})
    pool.free(first)
    pool.free(second)
    allocate(pool, 1, 0)  # the never-used block 3 (uncached blocks are reused first)
    allocate(pool, 1, 0)  # evicts `first`, the older cached copy
    assert cached_map(pool, 0)[b"same"] == second[0]
    pool.check_integrity({1: 1, 3: 1})


def test_the_null_block_is_never_cached_freed_or_queued() -> None:
    pool = make_pool(num_blocks=3)
    null = pool.null_block
    table = [null, *allocate(pool, 1, 0)]
    cache_blocks(pool, 0, table, hashes("n", "m"), 0, 2, [])
    assert pool.block_hash[null] is None and b"n" not in cached_map(pool, 0)
    pool.free(table[::-1])
    assert 0 not in free_order(pool)
    pool.check_integrity({})


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = make_pool(num_blocks=4, events=KVEvents.ON)
    blocks = allocate(pool, 2, 0)
    cache_blocks(pool, 0, blocks, hashes("a", "b"), 0, 2, list(range(8)))
    assert pool.reset_prefix_cache() is False
    pool.free(blocks[::-1])
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert cached_map(pool, 0) == {} and all(h is None for h in pool.block_hash)
    assert pool.take_events() == [AllBlocksCleared()]
    pool.check_integrity({})


def test_usage_overall_and_per_group() -> None:
    pool = make_pool(num_blocks=11, two_groups=True)
    full = allocate(pool, 3, 0)
    sliding = allocate(pool, 2, 1)
    assert pool.usage() == pytest.approx(5 / 10)
    assert pool.group_usage() == (3, 2)
    pool.free(sliding[::-1])
    assert pool.group_usage() == (3, 0)
    pool.check_integrity(dict.fromkeys(full, 1))


def test_reallocating_a_block_to_another_group_moves_it() -> None:
    pool = make_pool(num_blocks=2, two_groups=True)
    (block,) = allocate(pool, 1, 0)
    cache_blocks(pool, 0, [block], hashes("k"), 0, 1, [])
    pool.free([block])
    (again,) = allocate(pool, 1, 1)
    assert again == block and pool.group_of[block] == 1 and b"k" not in cached_map(pool, 0)
    assert pool.group_usage() == (0, 1)


def test_check_integrity_reports_the_actual_numbers() -> None:
    pool = make_pool(num_blocks=4)
    allocate(pool, 2, 0)
    with pytest.raises(IntegrityError, match="block 1 has ref_cnt 1 but 0 request tables hold it"):
        pool.check_integrity({})
    with pytest.raises(IntegrityError, match="block 2 has ref_cnt 1 but 3 request tables hold it"):
        pool.check_integrity({1: 1, 2: 3})


def test_evicting_the_waiting_copy_keeps_the_primary() -> None:
    pool = make_pool(num_blocks=3)
    first, second = cache_same_content_twice(pool)
    pool.free(second)
    (reused,) = allocate(pool, 1, 0)
    assert reused == second[0] and pool.block_hash[reused] is None
    assert cached_map(pool, 0)[b"same"] == first[0]
    pool.check_integrity({1: 1, 2: 1})


def test_prefix_map_grows_past_its_first_slots_and_keeps_every_entry() -> None:
    """3,000 cached blocks (the map starts with room for 1,024 slots and doubles): every hash still
    maps to its block, eviction frees slots that later caches reuse, and the map's memory follows
    the slots in use, not the pool's blocks."""
    pool = make_pool(num_blocks=6001)
    names = [f"h{i}" for i in range(3000)]
    blocks: list[int] = []
    for start in range(0, 3000, 700):  # bulk caches and one-by-one caches (a chunk of one)
        chunk = allocate(pool, min(700, 3000 - start), 0)
        cache_blocks(pool, 0, chunk, hashes(*names[start : start + len(chunk)]), 0, len(chunk), [])
        blocks += chunk
    extra = allocate(pool, 1, 0)
    cache_blocks(pool, 0, extra, hashes("single"), 0, 1, [])
    seen = cached_map(pool, 0)
    assert len(seen) == 3001
    assert all(seen[name.encode()] == block for name, block in zip(names, blocks, strict=True))
    pool.free(blocks[::-1] + extra)
    pool.check_integrity({})
    fresh = allocate(pool, 6000, 0)  # evicts every cached block
    assert not cached_map(pool, 0)
    cache_blocks(pool, 0, fresh[:3500], hashes(*[f"g{i}" for i in range(3500)]), 0, 3500, [])
    assert len(cached_map(pool, 0)) == 3500
    pool.check_integrity({b: 1 for b in fresh})
    slots = pool.groups_view([0]).slots(hashes("g0", "g3499", "h0"))
    assert 0 < slots.max() < 4096 and slots[2] == 0
