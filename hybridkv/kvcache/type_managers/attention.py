"""One manager per attention type: the hit and keep rules of each (tables: `single_type_manager.py`).

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

The state (Mamba) manager is in `mamba_manager.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import islice

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.hit_limits import HitLimit
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.options import SlidingWindowCaching, SpecDecode
from hybridkv.kvcache.prefix_map import GroupsView, PrefixProbes
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.type_managers.base import (
    NEVER,
    SingleTypeManager,
    cdiv,
    rule_of,
)
from hybridkv.kvcache.type_managers.state import MambaManager
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode, SpecKind

__all__ = [
    "ChunkedLocalManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaCacheMode",
    "MambaManager",
    "SingleTypeManager",
    "SlidingWindowManager",
    "make_manager",
]


class FullAttentionManager(SingleTypeManager):
    """Full attention: every block is kept; hits are downward closed."""

    downward_closed = True
    skips_blocks = False

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool) -> None:
        super().__init__(group, pool)
        self._probes = PrefixProbes()

    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        return view.prefix(islice(block_hashes, max_length // self.block_size))

    def hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]], max_length: int) -> int:
        """A probe (a waiting request's, every step) of one group resumes where the last one of its chain
        stopped (`PrefixProbes`)."""
        if self.partial_unit or len(view.cols) != 1:
            return super().hit_tokens(view, hashes, max_length)
        size = self.block_size
        return self._probes.held_prefix(view, hashes[size], max_length // size) * size

    def find_hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]],
                        max_length: int) -> tuple[list[list[int]], int]:
        """Full blocks left to right; with partial hits, then the partial entries inside the first
        block not held, its last boundary first (vLLM 0.32's fine-grained lookup)."""
        size = self.block_size
        hits = view.prefix(islice(hashes[size], max_length // size))
        unit = self.partial_unit
        if not unit:
            return hits, len(hits[0]) * size
        fine = hashes[unit]
        scale = size // unit
        first = len(hits[0]) * scale
        for i in range(min(first + scale - 1, max_length // unit, len(fine)) - 1, first - 1, -1):
            blocks = self._pool.partial.blocks(self.group_ids, fine[i])
            if blocks is not None:
                return [[*row, block] for row, block in zip(hits, blocks, strict=True)], (i + 1) * unit
        return hits, first * unit

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the full blocks; with partial hits, register the prompt's partial boundary once
        reached, and keep it reachable when its block fills up (the block's full hash comes first)."""
        if not self.partial_unit:
            super().cache_blocks(request, block_hashes, num_tokens)
            return
        table = self._tables[request.request_id]
        tail = self._registered.get(request.request_id, 0)
        index = tail // self.block_size
        filled = bool(tail) and table.num_cached <= index < num_tokens // self.block_size
        blocks = table.ids[:, index].tolist() if filled else []
        keys = [self._pool.partial.key(b) for b in blocks]
        for block in blocks:
            self._pool.partial.drop(block)
        super().cache_blocks(request, block_hashes, num_tokens)
        for g, block, key in zip(self.group_ids, blocks, keys, strict=False):  # (none unless filled)
            if key is not None:
                self._pool.partial.cache(g, block, key)
        self._register_tail(request, num_tokens, exact=False)


class SlidingWindowManager(SingleTypeManager):
    """Sliding window W: the last W-1 tokens before a position must be cached."""

    reads_from_right = True

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool, *,
                 retention: Retention | None = None) -> None:
        super().__init__(group, pool)
        self.window_tokens = self.group.window_tokens
        self.contiguous_blocks = cdiv(self.window_tokens - 1, self.block_size)
        self.retention = retention or Retention(sliding=SlidingWindowCaching.ALL)
        if self.retention.spec_decode is SpecDecode.EAGLE:  # one more block, dropped after the match
            self.contiguous_blocks += 1
        if not self.retention.caches_every_block(self.block_size, self.contiguous_blocks):
            self.plain_tables = False  # the decode path caches every block

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the full blocks the retention rule keeps (`retention.py`)."""
        table = self.table_of[request.request_id]
        num_full = num_tokens // self.block_size
        start = table.num_cached
        if num_full <= start:
            return
        mask = self.retention.mask(start, num_full, block_size=self.block_size, need=self.contiguous_blocks,
                                   replay_boundaries=self.retention.boundaries(request))
        if mask is None:
            super().cache_blocks(request, block_hashes, num_tokens)
            return
        i = 0
        while i < len(mask):
            if not mask[i]:
                i += 1
                continue
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            self._pool.cache(self.group_ids, table.ids, block_hashes, start + i, start + j, request.token_ids)
            i = j
        table.num_cached = num_full

    def first_needed_block(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window_tokens + 1) // self.block_size

    def quiet_first(self, num_skipped: int) -> int:
        return (num_skipped + 1) * self.block_size + self.window_tokens - 2

    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        limit = max_length // self.block_size
        need = self.contiguous_blocks
        if need == 0 or limit == 0:
            return [[self._null] * limit for _ in view.cols]
        start = max(0, limit - need)
        tail = view.blocks_if_held(block_hashes[start:limit])  # usually the answer: one gather
        if tail is not None:
            if not start:
                return tail
            nulls = [self._null] * start
            return [nulls + blocks for blocks in tail]
        if not start:  # no run of `need` but the whole row: the held prefix
            return view.prefix(islice(block_hashes, limit))
        row, slots = view.held(block_hashes[:limit])
        start, run = _rightmost_run(row, need)
        null = self._null
        return [[null] * start + blocks for blocks in view.blocks_at(slots[start : start + run])]


def _rightmost_run(row: bytes, need: int) -> tuple[int, int]:
    """(start, need) of the rightmost `need` consecutive 1 bytes of `row` (keys every group
    holds); without one, (0, how many leading bytes are 1): a hit shorter than the window."""
    start = row.rfind(b"\x01" * need)
    if start >= 0:
        return start, need
    first_miss = row.find(0)
    return 0, len(row) if first_miss < 0 else first_miss


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention C: a token attends to the tokens of its own chunk only."""

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool) -> None:
        super().__init__(group, pool)
        self.chunk_tokens = self.group.chunk_tokens
        if self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"group {self.group_id}: local-attention chunk of {self.chunk_tokens} tokens must be "
                f"a multiple of the block size {self.block_size}"
            )

    def first_needed_block(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_tokens * self.chunk_tokens // self.block_size

    def quiet_first(self, num_skipped: int) -> int:
        chunk = self.chunk_tokens
        return ((num_skipped + 1) * self.block_size - 1) // chunk * chunk + chunk - 1

    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        limit = max_length // self.block_size
        start = self.first_needed_block(max_length)
        window = block_hashes[start:limit] if limit > start else []
        return [[self._null] * start + blocks for blocks in view.prefix(window)]


class CrossAttentionManager(SingleTypeManager):
    """Cross attention: `request.num_encoder_tokens` slots, allocated once, never cached."""

    skips_blocks = False
    plain_tables = False

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        return NEVER, NEVER

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        del total_tokens
        return cdiv(request.num_encoder_tokens, self.block_size)

    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        return [[] for _ in view.cols]

    def limit_at(self, block_hashes: Sequence[BlockHash], num_tokens: int, hit_tokens: int, *,
                 window_too: bool = True) -> HitLimit | None:
        return HitLimit.NEVER_CACHED

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        return


def make_manager(group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool, *,
                 mamba_mode: MambaCacheMode, retention: Retention | None = None) -> SingleTypeManager:
    """The manager for a group, or for several groups of one rule (`rule_of`), by kind."""
    groups = (group,) if isinstance(group, KVCacheGroupSpec) else tuple(group)
    if len({rule_of(g) for g in groups}) != 1:
        raise ConfigError(f"groups {[g.group_id for g in groups]} do not share one hit rule; expected one "
                          "manager per rule")
    kind = groups[0].kind
    if kind is SpecKind.FULL:
        return FullAttentionManager(groups, pool)
    if kind is SpecKind.SLIDING_WINDOW:
        return SlidingWindowManager(groups, pool, retention=retention)
    if kind is SpecKind.CHUNKED_LOCAL:
        return ChunkedLocalManager(groups, pool)
    if kind is SpecKind.MAMBA:
        return MambaManager(groups, pool, mode=mamba_mode, retention=retention)
    if kind is SpecKind.CROSS:
        return CrossAttentionManager(groups, pool)
    raise ConfigError(f"group {groups[0].group_id} has unknown kind {kind!r}; expected one of "
                      f"{[k.value for k in SpecKind]}")
