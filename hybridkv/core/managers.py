"""One manager per attention type: the block table of every request in one KV cache group.

A manager knows its type's two rules and nothing about other groups:

- the *hit rule*: which prefix of a new request it can serve from cached blocks
  (`find_longest_cache_hit`), and
- the *keep rule*: which leading blocks a request no longer needs once `p` tokens precede the
  first token of a step (`first_needed_block(p)`); those positions hold the null block.

    type            hit rule (scan)                              keep from block
    full            left to right, stop at the first miss        0
    sliding (W)     right to left, ceil((W-1)/B) contiguous      (p - W + 1) // B
    chunked (C)     blocks before the chunk of L are null; scan  (p // C * C) // B
                    the current chunk left to right
    mamba, align    right to left, the last cached checkpoint    ceil(p / B) - 1
    mamba, all      right to left, the last cached checkpoint    ceil(p / B) - 1
    mamba, none     never hits; one block for the running state  0
    cross           never hits, never cached                     0

Tables are position-indexed: entry i covers tokens [i*B, (i+1)*B), null where not kept. The
coordinator drives every method in phases (count, release, touch hits, allocate, cache) so
that a refused allocation changes nothing; see `coordinator.py`.

Mamba, align mode: the state is written only at the end of a step, into the last entry of
the table; entry `ceil(p/B) - 1` holds the state after `p` tokens (read by the next step). A
step that ends on a block boundary T leaves a checkpoint in entry T/B - 1, which is cached under
the hash of that block. Only those two entries are real blocks; every other entry is null.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from enum import Enum
from functools import partial
from itertools import takewhile
from operator import is_not, mul, not_

from hybridkv.core.block_pool import NULL, BlockPool
from hybridkv.core.errors import ConfigError
from hybridkv.core.ids import BlockHash, RequestId
from hybridkv.core.planner import KVCacheGroupSpec
from hybridkv.core.request import KVRequest
from hybridkv.core.specs import SpecKind

HashMap = Mapping[BlockHash, int]  # hash -> block id
NEVER = 1 << 62  # a token count no request reaches
#: (tokens, block) of the state a step reads (None: from token 0), and of each state it writes.
StateEntries = tuple[tuple[int, int] | None, list[tuple[int, int]]]


class MambaMode(Enum):
    """ALIGN: a checkpoint where a step ends on a block boundary. ALL: a checkpoint at every
    block boundary a step crosses. NONE (prefix caching off): one running state."""

    ALIGN = "align"
    ALL = "all"
    NONE = "none"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        self._tables: dict[RequestId, list[int]] = {}  # block ids, 0 = null
        self._num_cached: dict[RequestId, int] = {}
        self._num_skipped: dict[RequestId, int] = {}
        self._num_hit_blocks: dict[RequestId, int] = {}

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
        size = self.block_size
        return (self.quiet_first(self._num_skipped[request_id]),
                min(len(self._tables[request_id]), self._num_cached[request_id] + 1) * size - 1)

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
        return _cdiv(total_tokens, self.block_size)

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        """How many of the new entries [old_len, new_len) are real blocks (not null)."""
        del first_new
        return max(0, new_len - max(old_len, keep_from))

    def _new_entries(self, old_len: int, new_len: int, keep_from: int, first_new: int,
                     blocks: list[int]) -> list[int]:
        """The new entries [old_len, new_len): null, then `blocks` (`_num_real` of them)."""
        if new_len <= old_len:
            return []
        return [self._null] * (max(old_len, keep_from) - old_len) + blocks

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
        return self._num_real(len(table), new_len, keep_from, first_new)

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
        need = self._num_real(len(table), new_len, keep_from, first_new)
        done = self._num_skipped[request.request_id]
        if keep_from > done:
            need -= int((self._pool.ref_cnt[table[done:keep_from]] == 1).sum())
        return need

    def remove_skipped_blocks(self, request_id: RequestId, first_new: int) -> list[int]:
        """Replace entries the request no longer needs by null; return them tail first (the
        caller frees them). Nothing to do for a request without a table yet."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        keep_from = min(self.first_needed_block(first_new), len(table))
        done = self._num_skipped[request_id]
        if keep_from <= done:
            return []
        released = table[done:keep_from]
        if NULL in released:
            released = [b for b in released if b]
        released.reverse()
        table[done:keep_from] = [NULL] * (keep_from - done)
        self._num_skipped[request_id] = keep_from
        return released

    def save_hits(self, request: KVRequest, hits: Sequence[int] | None, first_new: int) -> list[int]:
        """Start the table of a new request with its hit blocks; no-op if running. Returns the
        hit blocks the table keeps, which the caller must `touch` (before any allocation)."""
        rid = request.request_id
        if rid in self._tables:
            assert not hits, "hits are only valid for a request without blocks"
            return []
        table = list(hits) if hits else []
        keep_from = min(self.first_needed_block(first_new), len(table))
        if keep_from:
            table[:keep_from] = [self._null] * keep_from
        skipped = self._leading_nulls(table, 0)
        self._tables[rid] = table
        self._num_cached[rid] = len(table)
        self._num_hit_blocks[rid] = len(table)
        self._num_skipped[rid] = skipped
        return table[skipped:] if skipped else table

    def num_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int) -> int:
        """Real blocks `allocate_new_blocks` needs for `total_tokens` slots (after `save_hits`)."""
        return self._num_real(len(self._tables[request.request_id]), self.table_length(request, total_tokens),
                              self.first_needed_block(first_new), first_new)

    def allocate_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int,
                            blocks: list[int] | None = None) -> list[int]:
        """Extend the table to `total_tokens` slots with `blocks` (`num_new_blocks` of them,
        freshly allocated to this group; popped from the pool when None); return the new
        entries (null included)."""
        rid = request.request_id
        if blocks is None:
            blocks = self._pool.allocate(self.num_new_blocks(request, first_new, total_tokens), self.group_id)
        table = self._tables[rid]
        old_len = len(table)
        new = self._new_entries(old_len, self.table_length(request, total_tokens),
                                self.first_needed_block(first_new), first_new, blocks)
        table += new
        if new and self._num_skipped[rid] == old_len:
            self._num_skipped[rid] = self._leading_nulls(table, old_len)
        return new

    def _leading_nulls(self, table: list[int], start: int) -> int:
        """Index of the first real entry at or after `start` (len(table) if none)."""
        return start + sum(1 for _ in takewhile(not_, table[start:]))

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the full, real blocks among the first `num_tokens` tokens not cached yet."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self._num_cached[rid]
        if num_full <= start:
            return
        self._pool.cache_blocks(self.group_id, self._tables[rid], block_hashes, start, num_full,
                                request.token_ids)
        self._num_cached[rid] = num_full

    def uncomputed_cached_blocks(self, request_id: RequestId, num_computed_tokens: int) -> list[int]:
        """Blocks this request cached (not its hits) that cover tokens at or beyond
        `num_computed_tokens`: allocated and cached for a step that has not run."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        start = max(self._num_hit_blocks[request_id], num_computed_tokens // self.block_size)
        hashes = self._pool.block_hash
        return [b for b in table[start : self._num_cached[request_id]] if hashes[b] is not None]

    def free(self, request_id: RequestId) -> list[int]:
        """Forget the request; return its table tail first (the caller frees the blocks)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return []
        del self._num_cached[request_id]
        del self._num_hit_blocks[request_id]
        kept = table[self._num_skipped.pop(request_id):]
        kept.reverse()
        return kept

    def block_table(self, request_id: RequestId) -> list[int] | None:
        """The request's table (read only), None if it holds none in this group."""
        return self._tables.get(request_id)

    def tables(self) -> Mapping[RequestId, list[int]]:
        """Every request's table (read only), for integrity checks."""
        return self._tables

    def num_skipped(self, request_id: RequestId) -> int:
        """Leading entries of the request's table known to be null."""
        return self._num_skipped[request_id]


class FullAttentionManager(SingleTypeManager):
    """Full attention: every block is kept; hits are downward closed."""

    downward_closed = True
    skips_blocks = False

    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        keys = block_hashes[: max_length // self.block_size]
        if len(maps) == 1:
            return [list(takewhile(_is_block, map(maps[0].get, keys)))]  # type: ignore[arg-type]
        keys = keys[: _held_prefix(maps, keys)]
        return [list(map(m.__getitem__, keys)) for m in maps]


_is_block = partial(is_not, None)


def _held_prefix(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> int:
    """How many leading `keys` every map holds."""
    for m in maps:
        keys = keys[: sum(1 for _ in takewhile(_is_block, map(m.get, keys)))]
    return len(keys)


def _held_row(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> bytes:
    """Byte i is 1 where every map holds keys[i], else 0."""
    row = bytes(map(maps[0].__contains__, keys))
    for m in maps[1:]:
        row = bytes(map(mul, row, map(m.__contains__, keys)))
    return row


def _all_hold(maps: Sequence[HashMap], keys: Sequence[BlockHash]) -> bool:
    """Whether every map holds every key."""
    return all(all(map(m.__contains__, keys)) for m in maps)


class SlidingWindowManager(SingleTypeManager):
    """Sliding window W: the last W-1 tokens before a position must be cached."""

    def __init__(self, group: KVCacheGroupSpec, pool: BlockPool) -> None:
        super().__init__(group, pool)
        self.window_tokens = group.window_tokens
        self.contiguous_blocks = _cdiv(self.window_tokens - 1, self.block_size)

    def first_needed_block(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window_tokens + 1) // self.block_size

    def quiet_first(self, num_skipped: int) -> int:
        return (num_skipped + 1) * self.block_size + self.window_tokens - 2

    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        limit = max_length // self.block_size
        need = self.contiguous_blocks
        if need == 0:
            return [[self._null] * limit for _ in maps]
        keys = block_hashes[:limit]
        start, run = _rightmost_run(maps[:1], keys, need)
        if len(maps) > 1 and run and not _all_hold(maps[1:], keys[start : start + run]):
            start, run = _rightmost_run(maps, keys, need)  # the lead group's answer is not everyone's
        window = keys[start : start + run]
        null = self._null
        return [[null] * start + list(map(m.__getitem__, window)) for m in maps]


def _rightmost_run(maps: Sequence[HashMap], keys: Sequence[BlockHash], need: int) -> tuple[int, int]:
    """(start, need) of the rightmost `need` consecutive keys that every map holds; without
    one, (0, how many leading keys every map holds): a hit shorter than the window."""
    row = _held_row(maps, keys)
    start = row.rfind(b"\x01" * need)
    if start >= 0:
        return start, need
    first_miss = row.find(0)
    return 0, len(row) if first_miss < 0 else first_miss


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention C: a token attends to the tokens of its own chunk only."""

    def __init__(self, group: KVCacheGroupSpec, pool: BlockPool) -> None:
        super().__init__(group, pool)
        self.chunk_tokens = group.chunk_tokens
        if self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"group {group.group_id}: local-attention chunk of {self.chunk_tokens} tokens must be "
                f"a multiple of the block size {self.block_size}"
            )

    def first_needed_block(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_tokens * self.chunk_tokens // self.block_size

    def quiet_first(self, num_skipped: int) -> int:
        chunk = self.chunk_tokens
        return ((num_skipped + 1) * self.block_size - 1) // chunk * chunk + chunk - 1

    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        limit = max_length // self.block_size
        start = self.first_needed_block(max_length)
        window = block_hashes[start:limit] if limit > start else []
        window = window[: _held_prefix(maps, window)]
        return [[self._null] * start + [m[h] for h in window] for m in maps]


class MambaManager(SingleTypeManager):
    """Mamba-style recurrent state (Mamba1/2, Gated DeltaNet); see the module docstring."""

    defers_same_step_hits = True

    def __init__(self, group: KVCacheGroupSpec, pool: BlockPool, *, mode: MambaMode) -> None:
        super().__init__(group, pool)
        self.mode = mode
        self.skips_blocks = mode is not MambaMode.NONE
        # Hashes of checkpoints cached since the last `new_step`: their state is written by a
        # step that has not run yet, so a hit on one is refused until the next step.
        self._cached_this_step: set[BlockHash] = set()

    @property
    def hit_rule(self) -> tuple[object, ...]:
        return (*super().hit_rule, self.mode)

    def new_step(self) -> None:
        self._cached_this_step.clear()

    def refuses_hit(self, hits: Sequence[int]) -> bool:
        return bool(hits) and self._pool.block_hash[hits[-1]] in self._cached_this_step

    def first_needed_block(self, num_tokens: int) -> int:
        if self.mode is MambaMode.NONE:
            return 0
        return max(0, _cdiv(num_tokens, self.block_size) - 1)

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        if self.mode is MambaMode.NONE:
            return NEVER, NEVER
        return super().quiet_bounds(request_id)

    def quiet_first(self, num_skipped: int) -> int:
        return (num_skipped + 1) * self.block_size

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        if self.mode is MambaMode.NONE:
            return 1
        return _cdiv(total_tokens, self.block_size)

    def _read_entry(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> bool:
        """Whether the entry holding the state to read is new and distinct from the write entry."""
        return self.mode is MambaMode.ALIGN and first_new > 0 and old_len <= keep_from < new_len - 1

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        if self.mode is MambaMode.ALL:
            return super()._num_real(old_len, new_len, keep_from, first_new)
        if new_len <= old_len:
            return 0
        return 1 + self._read_entry(old_len, new_len, keep_from, first_new)

    def _new_entries(self, old_len: int, new_len: int, keep_from: int, first_new: int,
                     blocks: list[int]) -> list[int]:
        if self.mode is MambaMode.ALL:
            return super()._new_entries(old_len, new_len, keep_from, first_new, blocks)
        if new_len <= old_len:
            return []
        entries = [self._null] * (new_len - old_len)
        real = [new_len - 1]
        if self._read_entry(old_len, new_len, keep_from, first_new):
            real.append(keep_from)
        for index, block in zip(real, blocks, strict=True):
            entries[index - old_len] = block
        return entries

    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        if self.mode is MambaMode.NONE:
            return [[] for _ in maps]
        keys = block_hashes[: max_length // self.block_size]
        i = _held_row(maps[:1], keys).rfind(1)
        if i >= 0 and not _all_hold(maps[1:], keys[i : i + 1]):
            i = _held_row(maps, keys).rfind(1)  # the lead group's checkpoint is not everyone's
        if i < 0:
            return [[] for _ in maps]
        return [[self._null] * i + [m[keys[i]]] for m in maps]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the checkpoints among the first `num_tokens` tokens not cached yet: ALIGN, the
        one of a step that ended on a block boundary (`num_tokens`); ALL, every full block."""
        rid = request.request_id
        size = self.block_size
        num_full = num_tokens // size
        start = self._num_cached[rid]
        if self.mode is MambaMode.NONE or num_full <= start:
            return
        self._num_cached[rid] = num_full
        if self.mode is MambaMode.ALIGN:
            if num_tokens % size:
                return
            start = num_full - 1
        table = self._tables[rid]
        self._pool.cache_blocks(self.group_id, table, block_hashes, start, num_full, request.token_ids)
        hashes = self._pool.block_hash
        self._cached_this_step.update(h for h in map(hashes.__getitem__, table[start:num_full]) if h is not None)

    def state_entries(self, request_id: RequestId, start: int, end: int) -> StateEntries | None:
        """For a step computing tokens [start, end): (tokens, block) of the state it reads (None
        from token 0) and of every state it writes, ascending. Entry ceil(t/B) - 1 holds the
        state after t tokens; NONE mode keeps it in entry 0."""
        table = self._tables[request_id]
        size = self.block_size
        if self.mode is MambaMode.NONE:
            return ((start, table[0]) if start else None), [(end, table[0])]
        read = (start, table[_cdiv(start, size) - 1]) if start else None
        points = [end]
        if self.mode is MambaMode.ALL:
            points = list(range((start // size + 1) * size, end + 1, size))
            if end % size:
                points.append(end)
        return read, [(t, table[_cdiv(t, size) - 1]) for t in points]


class CrossAttentionManager(SingleTypeManager):
    """Cross attention: `request.num_encoder_tokens` slots, allocated once, never cached."""

    skips_blocks = False

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        return NEVER, NEVER

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        del total_tokens
        return _cdiv(request.num_encoder_tokens, self.block_size)

    def find_hits(self, maps: Sequence[HashMap], block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        return [[] for _ in maps]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        return


def make_manager(group: KVCacheGroupSpec, pool: BlockPool, *, mamba_mode: MambaMode) -> SingleTypeManager:
    """The manager for `group`'s kind."""
    kind = group.kind
    if kind is SpecKind.FULL:
        return FullAttentionManager(group, pool)
    if kind is SpecKind.SLIDING_WINDOW:
        return SlidingWindowManager(group, pool)
    if kind is SpecKind.CHUNKED_LOCAL:
        return ChunkedLocalManager(group, pool)
    if kind is SpecKind.MAMBA:
        return MambaManager(group, pool, mode=mamba_mode)
    if kind is SpecKind.CROSS:
        return CrossAttentionManager(group, pool)
    raise ConfigError(f"group {group.group_id} has unknown kind {kind!r}; expected one of "
                      f"{[k.value for k in SpecKind]}")
