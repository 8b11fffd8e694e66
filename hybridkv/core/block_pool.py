"""The block pool: every physical block, the free blocks, and the prefix-cache map.

One pool serves all KV cache groups; a block id belongs to one group at a time (its `group_id`
is set when it is allocated). Block 0 is the null block: the placeholder for positions a group
does not keep (tokens out of a sliding window, finished local-attention chunks, old Mamba
states). It is never freed, cached or evicted.

    blocks:  [ null | 1 | 2 | ... | num_blocks-1 ]
    free:    the eviction policy's queue of blocks with ref_cnt 0 (front = reused first)
    cached:  per group, block hash -> block   (the prefix-cache key is (hash, group))

- `allocate` pops blocks from the policy and drops any stale hash of a popped block (eviction).
- `touch` takes hit blocks back from the free queue and raises their ref count.
- `free` lowers ref counts in the order given (a request's tail first) and releases blocks that
  reach 0 to the policy; they keep their hash until reused, so they can still be hit.
- Identical content may be cached in two blocks (two requests computed it concurrently); the
  first stays in the map, later ones wait in a side table and are promoted when it is evicted.

The null block's ref count starts at `NULL_REF_CNT` and floats as null slots are touched and
released; it can never reach 0, which keeps `is null` tests out of the touch and free loops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import chain
from typing import TYPE_CHECKING

from hybridkv.core.errors import ConfigError, IntegrityError
from hybridkv.core.ids import BlockHash, BlockId, GroupId
from hybridkv.core.planner import KVCacheGroupSpec
from hybridkv.core.specs import SpecKind

if TYPE_CHECKING:
    from hybridkv.core.eviction import EvictionPolicy

__all__ = [
    "NULL_REF_CNT", "AllBlocksCleared", "Block", "BlockPool", "BlockRemoved", "BlockStored", "IntegrityError",
    "KVEvent", "KVEvents",
]

NULL_REF_CNT = 1 << 62


@dataclass(slots=True, eq=False)
class Block:
    """One physical block. `queue_pos` is the eviction policy's bookkeeping (where the block
    sits in the free queue while ref_cnt == 0)."""

    block_id: BlockId
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    group_id: int = -1
    queue_pos: int = field(default=-1, repr=False)


class KVEvents(Enum):
    """Whether the pool records KV events (for a connector or an external index)."""

    OFF = "off"
    ON = "on"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Contiguous full blocks of one group were cached; `parent_hash` precedes the first."""

    group_id: GroupId
    kind: SpecKind
    window_tokens: int
    block_size: int
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Cached blocks of one group were evicted (their content is gone)."""

    group_id: GroupId
    kind: SpecKind
    window_tokens: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def interleave(lists: Sequence[Sequence[Block]]) -> list[Block]:
    """`lists[0][0], lists[1][0], ..., lists[0][1], lists[1][1], ...`, skipping exhausted lists.

    Built from `zip` over the rows all remaining lists still have (a few slices per distinct
    length, no per-block test).
    """
    rest = [blocks for blocks in lists if blocks]
    if len(rest) == 1:
        return list(rest[0])
    out: list[Block] = []
    start = 0
    while rest:
        stop = min(map(len, rest))
        if len(rest) == 1:
            out += rest[0][start:]
            break
        out += chain.from_iterable(zip(*(blocks[start:stop] for blocks in rest), strict=True))
        rest = [blocks for blocks in rest if len(blocks) > stop]
        start = stop
    return out


class BlockPool:
    """All blocks of all groups; see the module docstring for the contract."""

    def __init__(
        self,
        *,
        num_blocks: int,
        groups: Sequence[KVCacheGroupSpec],
        policy_factory: Callable[[Sequence[Block]], EvictionPolicy],
        events: KVEvents = KVEvents.OFF,
    ) -> None:
        if num_blocks < 2:
            raise ConfigError(f"a block pool needs the null block and at least one usable block, "
                              f"got num_blocks={num_blocks}; expected >= 2")
        self.blocks = [Block(block_id=BlockId(i)) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = NULL_REF_CNT
        self._groups = tuple(groups)
        self._policy = policy_factory(self.blocks[1:])
        self._maps: list[dict[BlockHash, Block]] = [{} for _ in self._groups]
        self._dups: list[dict[BlockHash, list[Block]]] = [{} for _ in self._groups]
        self._used = [0] * len(self._groups)
        self._events_on = events is KVEvents.ON
        self._events: list[KVEvent] = []
        # Bumped whenever a cached hash disappears; a CacheHit taken at an equal count is valid.
        self.evictions = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (cached or not): what `allocate` can hand out."""
        return self._policy.num_free

    @property
    def usable_blocks(self) -> int:
        return len(self.blocks) - 1

    def cached_map(self, group_id: int) -> dict[BlockHash, Block]:
        """The hash -> block map of one group (read-only for callers; the managers' hit scans)."""
        return self._maps[group_id]

    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request."""
        return 1.0 - self._policy.num_free / self.usable_blocks

    def group_usage(self) -> tuple[int, ...]:
        """Blocks held by at least one request, per group."""
        return tuple(self._used)

    def free_order(self) -> list[BlockId]:
        """Free block ids in eviction order (front first)."""
        return [b.block_id for b in self._policy.ordered()]

    def take_events(self) -> list[KVEvent]:
        """Return and forget the events recorded since the last call."""
        events, self._events = self._events, []
        return events

    # -- hot path -----------------------------------------------------------------------------

    def allocate(self, num_blocks: int, group_id: int) -> list[Block]:
        """Pop `num_blocks` blocks for `group_id` (the caller checked `num_free`), ref count 1."""
        blocks = self._policy.pop(num_blocks)
        maps = self._maps
        dups = self._dups
        evicted = 0
        if not self._events_on and not any(dups):  # no copies anywhere: every hash maps to its block
            for block in blocks:
                if block.block_hash is not None:
                    del maps[block.group_id][block.block_hash]
                    block.block_hash = None
                    evicted += 1
                block.ref_cnt = 1
                block.group_id = group_id
            self.evictions += evicted
            self._used[group_id] += num_blocks
            return blocks
        events_on = self._events_on
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:  # evict: inlined `_drop_hash`, this is the hot loop
                old_group = block.group_id
                primary = maps[old_group].pop(block_hash)
                if primary is not block or block_hash in dups[old_group]:
                    self._evict_duplicate(block, primary)
                if events_on:
                    self._record_removed(block)
                block.block_hash = None
                evicted += 1
            block.ref_cnt = 1
            block.group_id = group_id
        self.evictions += evicted
        self._used[group_id] += num_blocks
        return blocks

    def touch(self, blocks: Sequence[Block], group_id: int) -> None:
        """Take hit blocks of `group_id`: raise ref counts, pull free ones out of the queue."""
        revived: list[Block] = []
        for block in blocks:
            if block.ref_cnt == 0:
                revived.append(block)
            block.ref_cnt += 1
        if revived:
            self._policy.remove(revived)
            self._used[group_id] += len(revived)

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference to each block, in order; release those that reach 0."""
        released: list[Block] = []
        used = self._used
        for block in blocks:
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if not ref_cnt:
                released.append(block)
                used[block.group_id] -= 1
        if released:
            self._policy.release(released)

    def free_tables(self, tables: Sequence[Sequence[Block]]) -> None:
        """Drop one reference to every block of `tables` (`tables[g]`: blocks of group g, tail
        first; null entries allowed) and release those that reach 0 position by position
        across groups: the k-th block from the tail of every group before the (k+1)-th of any.

        Releasing position k of every group before position k-1 of any makes the global LRU
        evict a position from all groups together, so identical groups do not lose hits one
        group at a time.
        """
        used = self._used
        shared = False  # some block is still held (or null): filter the release order
        for group_id, blocks in enumerate(tables):
            held = 0
            for block in blocks:
                ref_cnt = block.ref_cnt - 1
                block.ref_cnt = ref_cnt
                if ref_cnt:
                    held += 1
            if held:
                shared = True
            used[group_id] -= len(blocks) - held
        order = interleave(tables)
        if shared:
            order = [b for b in order if not b.ref_cnt]
        if order:
            self._policy.release(order)

    def cache_blocks(
        self,
        group_id: int,
        table: Sequence[Block],
        hashes: Sequence[BlockHash],
        start: int,
        end: int,
        token_ids: Sequence[int],
    ) -> None:
        """Cache the non-null blocks `table[start:end]` under `hashes[start:end]` in `group_id`."""
        if not self._cache_fresh(group_id, table[start:end], hashes[start:end]):
            cached = self._maps[group_id]
            null = self.null_block
            for block, block_hash in zip(table[start:end], hashes[start:end], strict=True):
                if block is null or block.block_hash is not None:
                    continue
                block.block_hash = block_hash
                if cached.setdefault(block_hash, block) is not block:
                    self._dups[group_id].setdefault(block_hash, []).append(block)
        if self._events_on:
            self._record_stored(group_id, table, hashes, start, end, token_ids)

    def _cache_fresh(self, group_id: int, blocks: Sequence[Block], keys: Sequence[BlockHash]) -> bool:
        """The common case in bulk: real blocks without a hash under hashes new to the group
        (and distinct); False (nothing done) otherwise."""
        cached = self._maps[group_id]
        if len(blocks) != len(keys) or self.null_block in blocks or not cached.keys().isdisjoint(keys):
            return False
        for block in blocks:
            if block.block_hash is not None:
                return False
        size = len(cached)
        cached.update(zip(keys, blocks, strict=True))
        if len(cached) != size + len(keys):  # a hash repeats within `keys`: undo, go one by one
            for key in keys:
                cached.pop(key, None)
            return False
        for block, key in zip(blocks, keys, strict=True):
            block.block_hash = key
        return True

    def uncache(self, blocks: Sequence[Block]) -> None:
        """Drop the cached hash of `blocks` (held blocks whose KV was never written, e.g. a step
        that was allocated and then preempted): no later lookup can hit them, a `BlockRemoved`
        event is recorded, and hits taken before are re-verified (`evictions` grows)."""
        for block in blocks:
            if block.block_hash is not None:
                self._drop_hash(block)

    # -- slow path ----------------------------------------------------------------------------

    def _drop_hash(self, block: Block) -> None:
        """Remove `block` (which carries a hash) from its group's cache tables."""
        block_hash = block.block_hash
        assert block_hash is not None
        group_id = block.group_id
        primary = self._maps[group_id].pop(block_hash)
        if primary is not block or block_hash in self._dups[group_id]:
            self._evict_duplicate(block, primary)
        if self._events_on:
            self._record_removed(block)
        block.block_hash = None
        self.evictions += 1

    def _evict_duplicate(self, block: Block, primary: Block) -> None:
        """Finish evicting `block` when its hash has copies; `primary` was just popped from the
        map. A waiting copy becomes the primary; an evicted copy leaves the waiting list."""
        block_hash = block.block_hash
        assert block_hash is not None
        cached = self._maps[block.group_id]
        dups = self._dups[block.group_id]
        waiting = dups[block_hash]
        if primary is block:
            cached[block_hash] = waiting.pop(0)
        else:
            cached[block_hash] = primary
            waiting.remove(block)
        if not waiting:
            del dups[block_hash]

    def _record_removed(self, block: Block) -> None:
        spec = self._groups[block.group_id]
        assert block.block_hash is not None
        self._events.append(BlockRemoved(group_id=GroupId(block.group_id), kind=spec.kind,
                                         window_tokens=spec.window_tokens, block_hashes=(block.block_hash,)))

    def _record_stored(self, group_id: int, table: Sequence[Block], hashes: Sequence[BlockHash],
                       start: int, end: int, token_ids: Sequence[int]) -> None:
        spec = self._groups[group_id]
        size = spec.block_size
        run_start = start
        for i in range(start, end + 1):
            if i < end and table[i] is not self.null_block:
                continue
            if i > run_start:
                self._events.append(BlockStored(
                    group_id=GroupId(group_id), kind=spec.kind, window_tokens=spec.window_tokens,
                    block_size=size, block_hashes=tuple(hashes[run_start:i]),
                    parent_hash=hashes[run_start - 1] if run_start else None,
                    token_ids=tuple(token_ids[run_start * size : i * size]),
                ))
            run_start = i + 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block but null is in use."""
        if self._policy.num_free != self.usable_blocks:
            return False
        for cached, dups in zip(self._maps, self._dups, strict=True):
            cached.clear()
            dups.clear()
        for block in self.blocks:
            block.block_hash = None
        self.evictions += 1
        if self._events_on:
            self._events.append(AllBlocksCleared())
        return True

    def check_integrity(self, expected_refs: Mapping[int, int]) -> None:
        """Raise `IntegrityError` with the actual numbers if any pool invariant is broken.

        `expected_refs[block_id]` is how many request tables hold the block (the managers
        count them); every other non-null block must be free.
        """
        free = self._policy.ordered()
        free_ids = [b.block_id for b in free]
        if len(free) != self._policy.num_free:
            raise IntegrityError(f"free queue holds {len(free)} blocks but num_free says {self._policy.num_free}")
        repeated = [i for i, n in Counter(free_ids).items() if n > 1]
        if repeated:
            raise IntegrityError(f"blocks {repeated[:10]} appear twice in the free queue")
        free_set = set(free_ids)
        if 0 in free_set or self.null_block.block_hash is not None:
            raise IntegrityError("the null block is in the free queue or carries a hash")
        used = [0] * len(self._groups)
        for block in self.blocks[1:]:
            want = expected_refs.get(block.block_id, 0)
            if block.ref_cnt != want:
                raise IntegrityError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but {want} request tables hold it"
                )
            if (block.ref_cnt == 0) != (block.block_id in free_set):
                raise IntegrityError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but is "
                    f"{'in' if block.block_id in free_set else 'not in'} the free queue"
                )
            if block.ref_cnt:
                used[block.group_id] += 1
        if used != self._used:
            raise IntegrityError(f"blocks in use per group are {used} but the counters say {self._used}")
        self._check_maps()

    def _check_maps(self) -> None:
        entries = 0
        for group_id, cached in enumerate(self._maps):
            for block_hash, block in cached.items():
                if block.block_hash != block_hash or block.group_id != group_id or block is self.null_block:
                    raise IntegrityError(
                        f"cache map of group {group_id} points at block {block.block_id} of group "
                        f"{block.group_id} whose hash does not match its key"
                    )
            entries += len(cached)
        for group_id, dups in enumerate(self._dups):
            for block_hash, waiting in dups.items():
                if block_hash not in self._maps[group_id] or not waiting:
                    raise IntegrityError(f"duplicate table of group {group_id} has no primary block or no copies")
                for block in waiting:
                    if block.block_hash != block_hash or block.group_id != group_id:
                        raise IntegrityError(f"duplicate block {block.block_id} does not carry its key")
                entries += len(waiting)
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if hashed != entries:
            raise IntegrityError(f"{hashed} blocks carry a hash but the cache tables hold {entries} entries")
