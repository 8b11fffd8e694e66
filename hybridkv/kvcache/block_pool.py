"""The block pool: the state of every physical block, the free blocks, and the prefix-cache map.

One pool serves all KV cache groups; a block id belongs to one group at a time (its group is
set when it is allocated). Block 0 is the null block: the placeholder for positions a group
does not keep (tokens out of a sliding window, finished local-attention chunks, old Mamba
states). It is never freed, cached or evicted, and the bulk operations skip it.

A block is its id; its state lives in arrays indexed by id, so releasing or allocating a run
of blocks is a few numpy operations rather than a Python step per block:

    ref_cnt:     int64 array      how many request tables hold the block
    group_of:    int64 array      the group it was last allocated to (-1: never)
    slot_of:     int64 array      its slot in its block size's prefix map (0: not cached);
                                  its hash is the slot's key (`hash_of`)
    has_hash:    bool array       slot_of[i] != 0 (what the eviction policy reads)
    free:        the eviction policy's queue of ids with ref_cnt 0 (front = reused first)
    maps:        per block size, hash -> slot -> block per group (`prefix_map.py`; the
                 prefix-cache key is (hash, group))

One public verb per operation (the fast variants for a handful of blocks are private):

- `allocate` pops blocks from the policy and drops any stale hash of a popped block (eviction).
- `touch` takes hit blocks back from the free queue and raises their ref count.
- `free` lowers ref counts in the order given (a request's tail first) and releases blocks that
  reach 0 to the policy; they keep their hash until reused, so they can still be hit.
  `free_tables` does it for whole request tables, position by position across groups.
- `cache` maps full blocks to their hashes; `uncache` drops hashes of blocks never written.
- Identical content may be cached in two blocks (two requests computed it concurrently); the
  first stays in the map, later ones wait in a side table and are promoted when it is evicted.
- Partial entries (`prefix_match_unit` below the block, docs/prefix_caching.md): `partial.cache`
  makes a block reachable under the hash of a prefix that ends inside it. A block without a
  hash takes that key as its hash (in its group's map, like a full block); a block that already
  carries one keeps it and holds the key as an *extra* entry (`partial.blocks` finds both).
  `partial.move` re-points a partial entry to a private copy. Partial entries record no events. These
  verbs live beside the entries' record, in `partial_hits.py` (`PartialIndex`, the pool's `partial`).
- `check_integrity` (tests, debugging) runs `pool_checks.check_pool`.

The null block's ref count is `NULL_REF_CNT` and never changes (touch and release skip id 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate, chain, pairwise

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import ConfigError, IntegrityError
from hybridkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent, KVEvents
from hybridkv.kvcache.eviction import Ids, PolicyFactory, interleave, interleave_rows
from hybridkv.kvcache.ids import NULL, NULL_REF_CNT, BlockHash
from hybridkv.kvcache.partial_hits import PartialIndex
from hybridkv.kvcache.pool_checks import check_pool, free_and_carrying
from hybridkv.kvcache.prefix_map import GroupsView, PrefixMap, maps_for
from hybridkv.plan.planner import KVCacheGroupSpec

__all__ = ["NULL", "NULL_REF_CNT", "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "IntegrityError",
           "KVEvent", "KVEvents"]

#: Up to this many blocks an operation runs block by block on the arrays (a decode step's
#: handful: no array call overhead); from here on, in array operations.
FEW = 8


class BlockPool:
    """All blocks of all groups; see the module docstring for the contract."""

    def __init__(self, *, num_blocks: int, groups: Sequence[KVCacheGroupSpec], policy_factory: PolicyFactory,
                 events: KVEvents = KVEvents.OFF) -> None:
        if num_blocks < 2:
            raise ConfigError(f"a block pool needs the null block and at least one usable block, "
                              f"got num_blocks={num_blocks}; expected >= 2")
        self.num_blocks = num_blocks
        self.null_block = NULL
        self.ref_cnt = np.zeros(num_blocks, np.int64)
        self.ref_cnt[NULL] = NULL_REF_CNT
        self.group_of = np.full(num_blocks, -1, np.int64)
        self.has_hash = np.zeros(num_blocks, np.bool_)
        self._groups = tuple(groups)
        self.num_groups = len(self._groups)
        self._group_ids = np.arange(len(self._groups), dtype=np.int64)
        #: the free blocks' order (`eviction.py`; a value-aware one reads each block's group)
        self.eviction = policy_factory(num_blocks, self.has_hash)
        self.eviction.bind(self.group_of, [g.kind for g in self._groups])
        self.slot_of = np.zeros(num_blocks, np.int64)
        #: the prefix maps (`prefix_map.maps_for`), and per group: (its map, its column there)
        self.pmaps, self._place = maps_for(self._groups, num_blocks)
        self._col_of = np.array([col for _, col in self._place], np.int64)
        self._map_of = np.array([self.pmaps.index(pmap) for pmap, _ in self._place], np.int64)  # (group -> map)
        self._events_on = events is KVEvents.ON
        self._log = EventLog(self._groups)
        # Bumped whenever a cached hash disappears; a CacheHit taken at an equal count is valid.
        self.evictions = 0
        #: the partial entries and their verbs (`partial_hits.py`): `pool.partial.cache(...)`
        self.partial = PartialIndex(self, len(self._groups))
        self._partial = self.partial.entries

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (cached or not): what `allocate` can hand out."""
        return self.eviction.num_free

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def hash_of(self, block: int) -> BlockHash | None:
        """The cached hash of `block`, None if it carries none."""
        slot = self.slot_of.item(block)
        if not slot:
            return None
        key: BlockHash = self._place[self.group_of.item(block)][0].key[slot]
        return key

    @property
    def block_hash(self) -> NDArray[np.object_]:
        """Every block's cached hash or None, as a new object array (for checks and tests; the hot
        path keeps no per-block hash: a block's hash is its slot's key)."""
        out: NDArray[np.object_] = np.full(self.num_blocks, None, object)
        for pmap in self.pmaps:
            ids = np.flatnonzero(np.isin(self.group_of, pmap.group_ids) & (self.slot_of != 0))
            out[ids] = pmap.key[self.slot_of[ids]]
        return out

    def groups_view(self, group_ids: Sequence[int]) -> GroupsView:
        """What the hit rule of `group_ids` (one block size) reads: their columns of the prefix map."""
        pmap = self._place[group_ids[0]][0]
        if any(self._place[g][0] is not pmap for g in group_ids):
            raise ConfigError(f"groups {list(group_ids)} do not share one block size; expected one prefix map")
        return pmap.view([self._place[g][1] for g in group_ids])

    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request."""
        return 1.0 - self.eviction.num_free / self.usable_blocks

    def group_usage(self) -> tuple[int, ...]:
        """Blocks held by at least one request, per group (counted now: one array pass)."""
        held = self.ref_cnt > 0
        held[NULL] = False
        return tuple(np.bincount(self.group_of[held], minlength=len(self._groups)).tolist())

    def take_events(self) -> list[KVEvent]:
        """Return and forget the events recorded since the last call."""
        return self._log.take()

    # -- hot path -----------------------------------------------------------------------------

    def allocate(self, counts: Sequence[int]) -> list[list[int]] | list[Ids]:
        """Pop `counts[g]` blocks for every group g (the caller checked `num_free`), ref count 1,
        dropping any stale hash of a popped block (an eviction).

        Returns per group its new block ids, in group order, from one pop: lists for a handful
        of blocks (a decode step), else array slices.
        """
        total = sum(counts)
        if total <= FEW:
            return self._allocate_few(counts, total)
        return np.split(self.allocate_flat(counts), np.cumsum(counts)[:-1])

    def allocate_flat(self, counts: Sequence[int]) -> Ids:
        """`allocate`'s blocks as one array, group after group (hundreds of page groups: no list per group)."""
        total = sum(counts)
        if total <= FEW:
            return np.array(self._pop_few(counts, total), np.int64)
        ids = self.eviction.pop(total)
        if np.count_nonzero(self.has_hash[ids]):
            self._evict(ids)
        self.ref_cnt[ids] = 1
        self.group_of[ids] = np.repeat(self._group_ids, counts)
        return ids

    def _allocate_few(self, counts: Sequence[int], total: int) -> list[list[int]]:
        """`allocate` for a handful of blocks (`total` = sum of `counts`), as lists."""
        listed = self._pop_few(counts, total)
        return [listed[a:b] for a, b in pairwise(accumulate(counts, initial=0))]

    def _pop_few(self, counts: Sequence[int], total: int) -> list[int]:
        """Pop `total` blocks, group after group, by scalar writes (one pass over the blocks, none over
        hundreds of page groups' counts): stale hashes dropped, ref count 1."""
        listed = self.eviction.pop_few(total)
        has_hash, ref_cnt, group_of = self.has_hash, self.ref_cnt, self.group_of
        owners = (np.repeat(self._group_ids, counts).tolist() if len(counts) > 8 * FEW  # (page groups: one call)
                  else [g for g, count in enumerate(counts) for _ in range(count)])
        for block, group_id in zip(listed, owners, strict=True):
            if has_hash.item(block):
                self._evict_one(block)
            ref_cnt[block] = 1
            group_of[block] = group_id
        return listed

    def _evict(self, ids: Ids) -> None:
        """Drop the stale hashes of popped blocks (some carry one)."""
        evicted = ids[self.has_hash[ids]]
        self.has_hash[evicted] = False
        if self._events_on:  # one event per block, in pop order
            self._unmap(evicted.tolist())
            return
        if self._partial:
            self._partial.forget(evicted.tolist(), self.group_of)
        groups = self.group_of[evicted]
        maps = self._map_of[groups] if len(self.pmaps) > 1 else None  # (each block's map, read once)
        for k, pmap in enumerate(self.pmaps):
            chosen = slice(None) if maps is None else maps == k
            ids, cols = evicted[chosen], self._col_of[groups[chosen]]
            if not len(ids):
                continue
            slots = self.slot_of[ids]
            if pmap.dups[0] or (len(pmap.dups) > 1 and any(pmap.dups)):
                # a hash with copies (to promote or drop), or a waiting copy itself: block by block
                copied = pmap.waiting[cols, slots] | (pmap.blocks[cols, slots] != ids)
                if np.count_nonzero(copied):
                    self._unmap(ids[copied].tolist())
                    keep = ~copied
                    ids, slots, cols = ids[keep], slots[keep], cols[keep]
            # every block is its slot's block in its group, without copies
            pmap.blocks[cols, slots] = NULL
            self.slot_of[ids] = 0
            pmap.release(slots)
            self.evictions += len(ids)

    def _unmap(self, blocks: list[int]) -> None:
        """Remove `blocks` (each carries a hash) from their groups' prefix maps and forget their
        hashes (the caller clears `has_hash`)."""
        slot_of = self.slot_of
        group_of = self.group_of
        partial = self._partial
        for block in blocks:  # scalar reads with .item(): no numpy scalar objects
            group_id = group_of.item(block)
            pmap, col = self._place[group_id]
            slot = slot_of.item(block)
            block_hash = pmap.key[slot]
            quiet = bool(partial) and partial.key_of.get(block) == block_hash  # a partial entry records no event
            if partial:
                partial.forget([block], group_of)
            if pmap.blocks.item(col, slot) != block:  # a waiting copy
                pmap.take_dup(col, slot, block_hash, block)
            elif pmap.waiting.item(col, slot):  # a waiting copy becomes the primary
                pmap.blocks[col, slot] = pmap.take_dup(col, slot, block_hash, None)
            else:
                pmap.blocks[col, slot] = NULL
                pmap.release_one(slot)
            if self._events_on and not quiet:
                self._log.removed(group_id, block_hash)
            slot_of[block] = 0
        self.evictions += len(blocks)

    def touch(self, tables: Sequence[Sequence[int]]) -> None:
        """Take the hit blocks `tables[g]` of every group g (each block once; null entries
        skipped): raise their ref counts, pull the free ones out of the free queue."""
        order = list(chain.from_iterable(tables))
        if len(order) <= FEW:
            refs = self.ref_cnt
            revived = []
            for block in order:
                if block != NULL:
                    held = refs.item(block)
                    if not held:
                        revived.append(block)
                    refs[block] = held + 1
            if revived:
                self.eviction.remove_few(revived)
            return
        ids = np.array(order, np.int64)
        if NULL in order:
            ids = ids[ids != NULL]
        refs = self.ref_cnt[ids]
        self.ref_cnt[ids] = refs + 1
        revived = ids[refs == 0]
        if len(revived):
            self.eviction.remove(revived)

    def free(self, blocks: Sequence[int] | Ids) -> None:
        """Drop one reference to each block, in order, and release those that reach 0 in the
        order they reach it; null entries are skipped.

        A list may repeat a block (one reference per occurrence); an array holds each block at
        most once (it runs as array operations).
        """
        if isinstance(blocks, np.ndarray):
            if blocks.size > FEW:
                self._release(blocks[blocks != NULL] if np.count_nonzero(blocks) != blocks.size else blocks)
                return
            blocks = blocks.tolist()
        released: list[int] = []
        refs = self.ref_cnt
        for block in blocks:  # (scalar reads with .item(): no numpy scalar objects)
            if block == NULL:
                continue
            left = refs.item(block) - 1
            refs[block] = left
            if not left:
                released.append(block)
        if released:
            self.eviction.release_few(released)

    def free_tables(self, parts: Sequence[tuple[Sequence[int], Ids]]) -> None:
        """Drop one reference to every block of `parts` and release those that reach 0
        position by position across groups: the k-th block from the tail of every group before
        the (k+1)-th of any. Each part is (group ids, blocks): row i of `blocks` (a (groups, n)
        array) holds blocks of group `group_ids[i]`, tail first, each block once, null entries
        allowed.

        Releasing position k of every group before position k-1 of any makes the global LRU
        evict a position from all groups together, so identical groups do not lose hits one
        group at a time. The order is one array: row k of a (longest, groups) grid holds the
        k-th entry from the tail of each group (null where a group is shorter), read row by row.
        """
        total = sum(blocks.size for _, blocks in parts)
        if not total:
            return
        if total <= FEW:
            lists: list[list[int]] = [[] for _ in self._groups]
            for group_ids, blocks in parts:
                for group_id, row in zip(group_ids, blocks.tolist(), strict=True):
                    lists[group_id] = row
            self.free(interleave(lists))
            return
        ids = interleave_rows(parts, len(self._groups))
        self._release(ids[ids != NULL])

    def _release(self, ids: Ids) -> None:
        """Drop one reference to each of `ids` (real blocks, each once, in release order) and
        release those that reach 0, in that order (when all carry a hash, the policy need not
        check each)."""
        released = self._unref(ids)
        if not len(released):
            return
        if np.count_nonzero(self.has_hash[released]) == len(released):
            self.eviction.release_cached(released)
        else:
            self.eviction.release(released)

    def _unref(self, ids: Ids) -> Ids:
        """Drop one reference to each of `ids`; the ones that reach 0, in order."""
        refs = self.ref_cnt[ids]
        refs -= 1
        self.ref_cnt[ids] = refs
        return ids[refs == 0] if np.count_nonzero(refs) else ids

    def cache(self, group_ids: Sequence[int], rows: Ids, hashes: Sequence[BlockHash], start: int, end: int,
              token_ids: Sequence[int]) -> None:
        """Cache the non-null blocks `rows[i, start:end]` of group `group_ids[i]` (groups of one
        block size; `rows` is (groups, n)) under `hashes[start:end]`; blocks that already carry a
        hash are skipped, and a hash a group already holds makes the block a waiting copy.
        `token_ids` are the request's tokens (for `BlockStored` events)."""
        if end == start + 1 and rows.shape[1] > start:
            self.cache_position(group_ids, rows[:, start].tolist(), hashes, start, token_ids)
            return
        chosen = rows[:, start:end]
        keys = hashes[start:end]
        if chosen.size <= FEW or not self._cache_fresh(group_ids, chosen, keys):
            pmap, _ = self._place[group_ids[0]]
            for group_id, row in zip(group_ids, chosen.tolist(), strict=True):
                self._cache_one_by_one(pmap, self._place[group_id][1], row, keys)
        if self._events_on:
            for group_id, row in zip(group_ids, chosen.tolist(), strict=True):
                self._log.stored(group_id, row, hashes, start, end, token_ids)

    def cache_position(self, group_ids: Sequence[int], blocks: Sequence[int], hashes: Sequence[BlockHash],
                        position: int, token_ids: Sequence[int]) -> None:
        """`cache` of one position: `blocks[i]` (table entry `position` of group
        `group_ids[i]`, one block size) under `hashes[position]`, with one dict operation for all."""
        key = hashes[position]
        pmap = self._place[group_ids[0]][0]
        if len(group_ids) > FEW and not self._events_on:  # a multi-page state's checkpoint: its pages at once
            self._cache_column(pmap, group_ids, np.array(blocks, np.int64), key)
            return
        has_hash, slot_of, place = self.has_hash, self.slot_of, self._place
        slot = 0
        for group_id, block in zip(group_ids, blocks, strict=True):
            if block == NULL or has_hash.item(block):
                continue
            if not slot:
                slot = pmap.slot_for(key)
            has_hash[block] = True
            slot_of[block] = slot
            col = place[group_id][1]
            primaries = pmap.blocks  # (after `slot_for`: the map's arrays may have grown)
            if primaries.item(col, slot) == NULL:
                primaries[col, slot] = block
                pmap.count[slot] += 1
            else:
                pmap.add_dup(col, slot, key, block)
        if self._events_on:
            for group_id, block in zip(group_ids, blocks, strict=True):
                self._log.stored(group_id, [block], hashes, position, position + 1, token_ids)

    def _cache_column(self, pmap: PrefixMap, group_ids: Sequence[int], blocks: Ids, key: BlockHash) -> None:
        """`cache_position` of many groups in array operations (`blocks[i]`: group `group_ids[i]`'s)."""
        chosen = (blocks != NULL) & ~self.has_hash[blocks]
        if not np.count_nonzero(chosen):
            return
        slot = pmap.slot_for(key)
        blocks = blocks[chosen]
        self.has_hash[blocks] = True
        self.slot_of[blocks] = slot
        pmap.cache_column(self._col_of[list(group_ids)][chosen], slot, key, blocks)

    def _cache_fresh(self, group_ids: Sequence[int], chosen: Ids, keys: Sequence[BlockHash]) -> bool:
        """The common case in bulk: real blocks without a hash, each key new to every group and
        not repeated (one dict operation per key for all groups); False (nothing done) otherwise."""
        if (chosen.shape[1] != len(keys) or np.count_nonzero(chosen) != chosen.size
                or np.count_nonzero(self.has_hash[chosen])):
            return False
        pmap, _ = self._place[group_ids[0]]
        slots = pmap.slots_for(keys)
        cols = self._col_of[list(group_ids)][:, None]
        if np.count_nonzero(pmap.blocks[cols, slots]) or len(set(slots.tolist())) != len(keys):
            return False  # (the slots stay: the one-by-one pass finds them)
        pmap.blocks[cols, slots] = chosen
        pmap.count[slots] += len(group_ids)
        self.slot_of[chosen] = slots
        self.has_hash[chosen] = True
        return True

    def _cache_one_by_one(self, pmap: PrefixMap, col: int, blocks: list[int], keys: Sequence[BlockHash]) -> None:
        """Cache each real block without a hash; a key its group already holds makes it a waiting copy."""
        has_hash = self.has_hash
        slot_of = self.slot_of
        for block, key in zip(blocks, keys, strict=True):
            if block == NULL or has_hash.item(block):
                continue
            slot = pmap.slot_for(key)
            primaries = pmap.blocks  # (the map's arrays may have grown)
            has_hash[block] = True
            slot_of[block] = slot
            if primaries.item(col, slot) == NULL:
                primaries[col, slot] = block
                pmap.count[slot] += 1
            else:
                pmap.add_dup(col, slot, key, block)

    def uncache(self, blocks: Sequence[int]) -> None:
        """Drop the cached hash of `blocks` (held blocks whose KV was never written, e.g. a step
        that was allocated and then preempted): no later lookup can hit them, a `BlockRemoved`
        event is recorded, and hits taken before are re-verified (`evictions` grows)."""
        for block in blocks:
            if self.has_hash.item(block):
                self._drop_hash(block)

    def discard(self, blocks: Sequence[int], block_hash: BlockHash) -> bool:
        """Drop `block_hash` from free `blocks` that still carry it (a cached entry no lookup will
        want): they become content-free and are reused first. False, and nothing changes, when
        any of them is held or carries another hash (reused or hit since)."""
        ids = np.array(blocks, np.int64)
        if not free_and_carrying(self, ids, block_hash):
            return False
        self.eviction.remove(ids)
        self._evict(ids)  # (every one carries the hash: dropped in array operations)
        self.eviction.release(ids)
        return True

    # -- slow path ----------------------------------------------------------------------------

    def _evict_one(self, block: int) -> None:
        """`_drop_hash` of a popped block (scalar reads; the common case without copies or events inline)."""
        slot = self.slot_of.item(block)
        pmap, col = self._place[self.group_of.item(block)]
        if self._events_on or self._partial or pmap.waiting.item(col, slot) or pmap.blocks.item(col, slot) != block:
            self._drop_hash(block)
            return
        pmap.blocks[col, slot] = NULL
        pmap.release_one(slot)
        self.slot_of[block] = 0
        self.has_hash[block] = False
        self.evictions += 1

    def place_of(self, group_id: int) -> tuple[PrefixMap, int]:
        """The prefix map group `group_id` is cached in, and its column there."""
        return self._place[group_id]

    def drop_hash(self, block: int) -> None:
        """Uncache one block (no-op without a hash)."""
        self._drop_hash(block)

    def check_integrity(self, expected_refs: Mapping[int, int]) -> None:
        """`pool_checks.check_pool`: IntegrityError with the actual numbers on a broken invariant."""
        check_pool(self, expected_refs)

    def _drop_hash(self, block: int) -> None:
        """Remove `block` (which carries a hash) from its group's prefix map."""
        self._unmap([block])
        self.has_hash[block] = False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block but null is in use."""
        if self.eviction.num_free != self.usable_blocks:
            return False
        for pmap in self.pmaps:
            pmap.clear()
        self._partial.clear()
        self.slot_of[:] = 0
        self.has_hash[:] = False
        self.evictions += 1
        if self._events_on:
            self._log.cleared()
        return True
