"""The block tables of one KV cache group: what every per-type manager shares.

A manager knows its type's two rules and nothing about other groups:

- the *hit rule*: which prefix of a new request it can serve from cached blocks
  (`find_hits`), and
- the *keep rule*: which leading blocks a request no longer needs once `p` tokens precede the
  first token of a step (`first_needed_block(p)`); those positions hold the null block.

The rules per type are in `managers.py`. Tables are position-indexed: entry i covers tokens
[i*B, (i+1)*B), null (0) where not kept. A table is a numpy int64 array with room to grow (its
first `length` entries are the table), so the blocks a request releases (out-of-window entries,
its whole table when it finishes) go to the pool as one array slice, never as Python ints:

    ids:  | null ... null | real blocks ........ | (room)
          0    num_skipped ^        num_cached ^   ^ length

The coordinator drives every method in phases (count, release, touch hits, allocate, cache) so
that a refused allocation changes nothing; see `coordinator.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from operator import is_not, mul

import numpy as np

from hybridkv.core.block_pool import NULL, BlockPool
from hybridkv.core.eviction import Ids
from hybridkv.core.ids import BlockHash, RequestId
from hybridkv.core.planner import KVCacheGroupSpec
from hybridkv.core.request import KVRequest

HashMap = Mapping[BlockHash, int]  # hash -> block id
NEVER = 1 << 62  # a token count no request reaches
#: (tokens, block) of the state a step reads (None: from token 0), and of each state it writes.
StateEntries = tuple[tuple[int, int] | None, list[tuple[int, int]]]
EMPTY: Ids = np.zeros(0, np.int64)
EMPTY.flags.writeable = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Table:
    """One request's table in one group (see the module docstring)."""

    ids: Ids
    length: int
    num_cached: int  # leading entries whose full blocks are cached (or were hits)
    num_skipped: int  # leading entries known to be null
    num_hit_blocks: int  # leading entries that came from a prefix hit

    def grow(self, length: int) -> None:
        """Room for `length` entries (the array at least doubles when it must grow)."""
        if length > len(self.ids):
            ids = np.zeros(max(length, 2 * len(self.ids)), np.int64)
            ids[: self.length] = self.ids[: self.length]
            self.ids = ids


is_block = partial(is_not, None)


def held_prefix(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> int:
    """How many leading `keys` every map holds."""
    for m in maps:
        keys = keys[: sum(1 for _ in takewhile(is_block, map(m.get, keys)))]
    return len(keys)


def held_row(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> bytes:
    """Byte i is 1 where every map holds keys[i], else 0."""
    row = bytes(map(maps[0].__contains__, keys))
    for m in maps[1:]:
        row = bytes(map(mul, row, map(m.__contains__, keys)))
    return row


def all_hold(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> bool:
    """Whether every map holds every key."""
    return all(all(map(m.__contains__, keys)) for m in maps)



def leading_nulls(table: Table, start: int) -> int:
    """Index of the first real entry at or after `start` (the table's length if none)."""
    real = np.flatnonzero(table.ids[start : table.length])
    return start + int(real[0]) if len(real) else table.length


class SingleTypeManager(ABC):
    """Block tables of one group. Subclasses set the hit and keep rules."""

    #: A hit of length L implies hits of every shorter aligned length (full attention only).
    downward_closed = False
    #: A block cached in a step is hit only from the next step on (`refuses_hit`, `new_step`).
    defers_same_step_hits = False
    #: `first_needed_block` can be above 0 (False: `remove_skipped_blocks` never releases).
    skips_blocks = True

    def __init__(self, group: KVCacheGroupSpec, pool: BlockPool) -> None:
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self._pool = pool
        self._null = NULL
        self._cached = pool.cached_map(group.group_id)
        self._tables: dict[RequestId, Table] = {}

    @property
    def cached_map(self) -> HashMap:
        """This group's hash -> block map in the pool (read only)."""
        return self._cached

    # -- rules ----------------------------------------------------------------------------------

    @property
    def hit_rule(self) -> tuple[object, ...]:
        """Groups with equal `hit_rule` are looked up together (a block index hits only if it
        hits in every one of them)."""
        return (self.group.kind, self.block_size, self.group.window_tokens, self.group.chunk_tokens)

    @abstractmethod
    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        """Longest hit of at most `max_length` tokens that every map in `maps` can serve under
        this type's rule; one block list per map, null where the rule skips a block."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[int]:
        """This group's longest hit of at most `max_length` tokens (block list, null = skipped)."""
        return self.find_hits([self._cached], block_hashes, max_length)[0]

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first table entry still needed when `num_tokens` precede the step."""
        del num_tokens
        return 0

    def new_step(self) -> None:
        """A new scheduling step starts (state groups forget what was cached in the last one)."""
        return

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        """(F, T): an `allocate` of a running request whose step starts at `first_new <= F` and
        needs `total <= T` slots changes nothing in this group: no entry to add, none to
        release, no newly full block to cache (the decode fast path, see `coordinator.py`)."""
        table = self._tables[request_id]
        return (self.quiet_first(table.num_skipped),
                min(table.length, table.num_cached + 1) * self.block_size - 1)

    def quiet_first(self, num_skipped: int) -> int:
        """The largest `first_new` whose `first_needed_block` is at most `num_skipped`."""
        del num_skipped
        return NEVER

    def state_entries(self, request_id: RequestId, start: int, end: int) -> StateEntries | None:
        """Where a step computing tokens [start, end) reads and writes its state; None: this
        group keeps no state (attention)."""
        del request_id, start, end
        return None

    def refuses_hit(self, hits: Sequence[int]) -> bool:
        """Whether a new request may not use `hits` in this step (a state checkpoint cached in
        this step: its state is written only when the step runs)."""
        del hits
        return False

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        """Entries the table must have to hold `total_tokens` slots."""
        del request
        return cdiv(total_tokens, self.block_size)

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        """How many of the new entries [old_len, new_len) are real blocks (not null)."""
        del first_new
        return max(0, new_len - max(old_len, keep_from))

    def _fill(self, ids: Ids, old_len: int, new_len: int, keep_from: int, first_new: int,
              blocks: Sequence[int] | Ids) -> None:
        """Write the new entries [old_len, new_len) (zero on entry): null, then `blocks`
        (`_num_real` of them)."""
        del first_new
        start = max(old_len, keep_from)
        if new_len - start == 1:
            ids[start] = blocks[0]
        elif new_len > start:
            ids[start:new_len] = blocks

    # -- the phases the coordinator drives ------------------------------------------------------

    def blocks_upper_bound(self, request: KVRequest, hits: Sequence[int] | None,
                           first_new: int, total_tokens: int) -> int:
        """At least `get_num_blocks_to_allocate` (new blocks + every hit block, no release
        credit), without touching each block: when the pool has this many, the step fits."""
        keep_from = self.first_needed_block(first_new)
        new_len = self.table_length(request, total_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            old_len = len(hits) if hits else 0
            return self._num_real(old_len, new_len, keep_from, first_new) + max(0, old_len - keep_from)
        return self._num_real(table.length, new_len, keep_from, first_new)

    def get_num_blocks_to_allocate(self, request: KVRequest, hits: Sequence[int] | None,
                                   first_new: int, total_tokens: int) -> int:
        """Free-queue blocks this step takes (new blocks + free hit blocks) minus the blocks
        that `remove_skipped_blocks` will release to it."""
        keep_from = self.first_needed_block(first_new)
        new_len = self.table_length(request, total_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            need = self._num_real(len(hits) if hits else 0, new_len, keep_from, first_new)
            if hits and len(hits) > keep_from:  # the null block's ref count is never 0
                need += int((self._pool.ref_cnt[hits[keep_from:]] == 0).sum())
            return need
        need = self._num_real(table.length, new_len, keep_from, first_new)
        done = table.num_skipped
        if keep_from > done:
            need -= int((self._pool.ref_cnt[table.ids[done : min(keep_from, table.length)]] == 1).sum())
        return need

    def remove_skipped_blocks(self, request_id: RequestId, first_new: int) -> Ids:
        """Replace entries the request no longer needs by null; return the real blocks among
        them tail first (the caller frees them). Nothing to do without a table yet."""
        table = self._tables.get(request_id)
        if table is None:
            return EMPTY
        keep_from = min(self.first_needed_block(first_new), table.length)
        done = table.num_skipped
        if keep_from <= done:
            return EMPTY
        ids = table.ids
        released = ids[keep_from - 1 : done - 1 if done else None : -1].copy()
        ids[done:keep_from] = NULL
        table.num_skipped = keep_from
        if keep_from - done > 1 and not released.all():  # real blocks only (a Mamba table's gaps)
            released = released[released != NULL]
        return released

    def save_hits(self, request: KVRequest, hits: Sequence[int] | None, first_new: int) -> Sequence[int]:
        """Start the table of a new request with its hit blocks; no-op if running. Returns the
        hit blocks the table keeps, which the caller must `touch` (before any allocation)."""
        rid = request.request_id
        if rid in self._tables:
            assert not hits, "hits are only valid for a request without blocks"
            return []
        num_hits = len(hits) if hits else 0
        table = Table(ids=np.zeros(max(16, 2 * num_hits), np.int64), length=num_hits, num_cached=num_hits,
                      num_skipped=0, num_hit_blocks=num_hits)
        self._tables[rid] = table
        if not hits:
            return []
        keep_from = min(self.first_needed_block(first_new), num_hits)
        table.ids[keep_from:num_hits] = hits[keep_from:]
        table.num_skipped = skipped = leading_nulls(table, keep_from)
        return hits[skipped:]

    def num_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int) -> int:
        """Real blocks `allocate_new_blocks` needs for `total_tokens` slots (after `save_hits`)."""
        return self._num_real(self._tables[request.request_id].length, self.table_length(request, total_tokens),
                              self.first_needed_block(first_new), first_new)

    def allocate_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int,
                            blocks: Sequence[int] | Ids | None = None) -> Ids:
        """Extend the table to `total_tokens` slots with `blocks` (`num_new_blocks` of them,
        freshly allocated to this group; popped from the pool when None); return the new
        entries (null included; a view, valid until the table changes)."""
        if blocks is None:
            blocks = self._pool.allocate(self.num_new_blocks(request, first_new, total_tokens), self.group_id)
        table = self._tables[request.request_id]
        old_len = table.length
        new_len = self.table_length(request, total_tokens)
        if new_len <= old_len:
            return EMPTY
        table.grow(new_len)
        self._fill(table.ids, old_len, new_len, self.first_needed_block(first_new), first_new, blocks)
        table.length = new_len
        if table.num_skipped == old_len:
            table.num_skipped = leading_nulls(table, old_len)
        return table.ids[old_len:new_len]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the full, real blocks among the first `num_tokens` tokens not cached yet."""
        table = self._tables[request.request_id]
        num_full = num_tokens // self.block_size
        start = table.num_cached
        if num_full <= start:
            return
        self._pool.cache_blocks(self.group_id, table.ids, block_hashes, start, num_full, request.token_ids)
        table.num_cached = num_full

    def uncomputed_cached_blocks(self, request_id: RequestId, num_computed_tokens: int) -> list[int]:
        """Blocks this request cached (not its hits) that cover tokens at or beyond
        `num_computed_tokens`: allocated and cached for a step that has not run."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        start = max(table.num_hit_blocks, num_computed_tokens // self.block_size)
        if start >= table.num_cached:
            return []
        hashes = self._pool.block_hash
        return [b for b in table.ids[start : table.num_cached].tolist() if hashes[b] is not None]

    def free(self, request_id: RequestId) -> Ids:
        """Forget the request; return its table tail first (nulls included; the caller frees
        the blocks)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return EMPTY
        skipped = table.num_skipped
        return table.ids[table.length - 1 : skipped - 1 if skipped else None : -1]

    def block_table(self, request_id: RequestId) -> list[int] | None:
        """A copy of the request's table, None if it holds none in this group."""
        table = self._tables.get(request_id)
        return None if table is None else table.ids[: table.length].tolist()

    def tables(self) -> Mapping[RequestId, list[int]]:
        """Every request's table (copies), for integrity checks."""
        return {rid: table.ids[: table.length].tolist() for rid, table in self._tables.items()}

    def num_skipped(self, request_id: RequestId) -> int:
        """Leading entries of the request's table known to be null."""
        return self._tables[request_id].num_skipped
