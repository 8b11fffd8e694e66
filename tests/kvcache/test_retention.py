"""Which sliding-window blocks are cached: vLLM 0.32's rule (REACHABLE, retention intervals) and ALL.

The first test is vLLM's `test_hybrid_cache_blocks_swa_tail_window_only`
(tests/v1/core/test_prefix_caching.py) on our API, with vLLM's expected values; the others are
hand-computed from the rule in `hybridkv/kvcache/retention.py`.
"""

from __future__ import annotations

import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import BlockStored, KVEvents
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager, SlidingWindowCaching
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group


def cached_indices(manager: KVCacheManager, request: KVRequest, group_id: int, block_size: int) -> set[int]:
    hashes = request.block_hashes[block_size]
    stored = [h for e in manager.take_events() if isinstance(e, BlockStored) and e.group_id == group_id
              for h in e.block_hashes]
    return {hashes.index(h) for h in stored}


def run_prompt(num_tokens: int, *, full_block: int, swa_block: int, window: int, **options: object
               ) -> tuple[KVCacheManager, KVRequest]:
    groups = [make_group(kind="full", block_size=full_block),
              make_group(kind="sliding_window", block_size=swa_block, window_tokens=window)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=100), max_model_len=8192,
                             options=CacheOptions(events=KVEvents.ON, **options))  # type: ignore[arg-type]
    request = KVRequest(request_id=RequestId("0"), token_ids=list(range(num_tokens)))
    assert manager.allocate(request, num_tokens, hit=manager.lookup(request)) is not None
    return manager, request


def test_vllm_swa_tail_window_only() -> None:
    # vLLM: full block 32, SWA block 8, window 8 -> lcm 32, tail ceil(7/8) = 1 of 4 blocks per segment;
    # a 64-token prompt caches SWA blocks {3, 7} only.
    manager, request = run_prompt(64, full_block=32, swa_block=8, window=8)
    assert len(request.block_hashes[8]) == 8
    assert cached_indices(manager, request, 1, 8) == {3, 7}


def test_all_caches_every_sliding_block() -> None:
    manager, request = run_prompt(64, full_block=32, swa_block=8, window=8,
                                  sliding_window_caching=SlidingWindowCaching.ALL)
    assert cached_indices(manager, request, 1, 8) == set(range(8))


def test_hits_are_the_same_under_both_rules() -> None:
    hits = []
    for rule in SlidingWindowCaching:
        manager, request = run_prompt(64, full_block=32, swa_block=8, window=8, sliding_window_caching=rule)
        request.num_computed_tokens = 64
        manager.free(request)
        again = KVRequest(request_id=RequestId("1"), token_ids=list(range(70)))
        hits.append(manager.lookup(again).num_tokens)
    assert hits == [64, 64]


def test_retention_zero_keeps_only_the_replay_boundary_tail() -> None:
    # one block size (16), window 33 -> need 2; prompt 100: replay boundary 99 -> aligned 96 -> blocks 4, 5
    manager, request = run_prompt(100, full_block=16, swa_block=16, window=33, prefix_cache_retention_interval=0)
    assert cached_indices(manager, request, 1, 16) == {4, 5}


def test_retention_interval_keeps_a_tail_per_segment_and_the_replay_tail() -> None:
    # interval 64 = 4 blocks of 16, need 2: blocks 2, 3 of each segment, plus the replay tail {4, 5}
    manager, request = run_prompt(100, full_block=16, swa_block=16, window=33, prefix_cache_retention_interval=64)
    assert cached_indices(manager, request, 1, 16) == {2, 3, 4, 5}


def test_retention_interval_must_be_a_multiple_of_the_alignment() -> None:
    with pytest.raises(ConfigError, match="prefix_cache_retention_interval 24 must be"):
        run_prompt(10, full_block=16, swa_block=16, window=33, prefix_cache_retention_interval=24)


@pytest.mark.parametrize(("retention", "sibling_hit"), [(None, 64), (0, 0), (32, 64), (48, 0)])
def test_state_checkpoints_under_retention(retention: int | None, sibling_hit: int) -> None:
    # full + Mamba (align, blocks of 16). A's prompt (100 tokens) runs in steps ending at 32, 64 and 96.
    # Dense keeps all three checkpoints; 0 only the one at its replay boundary (99 -> 96); 32 also those
    # ending a 32-token segment (32, 64); 48 those ending a 48-token segment (96 only). A sibling sharing
    # A's first 70 tokens resumes at the last kept one <= 64; a resend of A at 96.
    groups = [make_group(kind="full"), make_group(kind="mamba")]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=64), max_model_len=1024,
        options=CacheOptions(prefix_cache_retention_interval=retention))
    a = KVRequest(request_id=RequestId("a"), token_ids=list(range(1, 101)))
    manager.begin_step()
    hit = manager.lookup(a)
    for end in (32, 64, 96):
        manager.begin_step()
        assert manager.allocate(a, end - a.num_computed_tokens, hit=hit) is not None
        hit = None
        a.num_computed_tokens = end
    manager.free(a)
    manager.begin_step()
    sibling = KVRequest(request_id=RequestId("b"), token_ids=[*range(1, 71), 999])
    assert manager.lookup(sibling).num_tokens == sibling_hit
    resend = KVRequest(request_id=RequestId("c"), token_ids=list(range(1, 101)))
    assert manager.lookup(resend).num_tokens == 96
