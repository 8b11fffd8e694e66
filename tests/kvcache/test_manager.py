"""Facade vectors computed by hand: hits across groups, refusal, freeing, errors, events."""

from __future__ import annotations

import struct

import pytest
import xxhash

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvents
from hybridkv.kvcache.hashing import ROOT_TAG
from hybridkv.kvcache.ids import BlockId, GroupId
from hybridkv.kvcache.manager import (
    AllocationError,
    CacheHit,
    CacheTiming,
    KVCacheManager,
    PrefixCaching,
    StaleHitError,
    UnknownRequestError,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import SpecKind
from tests.factories import make_config, make_group, make_request

FULL4 = make_group(kind="full", block_size=4)
SLIDING4 = make_group(kind="sliding", block_size=4, window_tokens=8)


def manager(groups: list[KVCacheGroupSpec], *, num_blocks: int = 64, caching: PrefixCaching = PrefixCaching.ON,
            events: KVEvents = KVEvents.OFF, max_model_len: int = 1024) -> KVCacheManager:
    return KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=max_model_len,
        options=CacheOptions(prefix_caching=caching, events=events))


def prefill(m: KVCacheManager, request: KVRequest) -> CacheHit:
    """Lookup + allocate the whole prompt, then advance the request like an engine would."""
    hit = m.lookup(request)
    assert m.allocate(request, request.num_tokens - hit.num_tokens, hit=hit) is not None
    request.num_computed_tokens = request.num_tokens
    m.check_integrity()
    return hit


def decode(m: KVCacheManager, request: KVRequest, token: int) -> tuple[tuple[int, ...], ...] | None:
    request.token_ids.append(token)
    new = m.allocate(request, 1)
    if new is not None:
        request.num_computed_tokens += 1
    m.check_integrity()
    return new


def test_lru_order_through_the_facade() -> None:
    """A: 5 full blocks + 1 partial (87 tokens), B: 3 blocks; see test_block_pool for the why."""
    m = manager([make_group(kind="full", block_size=16)], num_blocks=11)
    a = make_request(request_id="a", token_ids=range(87))
    b = make_request(request_id="b", token_ids=range(1000, 1048))
    prefill(m, a)
    prefill(m, b)
    assert m.block_ids(a.request_id) == ([1, 2, 3, 4, 5, 6],)
    m.free(a)
    m.free(b)
    m.check_integrity()
    assert m.usage() == 0.0
    c = make_request(request_id="c", token_ids=range(87))
    hit = m.lookup(c)
    assert hit.num_tokens == 80 and hit.blocks == ((1, 2, 3, 4, 5),)
    assert m.allocate(c, 7, hit=hit) == ((6,),)  # the front of the queue: the old partial block


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    m = manager([FULL4])
    prefill(m, make_request(request_id="a", token_ids=range(8)))
    assert m.lookup(make_request(request_id="b", token_ids=range(8))).num_tokens == 4
    assert m.lookup(make_request(request_id="c", token_ids=range(9))).num_tokens == 8
    assert m.lookup(make_request(request_id="d", token_ids=range(3))).num_tokens == 0


def test_full_plus_sliding_window_hit_and_eviction_vector() -> None:
    """Full + sliding (block 4, window 8: 2 contiguous blocks), 10 usable blocks.

    A prefills 16 tokens (g0: blocks 1-4, g1: 5-8), decodes one token: the sliding window
    releases g1 positions 0-1 (blocks 6, 5); new blocks 9 (g0) and 10 (g1). Freeing A, both
    groups interleaved tail first, gives the queue [10, 9, 6, 5, 4, 8, 3, 7, 2, 1] (the
    partial blocks 9, 10 up front). C then takes 10, 9, 6 (g0) and 5, 4, 8 (g1), evicting
    g1's h1, h0, g0's h3 and g1's h3: full can still serve 3 blocks, the sliding window none.
    """
    m = manager([FULL4, SLIDING4], num_blocks=11)
    a = make_request(request_id="a", token_ids=range(16))
    prefill(m, a)
    assert m.block_ids(a.request_id) == ([1, 2, 3, 4], [5, 6, 7, 8])
    assert decode(m, a, 99) == ((9,), (10,))
    assert m.block_ids(a.request_id) == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    assert m.group_usage() == (5, 3)
    m.free(a)
    e = make_request(request_id="e", token_ids=[*range(16), 5])
    hit = m.lookup(e)
    assert hit.num_tokens == 16 and hit.blocks == ((1, 2, 3, 4), (0, 0, 7, 8))
    prefill(m, make_request(request_id="c", token_ids=range(500, 512)))
    d = make_request(request_id="d", token_ids=[*range(16), 5])
    assert m.lookup(d).num_tokens == 0
    stats = m.stats()
    assert stats.lookups == 4 and stats.hit_tokens == 16  # a, e, c, d
    assert stats.group_hit_tokens == (16 + 12, 16 + 0)  # d: full alone 12, sliding at 12: nothing


def test_full_plus_mamba_hit_is_the_last_checkpoint_both_can_serve() -> None:
    m = manager([FULL4, make_group(kind="mamba", block_size=4)])
    a = make_request(request_id="a", token_ids=range(40))
    prefill(m, a)  # the step ends at 40 = a block boundary: checkpoint in mamba entry 9
    assert m.block_ids(a.request_id) == (list(range(1, 11)), [0] * 9 + [11])  # full: 10 blocks, then the state
    m.free(a)
    hit = m.lookup(make_request(request_id="b", token_ids=range(45)))
    assert hit.num_tokens == 40 and hit.blocks == (tuple(range(1, 11)), (0,) * 9 + (11,))
    assert m.lookup(make_request(request_id="c", token_ids=[*range(30), 7, 7])).num_tokens == 0


def test_mamba_state_of_an_unaligned_prefill_is_not_cached() -> None:
    m = manager([FULL4, make_group(kind="mamba", block_size=4)])
    prefill(m, make_request(request_id="a", token_ids=range(42)))
    assert m.lookup(make_request(request_id="b", token_ids=range(45))).num_tokens == 0


def test_chunked_local_hit_counts_finished_chunks_as_computed() -> None:
    chunked = make_group(kind="chunked", block_size=4, chunk_tokens=8)
    m = manager([FULL4, chunked])
    a = make_request(request_id="a", token_ids=range(17))
    prefill(m, a)
    decode(m, a, 3)  # first token of the step is 17: chunk [16, 24) -> entries 0-3 released
    assert m.block_ids(a.request_id)[1][:4] == [0, 0, 0, 0]
    hit = m.lookup(make_request(request_id="b", token_ids=range(17)))
    assert hit.num_tokens == 16 and hit.blocks[1] == (0, 0, 0, 0)


def test_refused_allocation_changes_nothing_and_the_hit_can_be_retried() -> None:
    """5 usable blocks. R1 (9 tokens) leaves h0, h1 cached in blocks 1, 2; A takes 3, 4, 5.
    B (16 tokens) hits 8 tokens (blocks 1, 2) but needs 2 new + 2 touched > 2 free."""
    m = manager([FULL4], num_blocks=6)
    r1 = make_request(request_id="r1", token_ids=[*range(8), 100])
    prefill(m, r1)
    m.free(r1)
    a = make_request(request_id="a", token_ids=range(200, 212))
    prefill(m, a)
    b = make_request(request_id="b", token_ids=[*range(8), *range(300, 308)])
    hit = m.lookup(b)
    assert hit.blocks == ((1, 2),)
    before = (m.usage(), m.group_usage(), m.block_ids(a.request_id), m.stats())
    assert m.allocate(b, 8, hit=hit) is None
    assert (m.usage(), m.group_usage(), m.block_ids(a.request_id), m.stats()) == before
    with pytest.raises(UnknownRequestError, match="request 'b' holds no blocks"):
        m.block_ids(b.request_id)
    m.check_integrity()
    m.free(a)
    assert m.allocate(b, 8, hit=hit) == ((5, 4),)
    assert m.block_ids(b.request_id) == ([1, 2, 5, 4],)
    m.check_integrity()


def test_refused_decode_does_not_release_out_of_window_blocks() -> None:
    """Window 12 keeps ceil(11/4) = 3 blocks: the decode after 16 tokens releases only entry 0
    but needs 2 new blocks, with none free: refused, and entry 0 is still held."""
    m = manager([FULL4, make_group(kind="sliding", block_size=4, window_tokens=12)], num_blocks=9)
    a = make_request(request_id="a", token_ids=range(16))
    prefill(m, a)
    before = (m.block_ids(a.request_id), m.group_usage())
    a.token_ids.append(1)
    assert m.allocate(a, 1) is None
    assert (m.block_ids(a.request_id), m.group_usage()) == before == (([1, 2, 3, 4], [5, 6, 7, 8]), (4, 4))
    m.check_integrity()


def test_decode_that_fits_only_thanks_to_released_blocks_is_granted() -> None:
    m = manager([FULL4, SLIDING4], num_blocks=9)
    a = make_request(request_id="a", token_ids=range(16))
    prefill(m, a)
    a.token_ids.append(1)
    assert m.allocate(a, 1) is not None  # needs 2 new, the window releases 2
    m.check_integrity()


def test_stale_hit_is_rejected() -> None:
    m = manager([FULL4], num_blocks=4)
    prefill(m, r1 := make_request(request_id="r1", token_ids=range(9)))
    m.free(r1)
    b = make_request(request_id="b", token_ids=range(10))
    hit = m.lookup(b)
    assert hit.num_tokens == 8
    prefill(m, make_request(request_id="x", token_ids=range(50, 62)))  # evicts everything
    with pytest.raises(StaleHitError, match="was evicted after lookup"):
        m.allocate(b, 2, hit=hit)


def test_argument_errors_say_what_was_expected() -> None:
    m = manager([FULL4], max_model_len=32)
    a = make_request(request_id="a", token_ids=range(8))
    with pytest.raises(AllocationError, match="token counts must be >= 0"):
        m.allocate(a, -1)
    with pytest.raises(AllocationError, match="at most max_model_len=32"):
        m.allocate(a, 8, num_lookahead_tokens=30)
    a.num_computed_tokens = 4
    with pytest.raises(AllocationError, match="num_computed_tokens=4 but holds no blocks"):
        m.allocate(a, 4)
    a.num_computed_tokens = 0
    prefill(m, a)
    other = make_request(request_id="o", token_ids=range(8))
    hit = m.lookup(other)
    with pytest.raises(AllocationError, match="cache hit of request 'o' passed for 'a'"):
        m.allocate(a, 1, hit=hit)
    with pytest.raises(AllocationError, match="applies only to a new request"):
        m.allocate(make_request(request_id="a", token_ids=range(9), num_computed_tokens=8), 1,
                   hit=CacheHit(request_id=a.request_id, num_tokens=4, blocks=((BlockId(1),),)))
    with pytest.raises(AllocationError, match="it holds slots for 8 tokens"):
        m.cache(a, 9)


def test_delayed_caching_hides_blocks_until_cache_is_called() -> None:
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(13))
    assert m.allocate(a, 5, num_external_tokens=8, caching=CacheTiming.DELAYED) == ((1, 2, 3, 4),)
    probe = make_request(request_id="p", token_ids=range(13))
    assert m.lookup(probe).num_tokens == 0
    m.cache(a, 8)  # the external 8 tokens arrived
    assert m.lookup(probe).num_tokens == 8
    m.cache(a, 13)
    assert m.lookup(probe).num_tokens == 12
    m.check_integrity()


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(6))
    assert m.allocate(a, 6, num_lookahead_tokens=3) == ((1, 2, 3),)
    assert m.lookup(make_request(request_id="p", token_ids=range(12))).num_tokens == 4


def xxh3_chain(token_ids: list[int], block_size: int) -> list[bytes]:
    """Block hashes re-derived from the documented encoding (seed 0), not by BlockHasher."""
    parent = xxhash.xxh3_128_digest(ROOT_TAG + (0).to_bytes(16, "little", signed=True))
    out = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = xxhash.xxh3_128_digest(parent + struct.pack(f"<{block_size}q", *token_ids[start:start + block_size]))
        out.append(parent)
    return out


def test_events_carry_group_kind_window_and_the_exact_hashes() -> None:
    """4 usable blocks. A (5 tokens) stores h0 in g0 (block 1) and g1 (block 3); blocks 2 and 4
    are partial. Freeing A queues [4, 2, 1, 3] (content-free blocks first); B (8 tokens) takes all
    four, evicting A's h0 in both groups: one BlockRemoved per group."""
    m = manager([FULL4, SLIDING4], num_blocks=5, events=KVEvents.ON)
    a = make_request(request_id="a", token_ids=range(5))
    prefill(m, a)
    (h0,) = xxh3_chain(list(range(5)), 4)
    assert m.take_events() == [
        BlockStored(group_id=GroupId(0), kind=SpecKind.FULL, window_tokens=0, block_size=4,
                    block_hashes=(h0,), parent_hash=None, token_ids=(0, 1, 2, 3)),
        BlockStored(group_id=GroupId(1), kind=SpecKind.SLIDING_WINDOW, window_tokens=8, block_size=4,
                    block_hashes=(h0,), parent_hash=None, token_ids=(0, 1, 2, 3)),
    ]
    assert m.take_events() == []
    m.free(a)
    assert m.take_events() == []  # freeing keeps the content cached
    b = make_request(request_id="b", token_ids=range(100, 108))
    prefill(m, b)
    g1, g2 = xxh3_chain(list(range(100, 108)), 4)
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(removed, key=lambda e: e.group_id) == [
        BlockRemoved(group_id=GroupId(0), kind=SpecKind.FULL, window_tokens=0, block_hashes=(h0,)),
        BlockRemoved(group_id=GroupId(1), kind=SpecKind.SLIDING_WINDOW, window_tokens=8, block_hashes=(h0,)),
    ]
    m.free(b)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared()]
    assert (g1, g2) == tuple(b.block_hashes[4])


def test_sliding_window_events_chain_parents_and_split_runs_at_null_blocks() -> None:
    """Window 5, block 2: a step starting at token p keeps entries from (p - 5 + 1) // 2.

    A prefills 6 tokens (h0-h2 stored in both groups), then 4 more in one step from token 6:
    both groups store h3, h4 as one run whose parent is h2. B loads 6 external tokens and
    computes 4: g1 skips entry 0 (null), so its run starts at entry 1 with parent h0."""
    groups = [make_group(kind="full", block_size=2), make_group(kind="sliding", block_size=2, window_tokens=5)]
    m = manager(groups, events=KVEvents.ON)
    tokens = list(range(10))
    h = xxh3_chain(tokens, 2)
    a = make_request(request_id="a", token_ids=tokens[:6])
    prefill(m, a)
    assert [(e.group_id, e.block_hashes, e.parent_hash) for e in m.take_events() if isinstance(e, BlockStored)] == [
        (0, tuple(h[:3]), None), (1, tuple(h[:3]), None)]
    a.token_ids += tokens[6:]
    assert m.allocate(a, 4) is not None
    assert m.block_ids(a.request_id)[1][0] == 0
    assert [(e.group_id, e.block_hashes, e.parent_hash, e.token_ids) for e in m.take_events()] == [
        (0, (h[3], h[4]), h[2], (6, 7, 8, 9)), (1, (h[3], h[4]), h[2], (6, 7, 8, 9))]
    b = make_request(request_id="b", token_ids=[*tokens, 50])
    m2 = manager(groups, events=KVEvents.ON)
    assert m2.allocate(b, 4, num_external_tokens=6) is not None
    assert m2.block_ids(b.request_id)[1][0] == 0
    assert [(e.group_id, e.block_hashes, e.parent_hash, e.token_ids) for e in m2.take_events()] == [
        (0, tuple(h), None, tuple(tokens)), (1, tuple(h[1:]), h[0], tuple(tokens[2:]))]


def test_reset_prefix_cache_waits_for_running_requests() -> None:
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(9))
    prefill(m, a)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.lookup(make_request(request_id="b", token_ids=range(9))).num_tokens == 0


def test_prefix_caching_off_never_hits_and_mamba_holds_one_block() -> None:
    m = manager([FULL4, make_group(kind="mamba", block_size=4)], caching=PrefixCaching.OFF)
    a = make_request(request_id="a", token_ids=range(40))
    prefill(m, a)
    assert m.block_ids(a.request_id)[1] == [11]
    decode(m, a, 1)
    assert len(m.block_ids(a.request_id)[1]) == 1
    m.free(a)
    assert m.lookup(make_request(request_id="b", token_ids=range(40))).num_tokens == 0
    assert m.usage() == 0.0


def test_usage_is_the_fraction_of_usable_blocks_in_use() -> None:
    m = manager([FULL4], num_blocks=11)
    prefill(m, make_request(request_id="a", token_ids=range(10)))
    assert m.usage() == pytest.approx(0.3)
    assert m.group_usage() == (3,)


def test_preemption_frees_everything_and_the_request_restarts_with_a_hit() -> None:
    m = manager([FULL4, SLIDING4])
    a = make_request(request_id="a", token_ids=range(20))
    prefill(m, a)
    for token in range(6):
        decode(m, a, token)
    m.free(a)  # preempted
    a.num_computed_tokens = 0
    hit = prefill(m, a)
    assert hit.num_tokens == 24  # 26 tokens: 6 full blocks, capped at 25 tokens
    m.free(a)
    m.free(a)  # freeing a request that holds nothing is a no-op
    m.check_integrity()
    assert m.usage() == 0.0


# --- adversarial sequences -------------------------------------------------------------------

def test_blocks_cached_for_a_step_that_never_ran_are_uncached_on_free() -> None:
    """A computed 6 tokens (h0 cached). Its next step (tokens 6, 7) is allocated, which caches
    h1 (tokens 4-7), then A is preempted before the step runs: num_computed_tokens is still 6,
    so block 2 never received the KV of tokens 6, 7 and must not stay in the prefix cache.
    A lookup taken in between (same scheduling step) must not be usable either."""
    m = manager([FULL4], events=KVEvents.ON)
    a = make_request(request_id="a", token_ids=range(6))
    prefill(m, a)
    a.token_ids += [6, 7]
    assert m.allocate(a, 2) == ((),)
    h0, h1 = xxh3_chain(list(range(8)), 4)
    m.take_events()
    early = make_request(request_id="early", token_ids=range(9))
    early_hit = m.lookup(early)
    assert early_hit.num_tokens == 8  # visible at once: same-step hits are the engine's business
    m.free(a)  # preempted: num_computed_tokens == 6
    m.check_integrity()
    assert m.take_events() == [BlockRemoved(group_id=GroupId(0), kind=SpecKind.FULL, window_tokens=0,
                                            block_hashes=(h1,))]
    assert m.lookup(make_request(request_id="b", token_ids=range(9))).num_tokens == 4
    with pytest.raises(StaleHitError, match=r"block 2 .* was evicted after lookup"):
        m.allocate(early, 1, hit=early_hit)
    assert h0 == a.block_hashes[4][0]


def test_a_request_preempted_in_its_admission_step_keeps_the_hit_blocks_cached() -> None:
    """B hits A's 8 tokens, allocates 4 more (caching h2) and is preempted before running
    (num_computed_tokens 0): h2 is dropped, A's h0, h1 that B only hit stay cached."""
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(9))
    prefill(m, a)
    m.free(a)
    b = make_request(request_id="b", token_ids=range(13))
    hit = m.lookup(b)
    assert hit.num_tokens == 8
    assert m.allocate(b, 4, hit=hit) is not None
    m.free(b)
    m.check_integrity()
    assert m.lookup(make_request(request_id="c", token_ids=range(13))).num_tokens == 8


def test_finished_request_keeps_everything_it_computed_cached() -> None:
    m = manager([FULL4, make_group(kind="mamba", block_size=4)])
    a = make_request(request_id="a", token_ids=range(12))
    prefill(m, a)  # num_computed_tokens = 12: the Mamba checkpoint after 12 tokens is valid
    m.free(a)
    assert m.lookup(make_request(request_id="b", token_ids=range(13))).num_tokens == 12


def test_mamba_checkpoint_of_a_step_that_never_ran_is_uncached() -> None:
    m = manager([FULL4, make_group(kind="mamba", block_size=4)])
    a = make_request(request_id="a", token_ids=range(12))
    assert m.allocate(a, 8) is not None  # first chunk ends at 8: checkpoint entry 1
    a.num_computed_tokens = 8
    assert m.allocate(a, 4) is not None  # second chunk ends at 12: checkpoint entry 2 ... never runs
    m.free(a)
    assert m.lookup(make_request(request_id="b", token_ids=range(13))).num_tokens == 8


def test_computed_tokens_beyond_the_allocated_slots_are_refused() -> None:
    """An engine that advances num_computed_tokens past the slots it got would make allocate
    cache blocks whose KV was never computed (here tokens 4-7)."""
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(12))
    assert m.allocate(a, 4) is not None
    a.num_computed_tokens = 8
    with pytest.raises(AllocationError, match=r"num_computed_tokens=8 but holds slots for only 4 tokens"):
        m.allocate(a, 4)
    assert m.lookup(make_request(request_id="p", token_ids=range(13))).num_tokens == 4
    m.check_integrity()


def test_stale_hit_after_reset_prefix_cache_is_rejected() -> None:
    m = manager([FULL4])
    a = make_request(request_id="a", token_ids=range(9))
    prefill(m, a)
    m.free(a)
    b = make_request(request_id="b", token_ids=range(9))
    hit = m.lookup(b)
    assert hit.num_tokens == 8
    assert m.reset_prefix_cache() is True
    with pytest.raises(StaleHitError, match=r"block 1 .* was evicted after lookup"):
        m.allocate(b, 1, hit=hit)
    assert m.usage() == 0.0
    m.check_integrity()


def test_a_cache_hit_of_another_manager_is_a_clear_error() -> None:
    full_only = manager([FULL4])
    prefill(full_only, make_request(request_id="x", token_ids=range(9)))
    b = make_request(request_id="b", token_ids=range(9))
    foreign = full_only.lookup(b)
    assert foreign.num_tokens == 8
    two_groups = manager([FULL4, SLIDING4])
    with pytest.raises(AllocationError, match=r"has \[2\] blocks per group; expected \[2, 2\]"):
        two_groups.allocate(b, 1, hit=foreign)
    with pytest.raises(AllocationError, match=r"has \[1\] blocks per group; expected \[2\]"):
        full_only.allocate(b, 1, hit=CacheHit(request_id=b.request_id, num_tokens=8, blocks=((BlockId(1),),)))
    small = manager([FULL4], num_blocks=2)
    with pytest.raises(AllocationError, match="names a block id outside this manager's 2 blocks"):
        small.allocate(b, 1, hit=foreign)
    with pytest.raises(AllocationError, match="cannot have -1 tokens; expected >= 0"):
        CacheHit(request_id=b.request_id, num_tokens=-1, blocks=())


def test_bad_configs_are_config_errors_not_asserts() -> None:
    with pytest.raises(ConfigError, match=r"group 0: block_size must be a positive integer, got 0"):
        make_group(kind="full", block_size=0)
    with pytest.raises(ConfigError, match=r"group 0: block_size must be a positive integer, got -4"):
        make_group(kind="sliding", block_size=-4, window_tokens=8)
    with pytest.raises(ConfigError, match=r"got num_blocks=1; expected >= 2"):
        manager([make_group(kind="full", block_size=4)], num_blocks=1)


def test_huge_num_new_tokens_is_refused_with_the_numbers() -> None:
    m = manager([FULL4, SLIDING4], max_model_len=64)
    a = make_request(request_id="a", token_ids=range(8))
    with pytest.raises(AllocationError, match=r"request 'a' would need 1000008 token slots; expected at most "
                                              r"max_model_len=64"):
        m.allocate(a, 1_000_000, num_external_tokens=8)
    assert m.usage() == 0.0


def test_sliding_window_keeps_the_block_holding_the_first_needed_token() -> None:
    """Window 4, block 2: token 8 attends to tokens 5..8, so tokens 5, 6, 7 must stay cached.
    Token 5 is in entry 2: entries 0, 1 (tokens 0-3) are released, entry 2 is kept."""
    m = manager([make_group(kind="sliding", block_size=2, window_tokens=4)])
    a = make_request(request_id="a", token_ids=range(8))
    prefill(m, a)
    assert m.block_ids(a.request_id) == ([1, 2, 3, 4],)
    decode(m, a, 8)
    assert m.block_ids(a.request_id) == ([0, 0, 3, 4, 5],)
    decode(m, a, 9)  # token 9 attends to 6..9: entry 2 (tokens 4, 5) goes too
    assert m.block_ids(a.request_id) == ([0, 0, 0, 4, 5],)


def test_a_shared_block_leaving_the_window_does_not_count_as_freed() -> None:
    """Window 3, block 2 (1 block kept), 5 usable blocks. A (6 tokens) holds [1, 2, 3]; B hits
    A's last block and adds block 4; A's step from token 6 releases entries 0, 1 and takes 5;
    D takes the two freed blocks. A's step from token 8 releases entry 2 (block 3), which B
    still holds, and needs one new block with none free: refused, nothing changed."""
    m = manager([make_group(kind="sliding", block_size=2, window_tokens=3)], num_blocks=6)
    a = make_request(request_id="a", token_ids=range(6))
    prefill(m, a)
    b = make_request(request_id="b", token_ids=[*range(6), 50])
    assert prefill(m, b).blocks == ((0, 0, 3),)
    assert m.block_ids(b.request_id) == ([0, 0, 3, 4],)
    a.token_ids += [6, 7]
    assert m.allocate(a, 2) == ((5,),)
    a.num_computed_tokens = 8
    assert m.block_ids(a.request_id) == ([0, 0, 3, 5],)
    prefill(m, make_request(request_id="d", token_ids=[70, 71, 72]))
    assert m.usage() == 1.0
    a.token_ids.append(8)
    assert m.allocate(a, 1) is None
    assert m.block_ids(a.request_id) == ([0, 0, 3, 5],) and m.block_ids(b.request_id) == ([0, 0, 3, 4],)
    m.check_integrity()


def test_decode_fast_path_still_releases_at_window_edges_inside_a_block() -> None:
    """Window 6, blocks of 4: a decode step needs work when a block boundary or the window's
    edge is crossed, and nothing otherwise (hand-computed)."""
    m = manager([FULL4, make_group(kind="sliding", block_size=4, window_tokens=6)])
    a = make_request(request_id="a", token_ids=range(9))
    prefill(m, a)
    assert m.block_ids(a.request_id) == ([1, 2, 3], [4, 5, 6])
    assert decode(m, a, 1) == ((), ())  # first token 9: window from 4, entry 0 released
    assert m.block_ids(a.request_id)[1] == [0, 5, 6]
    assert decode(m, a, 2) == ((), ())  # first token 10: window from 5, nothing to do
    assert decode(m, a, 3) == ((), ())  # first token 11: window from 6, nothing to release; block 2 full
    assert decode(m, a, 4) == ((7,), (8,))  # first token 12: a new block in each group
    assert m.block_ids(a.request_id) == ([1, 2, 3, 7], [0, 5, 6, 8])
    assert decode(m, a, 5) == ((), ())  # first token 13: window from 8, entry 1 released
    assert m.block_ids(a.request_id)[1] == [0, 0, 6, 8]
    m.free(a)
    hit = m.lookup(make_request(request_id="b", token_ids=[*range(9), 1, 2, 3, 9]))
    assert hit.num_tokens == 12  # the blocks completed by decode steps were cached
