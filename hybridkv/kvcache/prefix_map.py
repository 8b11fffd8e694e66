"""The prefix-cache map of the KV cache groups of one block size: one dict for all of them.

The prefix-cache key is (block hash, group). The groups of one block size cache the same
positions of a request under the same hashes, so one dict maps a hash to a *slot*, and a slot
holds the cached block of that hash in every group (a column of an array, 0 where a group holds
none):

    index:   hash -> slot                     (one dict operation per position, not per group)
    blocks:  int64 [groups, slots]            blocks[col, slot] = the block of group `group_ids[col]`
    count:   int64 [slots]                    how many groups hold a block in the slot
    key:     object [slots]                   the hash of each slot in use (None: free slot)

A slot lives while some group holds a block in it; it is freed (and leaves the dict) when its
last block is evicted. Slot 0 is never used: a column of zeros that stands for "not cached", so
a lookup maps every key to a slot (`index.get(key, 0)`) and reads all groups' answers in one
array gather. Identical content cached in a second block of the same group (two requests
computed it concurrently) waits in `dups[col][hash]` (and `waiting[col, slot]` is set); the
pool promotes it when the first is evicted.

The arrays hold the slots taken so far and grow by doubling (`_reserve`): a map's memory follows
its slots in use, not its groups times the pool's blocks (the multi-page state layout has hundreds
of page groups, cached only at checkpoints).

Array calls cost a microsecond or more each here, whatever their size, so bulk operations use
few of them (`np.count_nonzero` rather than `.any()`), and single blocks plain scalar reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from enum import Enum
from itertools import islice, repeat, takewhile

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.ids import BlockHash
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import SpecKind

Ids = NDArray[np.int64]
#: slots a new map holds before it first grows
INITIAL_SLOTS = 1024


class Fate(Enum):
    """What became of a hash that a lookup needed and some group did not hold."""

    ELSEWHERE = "elsewhere"
    EVICTED = "evicted"
    NEVER = "never"


class PrefixMap:
    """Hash -> slot -> block per group, for the groups `group_ids` (one block size)."""

    def __init__(self, group_ids: Sequence[int], num_blocks: int) -> None:
        self.group_ids = tuple(group_ids)
        # at most one slot per hashed block, and the null block is never hashed: num_blocks - 1 slots at
        # most; the arrays hold `capacity` slots and grow (doubling) as slots are taken, so memory follows
        # the slots in use (a map of many state-page groups is used only at checkpoints), not groups x blocks
        self._max_slots = num_blocks
        self.index: dict[BlockHash, int] = {}
        cap = min(num_blocks, INITIAL_SLOTS)
        self.blocks: Ids = np.zeros((len(self.group_ids), cap), np.int64)
        self.count: Ids = np.zeros(cap, np.int64)
        self.waiting = np.zeros((len(self.group_ids), cap), np.bool_)
        self.key: NDArray[np.object_] = np.full(cap, None, object)
        #: per slot, how often it was freed (a slot whose generation is unchanged still holds its key)
        self.generation: Ids = np.zeros(cap, np.int64)
        self.dups: list[dict[BlockHash, list[int]]] = [{} for _ in self.group_ids]
        self._free: Ids = np.arange(cap - 1, 0, -1, dtype=np.int64)  # a stack: top = lowest slot
        self._top = cap - 1
        #: hashes whose last block was evicted, oldest first (the newest `num_blocks` at least): tells an
        #: evicted block from one never cached when a lookup misses it (`GroupsView.fate`)
        self.evicted: dict[BlockHash, None] = {}
        self._evicted_cap = num_blocks
        #: every map of this block size, this one included (state groups have their own: `fate` asks all)
        self.peers: tuple[PrefixMap, ...] = (self,)
        #: where each key whose blocks change is written down (a probe memo's log, `probe_memo.py`), if anywhere
        self.changes: list[BlockHash] | None = None

    @property
    def capacity(self) -> int:
        """Slots the arrays hold now (slot 0 included)."""
        return len(self.count)

    def _reserve(self, n: int) -> None:
        """Grow the arrays (at least doubling, at most `num_blocks` slots) until `n` slots are free."""
        if n <= self._top:
            return
        old = self.capacity
        cap = min(self._max_slots, max(2 * old, old + n - self._top))
        assert n - self._top <= cap - old, f"{n} new slots asked for, {self._top} free of {old} (at most {cap})"
        groups = len(self.group_ids)
        self.blocks = np.concatenate([self.blocks, np.zeros((groups, cap - old), np.int64)], axis=1)
        self.waiting = np.concatenate([self.waiting, np.zeros((groups, cap - old), np.bool_)], axis=1)
        self.count = np.concatenate([self.count, np.zeros(cap - old, np.int64)])
        self.generation = np.concatenate([self.generation, np.zeros(cap - old, np.int64)])
        self.key = np.concatenate([self.key, np.full(cap - old, None, object)])
        # the new slots go under the free ones (the stack's top stays the lowest free slot)
        free = np.concatenate([np.arange(cap - 1, old - 1, -1, dtype=np.int64), self._free[: self._top]])
        self._free = np.zeros(cap - 1, np.int64)
        self._free[: len(free)] = free
        self._top = len(free)

    # -- slots ----------------------------------------------------------------------------------

    def slots_for(self, keys: Sequence[BlockHash]) -> Ids:
        """The slot of each key, new slots for keys not in the map (one dict operation each)."""
        n = len(keys)
        if self.changes is not None:
            self.changes.extend(keys)
        self._reserve(n)
        top = self._top
        candidates = self._free[top - n : top]
        got = np.fromiter(map(self.index.setdefault, keys, candidates.tolist()), np.int64, n)
        fresh = got == candidates
        used = int(np.count_nonzero(fresh))
        if used == n:
            self.key[got] = keys
            self._top = top - n
            return got
        if used:
            self.key[got[fresh]] = [k for k, new in zip(keys, fresh.tolist(), strict=True) if new]
        unused = candidates[~fresh]
        self._free[top - n : top - n + len(unused)] = unused
        self._top = top - n + len(unused)
        return got

    def slot_for(self, key: BlockHash) -> int:
        if self.changes is not None:
            self.changes.append(key)
        slot = self.index.get(key)
        if slot is None:
            self._reserve(1)
            self._top -= 1
            slot = int(self._free[self._top])
            self.index[key] = slot
            self.key[slot] = key
        return slot

    def add_dup(self, col: int, slot: int, key: BlockHash, block: int) -> None:
        self.dups[col].setdefault(key, []).append(block)
        self.waiting[col, slot] = True

    def cache_column(self, cols: Ids, slot: int, key: BlockHash, blocks: Ids) -> None:
        """`blocks[i]` becomes column `cols[i]`'s block of `slot` (a waiting copy where it holds one)."""
        first = self.blocks[cols, slot] == 0
        self.blocks[cols[first], slot] = blocks[first]
        self.count[slot] += int(np.count_nonzero(first))
        for col, block in zip(cols[~first].tolist(), blocks[~first].tolist(), strict=True):
            self.add_dup(col, slot, key, block)

    def take_dup(self, col: int, slot: int, key: BlockHash, block: int | None) -> int:
        """Remove `block` (None: the first) from the copies waiting for `key`; return it."""
        if self.changes is not None:  # (a promoted copy changes the key's block)
            self.changes.append(key)
        waiting = self.dups[col][key]
        if block is None:
            block = waiting.pop(0)
        else:
            waiting.remove(block)
        if not waiting:
            del self.dups[col][key]
            self.waiting[col, slot] = False
        return block

    def release(self, slots: Ids) -> None:
        """One group let go of each of `slots` (repeats allowed); free those no group holds."""
        count = self.count
        if self.changes is not None:  # (a group letting go changes what every group holds, freed or not)
            self.changes.extend(self.key[slots].tolist())
        np.subtract.at(count, slots, 1)
        empty = slots[count[slots] == 0]
        if not len(empty):
            return
        unique: list[int] = list(dict.fromkeys(empty.tolist()))
        keys = self.key[unique].tolist()
        self.generation[unique] += 1
        deque(map(self.index.__delitem__, keys), maxlen=0)
        self._remember(keys)
        self.key[unique] = None
        top = self._top
        self._free[top : top + len(unique)] = unique
        self._top = top + len(unique)

    def release_one(self, slot: int) -> None:
        if self.changes is not None:
            self.changes.append(self.key[slot])
        left = self.count.item(slot) - 1
        self.count[slot] = left
        if not left:
            key = self.key[slot]
            self.generation[slot] += 1
            del self.index[key]
            self._remember((key,))
            self.key[slot] = None
            self._free[self._top] = slot
            self._top += 1

    def _remember(self, keys: Sequence[BlockHash]) -> None:
        evicted = self.evicted
        evicted.update(dict.fromkeys(keys))
        if len(evicted) > 2 * self._evicted_cap:  # keep the newest `cap` (amortized: C-level copies only)
            self.evicted = dict.fromkeys(list(evicted)[-self._evicted_cap :])

    def clear(self) -> None:
        if self.changes is not None:
            self.changes.extend(self.index)
        self.evicted.clear()
        self.index.clear()
        self.blocks[:] = 0
        self.count[:] = 0
        self.generation += 1
        self.waiting[:] = False
        self.key[:] = None
        for dups in self.dups:
            dups.clear()
        self._top = len(self._free)
        self._free[:] = np.arange(self._top, 0, -1)  # (the capacity stays as grown)

    # -- reads ----------------------------------------------------------------------------------

    def view(self, cols: Sequence[int]) -> GroupsView:
        return GroupsView(self, cols)

    def snapshot(self, col: int) -> dict[BlockHash, int]:
        """Hash -> block of one group (a copy)."""
        blocks = self.blocks[col].tolist()
        return {h: blocks[s] for h, s in self.index.items() if blocks[s]}

    def check(self, block_hash: NDArray[np.object_], group_of: list[int], slot_of: Ids) -> int:
        """Raise `IntegrityError` on an inconsistent map; return how many blocks it holds."""
        in_use = len(self._free) - self._top
        if len(self.index) != in_use:
            raise IntegrityError(f"prefix map of groups {self.group_ids} has {len(self.index)} hashes but "
                                 f"{in_use} slots in use")
        entries = 0
        blocks = self.blocks.T.tolist()
        slot_ids = slot_of.tolist()
        counts = self.count.tolist()
        for block_hash_, slot in self.index.items():
            row = blocks[slot]
            if self.key[slot] != block_hash_ or not any(row) or slot == 0 or counts[slot] != sum(map(bool, row)):
                raise IntegrityError(f"prefix map slot {slot} of hash {block_hash_!r} is empty, keyed otherwise or "
                                     f"miscounted ({counts[slot]} groups)")
            for col, block in enumerate(row):
                if not block:
                    continue
                group = self.group_ids[col]
                if block_hash[block] != block_hash_ or group_of[block] != group or slot_ids[block] != slot:
                    raise IntegrityError(f"cache map of group {group} points at block {block} of group "
                                         f"{group_of[block]} whose hash does not match its key")
                entries += 1
        for col, dups in enumerate(self.dups):
            group = self.group_ids[col]
            for block_hash_, waiting in dups.items():
                slot = self.index.get(block_hash_, 0)
                if not slot or not blocks[slot][col] or not waiting or not self.waiting[col, slot]:
                    raise IntegrityError(f"duplicate table of group {group} has no primary block or no copies")
                for block in waiting:
                    if block_hash[block] != block_hash_ or group_of[block] != group or slot_ids[block] != slot:
                        raise IntegrityError(f"duplicate block {block} does not carry its key")
                entries += len(waiting)
        if np.count_nonzero(self.waiting) != sum(map(len, self.dups)):
            raise IntegrityError(f"the waiting flags of groups {self.group_ids} disagree with the copies")
        free = self._free[: self._top]
        if (np.count_nonzero(self.blocks[:, free]) or np.count_nonzero(self.count[free])
                or any(k is not None for k in self.key[free].tolist())):
            raise IntegrityError(f"a free slot of the prefix map of groups {self.group_ids} holds a block or key")
        return entries


class GroupsView:
    """The prefix map as some of its groups see it (columns `cols`): what a manager's hit rule
    reads. A key is held when every one of these groups holds a block for it."""

    def __init__(self, pmap: PrefixMap, cols: Sequence[int]) -> None:
        #: the map these groups read (a probe memo reads its arrays)
        self.map = pmap
        self._index = pmap.index
        self.cols = tuple(cols)
        first = self.cols[0]
        consecutive = self.cols == tuple(range(first, first + len(self.cols)))
        # which rows of `blocks`, picked after gathering the columns (`take`: the cheapest gather)
        self.rows: slice | Ids = (slice(first, first + len(self.cols)) if consecutive
                                  else np.array(self.cols, np.int64))
        self._first = first

    @property
    def _lead(self) -> Ids:
        """The first group's block per slot (a view, read anew: the map's arrays grow)."""
        lead: Ids = self.map.blocks[self._first]
        return lead

    def lead(self) -> GroupsView:
        """The first group alone."""
        return GroupsView(self.map, self.cols[:1])

    def slots(self, keys: Sequence[BlockHash]) -> Ids:
        """The slot of each key, 0 where no group holds it."""
        return np.fromiter(map(self._index.get, keys, repeat(0)), np.int64, len(keys))

    def held(self, keys: Sequence[BlockHash]) -> tuple[bytes, Ids]:
        """(row, slots): byte i of row is 1 where every group holds keys[i], else 0."""
        slots = self.slots(keys)
        held = self._lead[slots] != 0
        if len(self.cols) > 1:  # the other groups at the slots the first holds (a state's pages: at checkpoints)
            found = np.flatnonzero(held)
            if len(found):
                held[found] = self.map.blocks[self.rows][:, slots[found]].all(axis=0)
        return held.view(np.uint8).tobytes(), slots

    def blocks_if_held(self, keys: Sequence[BlockHash]) -> list[list[int]] | None:
        """Per group, its blocks of `keys` when every group holds every key, else None (one
        gather, no reduction: the lists are searched for a 0)."""
        slots = self.slots(keys)
        out: list[list[int]] = ([self._lead[slots].tolist()] if len(self.cols) == 1
                                else self.map.blocks.take(slots, axis=1)[self.rows].tolist())
        for row in out:
            if 0 in row:
                return None
        return out

    def prefix(self, keys: Iterable[BlockHash]) -> list[list[int]]:
        """Per group, the blocks of the longest prefix of `keys` that every group holds (an
        iterable: `islice` a long chain rather than copy it, which touches every hash object)."""
        slots = takewhile(bool, map(self._index.get, keys, repeat(0)))
        if len(self.cols) == 1:  # scalar reads: no array calls
            return [list(takewhile(bool, map(self._lead.item, slots)))]
        found = list(slots)
        if not found:
            return [[] for _ in self.cols]
        out: list[list[int]] = self.map.blocks.take(found, axis=1)[self.rows].tolist()
        cut = len(found)
        for row in out:
            if 0 in row:
                cut = min(cut, row.index(0))
        return out if cut == len(found) else [row[:cut] for row in out]

    def holds(self, key: BlockHash) -> bool:
        """Every one of these groups holds `key` (scalar reads: no array call)."""
        slot = self._index.get(key, 0)
        if not slot:
            return False
        return all(map(self.map.blocks.item, self.cols, repeat(slot)))

    def lacks(self, key: BlockHash) -> Fate | None:
        """None when every one of these groups holds `key`, else its `fate` (one dict read)."""
        slot = self._index.get(key, 0)
        if slot:
            return None if all(map(self.map.blocks.item, self.cols, repeat(slot))) else Fate.ELSEWHERE
        return self.fate(key)

    def fate(self, key: BlockHash) -> Fate:
        """Why these groups do not all hold `key`: another group of this block size holds it
        (ELSEWHERE), its last block was evicted (EVICTED), or it was never cached (or was evicted
        so long ago that it was forgotten: NEVER)."""
        peers = self.map.peers
        if any(key in m.index for m in peers):
            return Fate.ELSEWHERE
        return Fate.EVICTED if any(key in m.evicted for m in peers) else Fate.NEVER

    def real_blocks_at(self, slot: int) -> list[int]:
        """Every group's block in `slot`, the groups that hold none left out (one array read)."""
        column = self.map.blocks[self.rows, slot]
        out: list[int] = column[column != 0].tolist()
        return out

    def keys_in(self, slots: Ids) -> list[BlockHash]:
        """The distinct keys of `slots` (blocks' `slot_of`: 0, not cached, left out): `hash_of` over
        a state's pages in one gather."""
        used = np.unique(slots[slots != 0])
        keys: list[BlockHash] = self.map.key[used].tolist()
        return keys

    def blocks_at(self, slots: Ids) -> list[list[int]]:
        """Per group, its blocks in `slots` (every group holds each)."""
        out: list[list[int]] = self.map.blocks.take(slots, axis=1)[self.rows].tolist()
        return out


class PrefixProbes:
    """Probes of one group's held prefix (a waiting request's each step) that resume where the last probe of
    the same hash chain stopped: the positions it found are held still where their slots were not freed
    since (`PrefixMap.generation`) and the group holds a block in each; only the rest is looked up again."""

    #: chains remembered before the memo starts over (a chain is a request's: a finished one is not probed)
    MAX_CHAINS = 256

    def __init__(self) -> None:
        self._last: dict[int, tuple[Sequence[BlockHash], Ids, Ids]] = {}  # id(chain) -> (chain, slots, generations)
        self._positions: dict[int, tuple[Sequence[BlockHash], dict[BlockHash, int]]] = {}  # id(chain) -> its keys'

    def last_held(self, view: GroupsView, keys: Sequence[BlockHash], limit: int) -> int:
        """The last of `keys[:limit]` that every group of the view holds, -1 if none (`GroupsView.held`'s
        rfind). A map holding fewer keys than that (state checkpoints: a few hundred) is read key by key
        against the chain's positions (remembered per chain), not the chain against the map."""
        index = view.map.index
        positions = self._positions_of(keys) if len(index) < limit else None
        if positions is None:  # (a chain repeating a key, or a map larger than the chain: the plain scan)
            return view.held(keys[:limit])[0].rfind(1)
        common = [(positions[key], key) for key in index.keys() & positions.keys()]
        found = sorted((p, index[key]) for p, key in common if p < limit)
        if not found:
            return -1
        slots = np.array([slot for _, slot in found], np.int64)
        held = np.flatnonzero(view.map.blocks[view.rows][:, slots].all(axis=0))
        return found[int(held[-1])][0] if len(held) else -1

    def _positions_of(self, keys: Sequence[BlockHash]) -> dict[BlockHash, int] | None:
        last = self._positions.get(id(keys))
        if last is not None and last[0] is keys and len(last[1]) == len(keys):
            return last[1]
        positions = dict(zip(keys, range(len(keys)), strict=True))
        if len(positions) != len(keys):
            return None
        if len(self._positions) >= self.MAX_CHAINS:
            self._positions.clear()
        self._positions[id(keys)] = (keys, positions)
        return positions

    def held_prefix(self, view: GroupsView, keys: Sequence[BlockHash], limit: int) -> int:
        """How many of `keys[:limit]` lead the chain held by the view's one group (`GroupsView.prefix`'s length)."""
        pmap = view.map
        lead = pmap.blocks[view.cols[0]]
        last = self._last.get(id(keys))
        known = _NO_SLOTS
        if last is not None and last[0] is keys:
            known = last[1][:limit]
            lost = np.flatnonzero((pmap.generation[known] != last[2][: len(known)]) | (lead[known] == 0))
            if len(lost):  # (from there on looked up again: a freed slot's key may be cached anew elsewhere)
                known = known[: int(lost[0])]
            elif len(known) == limit:
                return limit
        start = len(known)
        found = np.fromiter(takewhile(bool, map(pmap.index.get, islice(keys, start, limit), repeat(0))), np.int64)
        missing = np.flatnonzero(lead[found] == 0)
        slots = np.concatenate([known, found[: int(missing[0])] if len(missing) else found])
        if len(self._last) >= self.MAX_CHAINS:
            self._last.clear()
        self._last[id(keys)] = (keys, slots, pmap.generation[slots])
        return len(slots)


_NO_SLOTS: Ids = np.zeros(0, np.int64)


def maps_for(groups: Sequence[KVCacheGroupSpec],
             num_blocks: int) -> tuple[list[PrefixMap], list[tuple[PrefixMap, int]]]:
    """The pool's prefix maps: one per block size, state groups apart (their columns, many in the
    multi-page layout, take slots only at checkpoints, not at every position the attention groups
    cache); and per group its map and its column there."""
    by_size: dict[tuple[int, bool], list[int]] = {}
    for g, spec in enumerate(groups):
        by_size.setdefault((spec.block_size, spec.kind is SpecKind.MAMBA), []).append(g)
    maps = [PrefixMap(ids, num_blocks) for ids in by_size.values()]
    for (size, _), pmap in zip(by_size, maps, strict=True):
        pmap.peers = tuple(m for (s, _), m in zip(by_size, maps, strict=True) if s == size)
    place = [(m, m.group_ids.index(g)) for g in range(len(groups)) for m in maps if g in m.group_ids]
    return maps, place
