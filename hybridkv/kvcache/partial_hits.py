"""Partial (sub-block) prefix hits: `prefix_match_unit` below a state group's block in align mode.

What the rest of the package needs of them, in one place (docs/prefix_caching.md has the rules):

- `PartialEntries`, the block pool's record of which blocks hold a partial entry (a key for a
  prefix ending inside the block) and which of those hold it as an *extra* key, beside the hash
  the block already carries (an attention block filled by decoding after its prompt registered
  its last unit boundary there);
- `PartialIndex`, the block pool's component holding them and the verbs on them (`pool.partial`:
  they read and write the pool's prefix maps);

`KVCacheCoordinator.enable_partial_hits` turns them on in a coordinator and its managers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.eviction import Ids
from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.prefix_map import PrefixMap

__all__ = ["PartialEntries", "PartialIndex"]

_NULL = 0  # the null block's id (block_pool.NULL)


class PartialEntries:
    """Block -> the partial key it holds (at most one), and per group the extra holders of a key."""

    def __init__(self, num_groups: int) -> None:
        self.key_of: dict[int, BlockHash] = {}
        self._extra: list[dict[BlockHash, list[int]]] = [{} for _ in range(num_groups)]

    def __bool__(self) -> bool:
        return bool(self.key_of)

    def add(self, group_id: int, block: int, key: BlockHash, *, extra: bool) -> None:
        """Record that `block` holds `key` (`extra`: beside the hash it carries)."""
        self.key_of[block] = key
        if extra:
            self._extra[group_id].setdefault(key, []).append(block)

    def extra_holder(self, group_id: int, key: BlockHash) -> int | None:
        """The first block of the group holding `key` as an extra key, None if none."""
        holders = self._extra[group_id].get(key)
        return holders[0] if holders else None

    def forget(self, blocks: Sequence[int], group_of: Ids) -> None:
        """Drop the records of `blocks` (evicted, uncached or re-keyed); `group_of[b]` is b's group."""
        for block in blocks:
            key = self.key_of.pop(block, None)
            if key is None:
                continue
            extra = self._extra[group_of.item(block)]
            holders = extra.get(key)
            if holders and block in holders:
                holders.remove(block)
                if not holders:
                    del extra[key]

    def clear(self) -> None:
        self.key_of.clear()
        for extra in self._extra:
            extra.clear()

    def check(self, has_hash: Sequence[bool], group_of: Sequence[int]) -> None:
        """IntegrityError unless every extra holder is recorded, carries a hash and is of its group."""
        for group_id, extra in enumerate(self._extra):
            for key, blocks in extra.items():
                for block in blocks:
                    if self.key_of.get(block) != key or not has_hash[block] or group_of[block] != group_id:
                        raise IntegrityError(f"extra partial entry of block {block} (group {group_id}) is not "
                                             f"recorded, or the block carries no hash or belongs to group "
                                             f"{group_of[block]}")


class PoolState(Protocol):
    """What `PartialIndex` reads and writes of its block pool."""

    has_hash: NDArray[np.bool_]
    slot_of: NDArray[np.int64]
    group_of: NDArray[np.int64]
    evictions: int

    def place_of(self, group_id: int) -> tuple[PrefixMap, int]: ...

    def hash_of(self, block: int) -> BlockHash | None: ...

    def drop_hash(self, block: int) -> None: ...


class PartialIndex:
    """The pool's partial entries and the verbs on them (`BlockPool.partial`; see `block_pool.py`'s
    docstring): a component of the pool, which owns the prefix maps it writes into."""

    def __init__(self, pool: PoolState, num_groups: int) -> None:
        self._pool = pool
        #: which blocks hold a partial key, and the extra holders per group
        self.entries = PartialEntries(num_groups)

    def cache(self, group_id: int, block: int, key: BlockHash) -> bool:
        """Make `block` (of group `group_id`) reachable under `key`, the hash of a prefix that ends
        inside it (module docstring); False, nothing done, for the null block or a block that
        already holds `key`."""
        if block == _NULL or self.key(block) == key or self._pool.hash_of(block) == key:
            return False
        if self.key(block) is not None:  # one partial entry per block: the newer replaces it
            self.drop(block)
        carries = bool(self._pool.has_hash.item(block))
        self.entries.add(group_id, block, key, extra=carries)
        if carries:
            return True
        pmap, col = self._pool.place_of(group_id)
        slot = pmap.slot_for(key)
        self._pool.has_hash[block] = True
        self._pool.slot_of[block] = slot
        if pmap.blocks.item(col, slot) == _NULL:
            pmap.blocks[col, slot] = block
            pmap.count[slot] += 1
        else:
            pmap.add_dup(col, slot, key, block)
        return True

    def blocks(self, group_ids: Sequence[int], key: BlockHash) -> list[int] | None:
        """The block every group of `group_ids` holds under `key` (its hash or an extra partial
        entry), one per group; None unless every group holds one."""
        out = []
        for group_id in group_ids:
            pmap, col = self._pool.place_of(group_id)
            slot = pmap.index.get(key, 0)
            block = pmap.blocks.item(col, slot) if slot else _NULL
            if block == _NULL:
                block = self.entries.extra_holder(group_id, key) or _NULL
                if block == _NULL:
                    return None
            out.append(block)
        return out

    def key(self, block: int) -> BlockHash | None:
        """The partial key `block` holds (as its hash or an extra entry), None if none."""
        return self.entries.key_of.get(block) if self.entries else None

    def holds(self, block: int, key: BlockHash) -> bool:
        """Whether `block` is reachable under `key` (its hash or its partial entry)."""
        return self.key(block) == key or self._pool.hash_of(block) == key

    def drop(self, block: int) -> None:
        """Forget the partial entry of `block` (no-op without one); hits taken before are re-verified."""
        key = self.key(block)
        if key is None:
            return
        if self._pool.hash_of(block) == key:
            self._pool.drop_hash(block)
        else:
            self.entries.forget([block], self._pool.group_of)
            self._pool.evictions += 1

    def move(self, group_id: int, src: int, dst: int) -> None:
        """Re-point the partial entry of `src` to `dst` (a fresh block of the same group that
        will hold a copy of `src`'s content); no-op when `src` holds none."""
        key = self.key(src)
        if key is None:
            return
        self.drop(src)
        self.cache(group_id, dst, key)
