"""Per-type manager vectors, computed by hand: hit rules, keep rules, Mamba checkpoints."""

from __future__ import annotations

import random

import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.eviction import LRUPolicy
from hybridkv.kvcache.type_managers.attention import MambaCacheMode, SingleTypeManager, make_manager
from tests.factories import make_group, make_request
from tests.kvcache.pool_helpers import allocate as pool_allocate
from tests.kvcache.pool_helpers import cache_blocks


def setup(*, kind: str, block_size: int = 2, window_tokens: int = 0, chunk_tokens: int = 0,
          mamba_mode: MambaCacheMode = MambaCacheMode.ALIGN,
          num_blocks: int = 64) -> tuple[BlockPool, SingleTypeManager]:
    group = make_group(kind=kind, block_size=block_size, window_tokens=window_tokens, chunk_tokens=chunk_tokens)
    pool = BlockPool(num_blocks=num_blocks, groups=[group], policy_factory=LRUPolicy)
    return pool, make_manager(group, pool, mamba_mode=mamba_mode)


def cache_pattern(pool: BlockPool, pattern: list[bool]) -> tuple[list[bytes], dict[int, int]]:
    """Cache one block under hash i for every True at position i; return hashes and block ids."""
    block_hashes = [f"h{i}".encode() for i in range(len(pattern))]
    cached: dict[int, int] = {}
    for i, is_cached in enumerate(pattern):
        if is_cached:
            (block,) = pool_allocate(pool, 1, 0)
            cache_blocks(pool, 0, [block], [block_hashes[i]], 0, 1, [])
            cached[i] = block
    return block_hashes, cached


T, F = True, False


@pytest.mark.parametrize(("pattern", "expected_blocks"), [
    ([F] * 10, 0),
    ([T], 1),
    ([T, F], 1),
    ([T, T], 2),
    ([T, T, F], 2),
    ([T, T, T], 3),
    ([T, T, F, T, F, F, T, T, F, T, T, T], 12),
    ([T, T, F, T, F, F, T, T, F, F, F], 8),
    ([T, T, F, T, F, F, T, T, F, F, F, T], 8),
])
def test_sliding_window_hit_block2_window4(pattern: list[bool], expected_blocks: int) -> None:
    """Window 4 needs the 3 previous tokens: ceil(3/2) = 2 contiguous cached blocks, scanning
    from the right; a run reaching block 0 is a valid shorter hit."""
    pool, manager = setup(kind="sliding", window_tokens=4)
    block_hashes, cached = cache_pattern(pool, pattern)
    hit = manager.find_longest_cache_hit(block_hashes, len(pattern) * 2)
    assert len(hit) == expected_blocks
    kept = min(2, expected_blocks)
    assert all(b == pool.null_block for b in hit[: expected_blocks - kept])
    for i in range(expected_blocks - kept, expected_blocks):
        assert hit[i] == cached[i]


def test_full_attention_hit_stops_at_the_first_miss_and_respects_max_length() -> None:
    pool, manager = setup(kind="full")
    block_hashes, cached = cache_pattern(pool, [T, T, F, T])
    assert manager.find_longest_cache_hit(block_hashes, 8) == [cached[0], cached[1]]
    assert manager.find_longest_cache_hit(block_hashes, 3) == [cached[0]]  # 3 tokens: 1 full block


@pytest.mark.parametrize(("pattern", "max_length", "expected_blocks", "expected_real"), [
    ([F] * 6, 12, 4, 0),          # chunk 8: blocks 0-3 are a finished chunk -> null; 4 misses
    ([F, F, F, F, T, T], 12, 6, 2),
    ([F, F, F, F, T, F], 12, 5, 1),
    ([T, T, F, F, T, T], 7, 2, 2),  # max 7 tokens: 3 blocks in chunk [0, 8); miss at block 2
])
def test_chunked_local_hit_scans_only_the_current_chunk(pattern: list[bool], max_length: int,
                                                        expected_blocks: int, expected_real: int) -> None:
    pool, manager = setup(kind="chunked", chunk_tokens=8)
    block_hashes, _ = cache_pattern(pool, pattern)
    hit = manager.find_longest_cache_hit(block_hashes, max_length)
    assert len(hit) == expected_blocks
    assert sum(b != pool.null_block for b in hit) == expected_real


def test_chunked_local_rejects_a_chunk_that_is_not_a_multiple_of_the_block() -> None:
    with pytest.raises(ConfigError, match="multiple of the block size 4"):
        setup(kind="chunked", block_size=4, chunk_tokens=6)


def test_mamba_align_hit_is_the_last_cached_checkpoint() -> None:
    pool, manager = setup(kind="mamba")
    block_hashes, cached = cache_pattern(pool, [F, T, F, T, F])
    hit = manager.find_longest_cache_hit(block_hashes, 10)
    assert len(hit) == 4 and hit[3] == cached[3] and hit[:3] == [pool.null_block] * 3
    assert len(manager.find_longest_cache_hit(block_hashes, 7)) == 2  # 3 full blocks: checkpoint 1


def test_mamba_none_and_cross_attention_never_hit() -> None:
    for kind, mode in (("mamba", MambaCacheMode.NONE), ("cross", MambaCacheMode.ALIGN)):
        pool, manager = setup(kind=kind, mamba_mode=mode)
        block_hashes, _ = cache_pattern(pool, [T, T, T])
        assert manager.find_longest_cache_hit(block_hashes, 6) == []


def allocate(pool: BlockPool, manager: SingleTypeManager, request_tokens: int, first_new: int,
             total: int) -> tuple[int, list[int], list[int]]:
    """Drive one step on the manager alone: count, release, (no hits), allocate."""
    request = make_request(request_id="r", token_ids=list(range(request_tokens)))
    need = manager.get_num_blocks_to_allocate(request, None, first_new, total)
    (released,) = manager.remove_skipped_blocks(request.request_id, first_new).tolist()
    pool.free(released)
    manager.save_hits(request, None, first_new)
    (new,) = manager.allocate_new_blocks(request, first_new, total).tolist()
    return need, released, new


def test_sliding_window_releases_blocks_that_fall_out_of_the_window_tail_first() -> None:
    pool, manager = setup(kind="sliding", window_tokens=4)
    need, _, new = allocate(pool, manager, 12, 0, 12)  # prefill 12 tokens: 6 blocks
    assert need == 6 and len(new) == 6
    # Next step starts after 9 computed tokens: skipped = 9 - 4 + 1 = 6 tokens = 3 blocks.
    need, released, new = allocate(pool, manager, 13, 9, 13)
    assert need == 1 - 3  # one new block, three released
    assert released == [3, 2, 1] and len(new) == 1
    table = manager.block_table(make_request().request_id) or []
    assert table[:3] == [pool.null_block] * 3 and len(table) == 7


def test_chunked_local_releases_finished_chunks() -> None:
    pool, manager = setup(kind="chunked", chunk_tokens=4)
    allocate(pool, manager, 10, 0, 10)  # 5 blocks
    _, released, _ = allocate(pool, manager, 11, 9, 11)  # chunk of token 9 starts at 8: blocks 0-3 done
    assert released == [4, 3, 2, 1]


def test_mamba_align_keeps_the_last_checkpoint_and_the_running_state() -> None:
    pool, manager = setup(kind="mamba", block_size=4)
    need, _, new = allocate(pool, manager, 8, 0, 8)  # prefill 8: only the write entry is real
    assert need == 1 and new == [0, 1]
    need, released, new = allocate(pool, manager, 9, 8, 9)  # reads entry 1, writes entry 2
    assert need == 1 and released == [] and new == [2]
    need, released, new = allocate(pool, manager, 10, 9, 10)  # in place in entry 2; entry 1 freed
    assert need == -1 and released == [1] and new == []
    table = manager.block_table(make_request().request_id) or []
    assert table == [0, 0, 2]


def test_mamba_none_mode_holds_one_block() -> None:
    pool, manager = setup(kind="mamba", mamba_mode=MambaCacheMode.NONE)
    need, _, new = allocate(pool, manager, 20, 0, 20)
    assert need == 1 and len(new) == 1
    need, _, new = allocate(pool, manager, 21, 20, 21)
    assert need == 0 and new == []


def test_identical_sliding_groups_hit_only_where_every_group_holds_the_window() -> None:
    """Two groups with one rule are scanned together (window 4, block 2: 2 contiguous blocks).
    Group A caches blocks 0-5, group B lacks block 4: from the right, blocks 5 and 4 fail in B,
    blocks 3, 2 hold in both: the hit is 4 blocks, with A's and B's own blocks at 2 and 3."""
    groups = [make_group(kind="sliding", block_size=2, window_tokens=4, group_id=g) for g in (0, 1)]
    pool = BlockPool(num_blocks=32, groups=groups, policy_factory=LRUPolicy)
    lead = make_manager(groups[0], pool, mamba_mode=MambaCacheMode.ALIGN)
    block_hashes = [f"h{i}".encode() for i in range(6)]
    held: dict[tuple[int, int], int] = {}
    for g, positions in ((0, range(6)), (1, (0, 1, 2, 3, 5))):
        for i in positions:
            (block,) = pool_allocate(pool, 1, g)
            cache_blocks(pool, g, [block], [block_hashes[i]], 0, 1, [])
            held[(g, i)] = block
    hits = lead.find_hits(pool.groups_view((0, 1)), block_hashes, 12)
    null = pool.null_block
    assert hits == [[null, null, held[(0, 2)], held[(0, 3)]], [null, null, held[(1, 2)], held[(1, 3)]]]
    assert len(lead.find_longest_cache_hit(block_hashes, 12)) == 6  # group A alone: the whole prompt


def brute_force_window_hit(held: list[list[bool]], need: int, limit: int) -> tuple[int, int]:
    """(start, blocks) of the sliding-window hit within the first `limit` positions, by the rule
    itself: the largest end e <= limit whose `need` positions before it every group holds; else the
    held prefix from position 0 (a hit shorter than the window)."""
    every = [all(group[i] for group in held) for i in range(limit)]
    for end in range(limit, need - 1, -1):
        if all(every[end - need : end]):
            return end - need, end
    prefix = next((i for i, ok in enumerate(every) if not ok), limit)
    return 0, prefix


@pytest.mark.parametrize("layout", ["together", "apart"])
def test_sliding_window_hits_equal_the_rule_on_random_patterns(layout: str) -> None:
    """Window 6, blocks of 2: 3 contiguous blocks. Two groups of one rule, adjacent in the prefix map
    or with a full-attention group between them; random holes per group and every max_length
    (below, at and above the window; the last window held or not)."""
    kinds = ["sliding", "sliding", "full"] if layout == "together" else ["sliding", "full", "sliding"]
    groups = [make_group(kind=k, block_size=2, window_tokens=6 if k == "sliding" else 0, group_id=g)
              for g, k in enumerate(kinds)]
    sliding = [g for g, k in enumerate(kinds) if k == "sliding"]
    rng = random.Random(7)
    for trial in range(40):
        pool = BlockPool(num_blocks=256, groups=groups, policy_factory=LRUPolicy)
        manager = make_manager([groups[g] for g in sliding], pool, mamba_mode=MambaCacheMode.ALIGN)
        n = rng.randint(1, 14)
        block_hashes = [f"t{trial}-{i}".encode() for i in range(n)]
        density = rng.choice([0.5, 0.8, 1.0])
        held = [[rng.random() < density for _ in range(n)] for _ in sliding]
        blocks: dict[tuple[int, int], int] = {}
        for row, g in enumerate(sliding):
            for i in range(n):
                if held[row][i]:
                    (block,) = pool_allocate(pool, 1, g)
                    cache_blocks(pool, g, [block], [block_hashes[i]], 0, 1, [])
                    blocks[(row, i)] = block
        for limit in range(n + 1):
            start, end = brute_force_window_hit(held, 3, limit)
            expected = [[pool.null_block] * start + [blocks[(row, i)] for i in range(start, end)]
                        for row in range(len(sliding))]
            assert manager.find_hits(manager.view, block_hashes, limit * 2 + 1) == expected, (trial, limit, held)
