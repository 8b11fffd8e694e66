"""The block tables of the KV cache groups of one hit rule: what every per-type manager shares.

A manager knows its type's two rules and nothing about other groups:

- the *hit rule*: which prefix of a new request it can serve from cached blocks
  (`find_hits`), and
- the *keep rule*: which leading blocks a request no longer needs once `p` tokens precede the
  first token of a step (`first_needed_block(p)`); those positions hold the null block.

The rules per type are in `managers.py`. One manager serves every group of one hit rule
(e.g. Gemma 3's five identical sliding-window groups): their tables have the same shape for a
request (same length, same null entries, same cached prefix; only the block ids differ), so a
request's tables in those groups are the rows of one numpy int64 array, and every step is one
set of integer tests and array slices for all of them, not one per group.

Tables are position-indexed: entry i covers tokens [i*B, (i+1)*B), null (0) where not kept.
The array has room to grow (its first `length` columns are the tables), so the blocks a request
releases (out-of-window entries, its whole tables when it finishes) go to the pool as array
slices, never as Python ints:

    ids[row]:  | null ... null | real blocks ........ | (room)
               0    num_skipped ^        num_cached ^   ^ length

The coordinator drives every method in phases (count, release, touch hits, allocate, cache) so
that a refused allocation changes nothing; see `coordinator.py`.

Partial hits (`partial_unit`, set on the full-attention and state managers when a prefix_match_unit
below the block makes hits land inside blocks; docs/prefix_caching.md): a hit ending inside
entry i leaves the request a private copy of that block (`apply_cow`); the prompt's last
`partial_unit` boundary T (when it falls inside a block) is registered as a partial entry on the
block holding it (`_register_tail`), and a state manager's own running block is then copied once
more at the next step (`producer_cow`), since that step overwrites the state at T.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.eviction import BlockMarks, BlockValue, Ids
from hybridkv.kvcache.hit_limits import HitLimit, limit_of_fate
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.prefix_map import Fate, GroupsView
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheGroupSpec

NEVER = 1 << 62  # a token count no request reaches
#: (tokens, block) of the state a step reads (None: from token 0), and of each state it writes.
StateEntries = tuple[tuple[int, int] | None, list[tuple[int, int]]]
EMPTY: Ids = np.zeros(0, np.int64)
EMPTY.flags.writeable = False


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Table:
    """One request's tables in the groups of one manager: row i = group `group_ids[i]`."""

    ids: Ids  # (groups, capacity)
    length: int
    num_cached: int  # leading entries whose full blocks are cached (or were hits)
    num_skipped: int  # leading entries known to be null in every row
    num_hit_blocks: int  # leading entries that came from a prefix hit

    def grow(self, length: int) -> None:
        """Room for `length` entries (when it must grow, the array at least doubles, with room
        for 32 more entries: a decode step rarely copies it). The leading null entries are not copied:
        the new array's untouched zero pages take no memory (a running state's table in the multi-page
        layout: hundreds of page groups x thousands of entries, all null but the last)."""
        capacity = self.ids.shape[1]
        if length > capacity:
            ids = np.zeros((len(self.ids), max(length + 32, 2 * capacity)), np.int64)
            ids[:, self.num_skipped : self.length] = self.ids[:, self.num_skipped : self.length]
            self.ids = ids


def leading_nulls(table: Table, start: int) -> int:
    """Index of the first entry at or after `start` that is real in some row (the length if none)."""
    real = np.flatnonzero(table.ids[:, start : table.length].any(axis=0))
    return start + int(real[0]) if len(real) else table.length


#: Hit blocks per group of one manager (row i: group `group_ids[i]`), or None: no hit.
ClassHits = Sequence[Sequence[int]] | None


class SingleTypeManager(ABC):
    """Block tables of the groups of one hit rule. Subclasses set the hit and keep rules."""

    #: A hit of length L implies hits of every shorter aligned length (full attention only).
    downward_closed = False
    #: A block cached in a step is hit only from the next step on (`refuses_hit`, `new_step`).
    defers_same_step_hits = False
    #: `first_needed_block` can be above 0 (False: `remove_skipped_blocks` never releases).
    skips_blocks = True
    #: The table rules of this base class hold: `table_length` is cdiv(slots, B), new entries are
    #: null before `first_needed_block` and real from there, `cache_blocks` caches every full
    #: block. The coordinator's decode path (`KVCacheCoordinator.decode`) serves only such managers.
    plain_tables = True
    #: The hit rule reads its blocks right to left (sliding window, state checkpoints).
    reads_from_right = False
    #: A recurrent-state group (Mamba, GDN): its blocks are checkpoints.
    is_state = False
    #: A hit is copied into a fresh block before the step (`RunningState.FIXED`, `running_state.py`).
    copies_hits = False

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool) -> None:
        groups = (group,) if isinstance(group, KVCacheGroupSpec) else tuple(group)
        self.groups = groups
        self.group = groups[0]  # the rule's parameters (every group of the manager has the same)
        self.group_ids = tuple(g.group_id for g in groups)
        self.group_id = self.group_ids[0]
        self.num_groups = len(groups)
        self.block_size = self.group.block_size
        self._pool = pool
        #: a value-aware eviction policy's marking verbs (`eviction.BlockMarks`), None with LRU: set once
        #: by the manager that builds this one
        self.marks: BlockMarks | None = None
        self._null = NULL
        self.view = pool.groups_view(self.group_ids)
        self._tables: dict[RequestId, Table] = {}
        #: the running requests' tables (read and advanced by the coordinator's decode path)
        self.table_of: Mapping[RequestId, Table] = self._tables
        self._nothing: Ids = np.zeros((self.num_groups, 0), np.int64)
        #: hits may end inside a block every `partial_unit` tokens (0: on block boundaries only)
        self.partial_unit = 0
        self._tail: dict[RequestId, int] = {}  # the prompt's partial boundary, not registered yet
        self._registered: dict[RequestId, int] = {}  # the partial boundary registered
        self._producer_cow: dict[RequestId, tuple[int, list[int]]] = {}  # (entry, block per group)

    # -- rules ----------------------------------------------------------------------------------

    @property
    def hit_rule(self) -> tuple[object, ...]:
        """Groups with equal `hit_rule` share one manager and are looked up together (a block
        index hits only if it hits in every one of them)."""
        return rule_of(self.group)

    @abstractmethod
    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        """Longest hit of at most `max_length` tokens that every group of `view` can serve under
        this type's rule; one block list per group, null where the rule skips a block."""

    def find_hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]],
                        max_length: int) -> tuple[list[list[int]], int]:
        """`find_hits` over the request's hash chains (`hashes[size]`) and the hit's length in
        tokens (a partial-hit manager may end it inside its last block)."""
        hits = self.find_hits(view, hashes[self.block_size], max_length)
        return hits, len(hits[0]) * self.block_size

    def hit_block_ids(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]], num_tokens: int) -> list[int]:
        """The blocks (every group, nulls left out) of a hit of `num_tokens` every group serves."""
        return [b for blocks in self.find_hits(view, hashes[self.block_size], num_tokens) for b in blocks if b]

    def hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]], max_length: int) -> int:
        """The length in tokens of `find_hit_tokens`' hit, without its block lists (a probe)."""
        return self.find_hit_tokens(view, hashes, max_length)[1]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_length: int) -> list[int]:
        """The first group's longest hit of at most `max_length` tokens (block list, null = skipped)."""
        return self.find_hits(self.view.lead(), block_hashes, max_length)[0]

    def first_needed_block(self, num_tokens: int) -> int:
        """Index of the first table entry still needed when `num_tokens` precede the step."""
        del num_tokens
        return 0

    def new_step(self) -> None:
        """A new scheduling step starts (state groups forget what was cached in the last one)."""
        return

    def checkpoint_blocks(self, total_tokens: int) -> int:
        """Blocks a new request's first step ending at `total_tokens` takes besides its table
        (`RunningState.FIXED`: its checkpoint); 0 elsewhere."""
        del total_tokens
        return 0

    def reclaim(self, num_blocks: int) -> None:
        """Give back up to `num_blocks` blocks held only for this schedule (`RunningState.FIXED`'s
        checkpoints); no-op elsewhere."""
        del num_blocks

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        """(F, T): an `allocate` of a running request whose step starts at `first_new <= F` and
        needs `total <= T` slots changes nothing in these groups: no entry to add, none to
        release, no newly full block to cache (the decode fast path, see `coordinator.py`)."""
        table = self._tables[request_id]
        last = min(table.length, table.num_cached + 1) * self.block_size - 1
        if self.partial_unit:
            if request_id in self._producer_cow:  # the next allocate copies the running block
                return -1, -1
            tail = self._tail.get(request_id)
            if tail is not None:  # the step that reaches it registers the partial entry
                last = min(last, tail - 1)
        return self.quiet_first(table.num_skipped), last

    def quiet_first(self, num_skipped: int) -> int:
        """The largest `first_new` whose `first_needed_block` is at most `num_skipped`."""
        del num_skipped
        return NEVER

    def state_entries(self, request_id: RequestId, row: int, start: int, end: int) -> StateEntries | None:
        """Where a step computing tokens [start, end) reads and writes the state of group
        `group_ids[row]`; None: these groups keep no state (attention)."""
        del request_id, row, start, end
        return None

    def refuses_hit(self, hits: Sequence[Sequence[int]]) -> bool:
        """Whether a new request may not use `hits` (per group) in this step (a state checkpoint
        cached in this step: its state is written only when the step runs)."""
        del hits
        return False

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        """Entries the tables must have to hold `total_tokens` slots."""
        del request
        return cdiv(total_tokens, self.block_size)

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        """How many of the new entries [old_len, new_len) of a row are real blocks (not null)."""
        del first_new
        return max(0, new_len - max(old_len, keep_from))

    def _fill(self, ids: Ids, old_len: int, new_len: int, keep_from: int, first_new: int, blocks: Ids) -> None:
        """Write the new entries [old_len, new_len) of every row (zero on entry): null, then the
        row's `blocks` (`_num_real` of them; `blocks` is (groups, that many))."""
        del first_new
        ids[:, max(old_len, keep_from) : new_len] = blocks

    # -- the phases the coordinator drives ------------------------------------------------------

    def blocks_upper_bound(self, request: KVRequest, hits: ClassHits, first_new: int, total_tokens: int) -> int:
        """At least `get_num_blocks_to_allocate` (new blocks + every hit block, no release
        credit), over all groups, without touching each block: when the pool has this many,
        the step fits. For a running request it is exactly its new blocks."""
        keep_from = self.first_needed_block(first_new)
        new_len = self.table_length(request, total_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            old_len = len(hits[0]) if hits else 0
            one = self._num_real(old_len, new_len, keep_from, first_new) + max(0, old_len - keep_from)
        else:
            one = self._num_real(table.length, new_len, keep_from, first_new)
        return one * self.num_groups

    def get_num_blocks_to_allocate(self, request: KVRequest, hits: ClassHits, first_new: int,
                                   total_tokens: int) -> int:
        """Free-queue blocks this step takes in these groups (new blocks + free hit blocks)
        minus the blocks that `remove_skipped_blocks` will release to it."""
        keep_from = self.first_needed_block(first_new)
        new_len = self.table_length(request, total_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            old_len = len(hits[0]) if hits else 0
            need = self._num_real(old_len, new_len, keep_from, first_new) * self.num_groups
            if hits and old_len > keep_from:  # the null block's ref count is never 0 (one gather for all rows)
                tails = np.fromiter(chain.from_iterable(row[keep_from:] for row in hits), np.int64)
                need += int(np.count_nonzero(self._pool.ref_cnt[tails] == 0))
            return need
        need = self._num_real(table.length, new_len, keep_from, first_new) * self.num_groups
        done = table.num_skipped
        if keep_from > done:
            need -= int((self._pool.ref_cnt[table.ids[:, done : min(keep_from, table.length)]] == 1).sum())
        return need

    def remove_skipped_blocks(self, request_id: RequestId, first_new: int) -> Ids:
        """Replace entries the request no longer needs by null; return them, (groups, n), each
        row tail first, without the columns that are null in every row (the caller frees them).
        Nothing to do without a table yet."""
        table = self._tables.get(request_id)
        if table is None:
            return self._nothing
        keep_from = min(self.first_needed_block(first_new), table.length)
        done = table.num_skipped
        if keep_from <= done:
            return self._nothing
        ids = table.ids
        released = ids[:, keep_from - 1 : done - 1 if done else None : -1].copy()
        ids[:, done:keep_from] = NULL
        table.num_skipped = keep_from
        # real blocks only (a Mamba table's gaps)
        if keep_from - done > 1 and np.count_nonzero(released[0]) != released.shape[1]:
            released = released[:, released.any(axis=0)]
        return released

    def save_hits(self, request: KVRequest, hits: ClassHits, first_new: int) -> list[Sequence[int]]:
        """Start the tables of a new request with its hit blocks (per group); no-op if running.
        Returns, per group, the hit blocks the table keeps, which the caller must `touch`
        (before any allocation)."""
        rid = request.request_id
        if rid in self._tables:
            assert not hits, "hits are only valid for a request without blocks"
            return [[]] * self.num_groups
        num_hits = len(hits[0]) if hits else 0
        table = Table(ids=np.zeros((self.num_groups, max(16, 2 * num_hits)), np.int64), length=num_hits,
                      num_cached=num_hits, num_skipped=0, num_hit_blocks=num_hits)
        self._tables[rid] = table
        if self.partial_unit:
            tail = self.tail_boundary(request)
            if tail:
                self._tail[rid] = tail
        if not hits:
            return [[]] * self.num_groups
        keep_from = min(self.first_needed_block(first_new), num_hits)
        ids = table.ids
        for i, row in enumerate(hits):
            ids[i, keep_from:num_hits] = row[keep_from:]
        table.num_skipped = skipped = leading_nulls(table, keep_from)
        return [row[skipped:] for row in hits]

    def limit_at(self, block_hashes: Sequence[BlockHash], num_tokens: int, hit_tokens: int, *,
                 window_too: bool = True) -> HitLimit | None:
        """Why these groups cannot serve a hit of exactly `num_tokens` tokens (a multiple of the
        block size within the hashed blocks), or None when they can (`hit_limits.py`). They served
        `hit_tokens`: a downward-closed rule holds every block below it. Without `window_too` a
        right-to-left rule whose last block is held answers None unchecked (another group already
        stopped the hit there)."""
        end = num_tokens // self.block_size
        view = self.view
        if self.reads_from_right:  # the block ending at num_tokens decides; before it, the window
            fate = view.lacks(block_hashes[end - 1])
            if fate is None:
                start = self.first_needed_block(num_tokens) if window_too else end
                if end - start < 2:
                    return None
                return HitLimit.WINDOW if view.held(block_hashes[start : end - 1])[0].find(0) >= 0 else None
        else:  # the first block not held (usually the only one: a hit stops one block short)
            start = self.first_needed_block(num_tokens) if self.skips_blocks else 0
            if self.downward_closed:
                start = max(start, hit_tokens // self.block_size)
            for key in block_hashes[start:end]:
                fate = view.lacks(key)
                if fate is not None:
                    break
            else:
                return None
        if fate is Fate.NEVER:  # (the common answers without a call: lookups count every time)
            return HitLimit.NEVER_CACHED
        if fate is Fate.EVICTED:
            return HitLimit.EVICTED
        return limit_of_fate(fate, state_group=self.is_state, caches_every_block=self.plain_tables or self.is_state)

    def num_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int) -> int:
        """Real blocks `allocate_new_blocks` needs per group for `total_tokens` slots (after
        `save_hits`)."""
        return self._num_real(self._tables[request.request_id].length, self.table_length(request, total_tokens),
                              self.first_needed_block(first_new), first_new)

    def allocate_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int,
                            blocks: Sequence[Sequence[int] | Ids] | Ids | None = None) -> Ids:
        """Extend the tables to `total_tokens` slots with `blocks` (per group, `num_new_blocks`
        each, freshly allocated to that group; popped from the pool when None); return the new
        entries, (groups, n) (null included; a view, valid until the tables change)."""
        table = self._tables[request.request_id]
        old_len = table.length
        new_len = self.table_length(request, total_tokens)
        if new_len <= old_len:
            return self._nothing
        count = self.num_new_blocks(request, first_new, total_tokens)
        if blocks is None:
            counts = [0] * self._pool.num_groups
            for g in self.group_ids:
                counts[g] = count
            fresh = self._pool.allocate(counts)
            blocks = [fresh[g] for g in self.group_ids]
        table.grow(new_len)
        if count:
            block_rows = np.array(blocks, np.int64).reshape(self.num_groups, count)
            self._fill(table.ids, old_len, new_len, self.first_needed_block(first_new), first_new, block_rows)
        table.length = new_len
        if table.num_skipped == old_len:
            table.num_skipped = leading_nulls(table, old_len)
        return table.ids[:, old_len:new_len]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the full, real blocks among the first `num_tokens` tokens not cached yet."""
        table = self._tables[request.request_id]
        num_full = num_tokens // self.block_size
        start = table.num_cached
        if num_full <= start:
            return
        self._pool.cache(self.group_ids, table.ids, block_hashes, start, num_full, request.token_ids)
        table.num_cached = num_full

    def uncomputed_cached_blocks(self, request_id: RequestId, num_computed_tokens: int) -> list[int]:
        """Blocks this request cached (not its hits) that cover tokens at or beyond
        `num_computed_tokens`: allocated and cached for a step that has not run."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        tail = self._registered.get(request_id, 0)
        out = []
        if num_computed_tokens < tail and tail // self.block_size < table.length:  # its partial entry, unwritten
            out = [b for b in table.ids[:, tail // self.block_size].tolist() if self._pool.partial.key(b) is not None]
        start = max(table.num_hit_blocks, num_computed_tokens // self.block_size)
        if start >= table.num_cached:
            return out
        has_hash = self._pool.has_hash
        return out + [b for b in table.ids[:, start : table.num_cached].ravel().tolist() if has_hash[b]]

    def anchor_checkpoint(self, request_id: RequestId, index: int, value: BlockValue, share: float) -> bool:
        """Mark the request's checkpoint at table entry `index` as `value` where it is not a table entry
        of its own (a manager that copies checkpoints out of one running state); False: nothing done,
        the caller marks the table's blocks."""
        del request_id, index, value, share
        return False

    def free(self, request_id: RequestId) -> Ids:
        """Forget the request; return its tables, (groups, n), each row tail first (nulls
        included; the caller frees the blocks)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return self._nothing
        if self.partial_unit:
            self._tail.pop(request_id, None)
            self._registered.pop(request_id, None)
            self._producer_cow.pop(request_id, None)
        skipped = table.num_skipped
        return table.ids[:, table.length - 1 : skipped - 1 if skipped else None : -1]

    # -- partial hits (module docstring) --------------------------------------------------------

    def tail_boundary(self, request: KVRequest) -> int:
        """The prompt's last `partial_unit` boundary a resend can hit (at most prompt - 1 tokens)
        when it falls inside a block, else 0."""
        unit = self.partial_unit
        prompt = request.num_prompt_tokens if request.num_prompt_tokens is not None else request.num_tokens
        tail = (prompt - 1) // unit * unit
        return tail if tail % self.block_size else 0

    def apply_cow(self, request_id: RequestId, index: int, blocks: Sequence[int]) -> None:
        """Entry `index` of a new request's tables becomes its private copy `blocks[i]` (per group)
        of the partially hit block; the copy is cached again once full."""
        table = self._tables[request_id]
        table.ids[:, index] = blocks
        table.num_cached = min(table.num_cached, index)
        table.num_hit_blocks = min(table.num_hit_blocks, index)

    def producer_cow(self, request_id: RequestId) -> tuple[int, list[int]] | None:
        """(entry, blocks per group) whose partial entry the request's next step must move to a
        copy before it overwrites them (state managers); None otherwise."""
        return self._producer_cow.get(request_id) if self._producer_cow else None

    def producer_copied(self, request_id: RequestId, copies: Sequence[int]) -> None:
        """The partial entry of `producer_cow` moved to `copies` (per group)."""
        del copies
        self._producer_cow.pop(request_id, None)

    def _register_tail(self, request: KVRequest, num_tokens: int, *, exact: bool) -> tuple[int, list[int]] | None:
        """Register the prompt's partial boundary T on the blocks holding it once `num_tokens`
        reaches it (`exact`: only when it ends there, a state's checkpoint); (entry, blocks per
        group) when registered now."""
        rid = request.request_id
        tail = self._tail.get(rid)
        if tail is None or tail > num_tokens:
            return None
        del self._tail[rid]
        table = self._tables[rid]
        index = tail // self.block_size
        if (exact and tail != num_tokens) or index >= table.length:
            return None
        key = request.block_hashes[self.partial_unit][tail // self.partial_unit - 1]
        blocks = table.ids[:, index].tolist()
        cached = [self._pool.partial.cache(g, b, key) for g, b in zip(self.group_ids, blocks, strict=True)]
        if not any(cached):
            return None
        self._registered[rid] = tail
        return index, blocks

    def block_table(self, request_id: RequestId, row: int = 0) -> list[int] | None:
        """A copy of the request's table in group `group_ids[row]`, None if it holds none."""
        table = self._tables.get(request_id)
        return None if table is None else table.ids[row, : table.length].tolist()

    def tables(self, row: int = 0) -> Mapping[RequestId, list[int]]:
        """Every request's table in group `group_ids[row]` (copies), for integrity checks."""
        return {rid: table.ids[row, : table.length].tolist() for rid, table in self._tables.items()}

    def num_skipped(self, request_id: RequestId) -> int:
        """Leading entries of the request's tables known to be null."""
        return self._tables[request_id].num_skipped


def rule_of(group: KVCacheGroupSpec) -> tuple[object, ...]:
    """What decides a group's hit and keep rules (groups with equal rules share a manager)."""
    return (group.kind, group.block_size, group.window_tokens, group.chunk_tokens)
