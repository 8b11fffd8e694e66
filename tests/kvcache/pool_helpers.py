"""One-group forms of the block pool's verbs, and views of its state, for tests.

The pool's verbs take every group at once (one entry per group); these wrap them for the one
group a vector is about, and read the prefix map and the free queue through the public API only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.ids import BlockHash


def allocate(pool: BlockPool, num_blocks: int, group_id: int) -> list[int]:
    """Pop `num_blocks` blocks for `group_id` alone."""
    counts = [0] * pool.num_groups
    counts[group_id] = num_blocks
    blocks = pool.allocate(counts)[group_id]
    return blocks.tolist() if isinstance(blocks, np.ndarray) else list(blocks)


def touch(pool: BlockPool, blocks: Sequence[int], group_id: int) -> None:
    """Take hit blocks of `group_id` alone."""
    tables: list[Sequence[int]] = [[] for _ in range(pool.num_groups)]
    tables[group_id] = blocks
    pool.touch(tables)


def cache_blocks(pool: BlockPool, group_id: int, table: Sequence[int], hashes: Sequence[BlockHash], start: int,
                 end: int, token_ids: Sequence[int]) -> None:
    """Cache the non-null blocks `table[start:end]` of `group_id` under `hashes[start:end]`."""
    pool.cache((group_id,), np.asarray(table, np.int64).reshape(1, -1), hashes, start, end, token_ids)


def cached_map(pool: BlockPool, group_id: int) -> dict[BlockHash, int]:
    """The hash -> block map a lookup of `group_id` sees (the primary copy of each hash)."""
    keys = list({h for h in pool.block_hash.tolist() if h is not None})
    if not keys:
        return {}
    view = pool.groups_view([group_id])
    (blocks,) = view.blocks_at(view.slots(keys))
    return {key: block for key, block in zip(keys, blocks, strict=True) if block}


def free_order(pool: BlockPool) -> list[int]:
    """The free blocks in eviction order (front first): what a copy of the pool pops, in order."""
    probe = copy.deepcopy(pool)
    return allocate(probe, probe.num_free, 0) if probe.num_free else []
