"""Coordinator vectors computed by hand: the fixed point over several hit rules, lcm alignment."""

from __future__ import annotations

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.coordinator import HybridCoordinator
from hybridkv.kvcache.eviction import LRUPolicy
from hybridkv.kvcache.type_managers.attention import MambaCacheMode, make_manager
from tests.factories import make_config, make_group
from tests.kvcache.pool_helpers import allocate, cache_blocks


def test_fixed_point_over_full_sliding_and_mamba_with_two_block_sizes() -> None:
    """g0 full (B=2), g1 sliding (B=4, W=5: 1 block), g2 Mamba (B=4); lcm 4. Max length 19 -> 16.

        g0 caches 2-token blocks 0-7 (16 tokens)       -> 16
        g1 caches 4-token blocks 1, 3                  -> at 16: block 3 -> 16
        g2 caches checkpoints 1, 2 (after 8, 12)       -> at 16: 12 (first answer)
        g1 at 12: block 2 missing, block 1 cached      -> 8
        g2 at 8: checkpoint 1                          -> 8: fixed point
    """
    config = make_config(groups=[make_group(kind="full", block_size=2),
                                 make_group(kind="sliding", block_size=4, window_tokens=5),
                                 make_group(kind="mamba", block_size=4)], num_blocks=40)
    pool = BlockPool(num_blocks=40, groups=config.groups, policy_factory=LRUPolicy)
    managers = [make_manager(g, pool, mamba_mode=MambaCacheMode.ALIGN) for g in config.groups]
    coordinator = HybridCoordinator(managers, pool)
    hashes = {2: [f"a{i}".encode() for i in range(9)], 4: [f"b{i}".encode() for i in range(4)]}
    held: dict[tuple[int, int], int] = {}
    for g, size, positions in ((0, 2, range(8)), (1, 4, (1, 3)), (2, 4, (1, 2))):
        for i in positions:
            (block,) = allocate(pool, 1, g)
            cache_blocks(pool, g, [block], [hashes[size][i]], 0, 1, [])
            held[(g, i)] = block
    blocks, length, first = coordinator.find_longest_cache_hit(hashes, 19)
    null = pool.null_block
    assert (length, first) == (8, [16, 16, 12])
    assert blocks == [[held[(0, i)] for i in range(4)], [null, held[(1, 1)]], [null, held[(2, 1)]]]
    assert coordinator.lcm_block_size == 4


def test_hit_is_aligned_to_the_lcm_of_block_sizes() -> None:
    """g0 full B=2 caches 5 blocks (10 tokens), g1 full-like sliding B=3 with W=1 (needs nothing):
    lcm 6, so the hit is 6 tokens, not 10 (g0 keeps 3 blocks, g1 two null blocks)."""
    config = make_config(groups=[make_group(kind="full", block_size=2),
                                 make_group(kind="sliding", block_size=3, window_tokens=1)], num_blocks=16)
    pool = BlockPool(num_blocks=16, groups=config.groups, policy_factory=LRUPolicy)
    managers = [make_manager(g, pool, mamba_mode=MambaCacheMode.ALIGN) for g in config.groups]
    coordinator = HybridCoordinator(managers, pool)
    hashes = {2: [f"a{i}".encode() for i in range(6)], 3: [f"b{i}".encode() for i in range(4)]}
    held = []
    for i in range(5):
        (block,) = allocate(pool, 1, 0)
        cache_blocks(pool, 0, [block], [hashes[2][i]], 0, 1, [])
        held.append(block)
    blocks, length, _ = coordinator.find_longest_cache_hit(hashes, 11)
    assert length == 6
    assert blocks == [held[:3], [pool.null_block] * 2]
