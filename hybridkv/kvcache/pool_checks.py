"""The block pool's integrity check (`BlockPool.check_integrity` runs `check_pool`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.ids import NULL, NULL_REF_CNT
from hybridkv.plan.planner import KVCacheGroupSpec

if TYPE_CHECKING:
    from hybridkv.kvcache.eviction import EvictionPolicy
    from hybridkv.kvcache.partial_hits import PartialEntries
    from hybridkv.kvcache.prefix_map import PrefixMap

class PoolView(Protocol):
    """What `check_pool` reads of a `BlockPool` (its own fields, private ones included: the check is the pool's)."""

    eviction: EvictionPolicy
    pmaps: list[PrefixMap]
    _partial: PartialEntries
    _groups: tuple[KVCacheGroupSpec, ...]
    ref_cnt: NDArray[np.int64]
    group_of: NDArray[np.int64]
    slot_of: NDArray[np.int64]
    has_hash: NDArray[np.bool_]

    @property
    def block_hash(self) -> NDArray[np.object_]: ...


def check_pool(pool: PoolView, expected_refs: Mapping[int, int]) -> None:
    """Raise `IntegrityError` with the actual numbers if any pool invariant is broken.

    `expected_refs[block_id]` is how many request tables hold the block (the managers
    count them); every other non-null block must be free.
    """
    free_ids = pool.eviction.ordered()
    if len(free_ids) != pool.eviction.num_free:
        raise IntegrityError(f"free queue holds {len(free_ids)} blocks but num_free says {pool.eviction.num_free}")
    repeated = [i for i, n in Counter(free_ids).items() if n > 1]
    if repeated:
        raise IntegrityError(f"blocks {repeated[:10]} appear twice in the free queue")
    free_set = set(free_ids)
    if NULL in free_set or pool.slot_of[NULL] or pool.has_hash[NULL] or pool.ref_cnt[NULL] != NULL_REF_CNT:
        raise IntegrityError("the null block is in the free queue, carries a hash or lost its ref count")
    groups = pool.group_of.tolist()
    for block, ref_cnt in enumerate(pool.ref_cnt.tolist()[1:], start=1):
        want = expected_refs.get(block, 0)
        if ref_cnt != want:
            raise IntegrityError(f"block {block} has ref_cnt {ref_cnt} but {want} request tables hold it")
        if (ref_cnt == 0) != (block in free_set):
            where = "in" if block in free_set else "not in"
            raise IntegrityError(f"block {block} has ref_cnt {ref_cnt} but is {where} the free queue")
        if ref_cnt and not 0 <= groups[block] < len(pool._groups):
            raise IntegrityError(f"block {block} is held but belongs to no group ({groups[block]})")
    _check_maps(pool)


def _check_maps(pool: PoolView) -> None:
    groups = pool.group_of.tolist()
    hashes = pool.block_hash
    entries = sum(pmap.check(hashes, groups, pool.slot_of) for pmap in pool.pmaps)
    pool._partial.check(pool.has_hash.tolist(), groups)
    hashed = sum(1 for h in hashes if h is not None)
    if hashed != entries:
        raise IntegrityError(f"{hashed} blocks carry a hash but the cache tables hold {entries} entries")
    mirror = np.array([h is not None for h in hashes], np.bool_)
    wrong = np.flatnonzero((mirror != pool.has_hash) | (mirror != (pool.slot_of != 0)))
    if len(wrong):
        raise IntegrityError(f"has_hash or slot_of disagrees with block_hash for blocks {wrong[:10].tolist()}")


class _Carrying(Protocol):
    ref_cnt: NDArray[np.int64]
    group_of: NDArray[np.int64]
    slot_of: NDArray[np.int64]
    _place: list[tuple[PrefixMap, int]]

    def hash_of(self, block: int) -> object: ...


def free_and_carrying(pool: _Carrying, ids: NDArray[np.int64], block_hash: object) -> bool:
    """Whether every one of `ids` is free and carries `block_hash` (`BlockPool.discard`'s test; a state's
    pages, one map and one slot, in a few array operations)."""
    slots = pool.slot_of[ids]
    if np.count_nonzero(pool.ref_cnt[ids]) or np.count_nonzero(slots) != len(ids):
        return False
    pmaps = {id(pool._place[g][0]): pool._place[g][0] for g in set(pool.group_of[ids].tolist())}
    keys = (next(iter(pmaps.values())).key[list(set(slots.tolist()))].tolist() if len(pmaps) == 1
            else [pool.hash_of(b) for b in ids.tolist()])
    return all(key == block_hash for key in keys)
