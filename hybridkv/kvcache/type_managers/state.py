"""The state manager (Mamba1/2, Gated DeltaNet): a recurrent state in one block per request.

Align mode: the state is written only at the end of a step, into the last entry of the table;
entry `ceil(p/B) - 1` holds the state after `p` tokens (read by the next step). A step that
ends on a block boundary T leaves a checkpoint in entry T/B - 1, which is cached under the hash
of that block. Only those two entries are real blocks; every other entry is null. All mode
keeps a checkpoint at every block boundary a step crosses; none mode (prefix caching off) one
running state in entry 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.eviction import BlockValue, Ids
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.options import DecodeCheckpoints
from hybridkv.kvcache.prefix_map import GroupsView, PrefixProbes
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.type_managers.base import (
    NEVER,
    SingleTypeManager,
    StateEntries,
    cdiv,
)
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode


class MambaManager(SingleTypeManager):
    """Mamba-style recurrent state (Mamba1/2, Gated DeltaNet); see the module docstring."""

    reads_from_right = True
    is_state = True

    defers_same_step_hits = True
    plain_tables = False

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool, *,
                 mode: MambaCacheMode, retention: Retention | None = None) -> None:
        super().__init__(group, pool)
        self.mode = mode
        self.retention = retention  # None or interval None: every checkpoint is cached
        self.skips_blocks = mode is not MambaCacheMode.NONE
        # Hashes of checkpoints cached since the last `new_step`: their state is written by a
        # step that has not run yet, so a hit on one is refused until the next step.
        self._cached_this_step: set[BlockHash] = set()
        self._last_only = retention is not None and retention.decode_checkpoints is DecodeCheckpoints.LAST
        self._probes = PrefixProbes()  # (a waiting request's probe: its chain's key positions, kept)
        # DecodeCheckpoints.LAST: per request, its latest decode checkpoint (blocks, hash)
        self._decode_checkpoint: dict[RequestId, tuple[list[int], BlockHash]] = {}

    @property
    def hit_rule(self) -> tuple[object, ...]:
        return (*super().hit_rule, self.mode)

    def new_step(self) -> None:
        self._cached_this_step.clear()

    def refuses_hit(self, hits: Sequence[Sequence[int]]) -> bool:
        hash_of = self._pool.hash_of
        return any(row and hash_of(row[-1]) in self._cached_this_step for row in hits)

    def first_needed_block(self, num_tokens: int) -> int:
        if self.mode is MambaCacheMode.NONE:
            return 0
        return max(0, cdiv(num_tokens, self.block_size) - 1)

    def quiet_bounds(self, request_id: RequestId) -> tuple[int, int]:
        if self.mode is MambaCacheMode.NONE:
            return NEVER, NEVER
        return super().quiet_bounds(request_id)

    def quiet_first(self, num_skipped: int) -> int:
        return (num_skipped + 1) * self.block_size

    def table_length(self, request: KVRequest, total_tokens: int) -> int:
        if self.mode is MambaCacheMode.NONE:
            return 1
        return cdiv(total_tokens, self.block_size)

    def _read_entry(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> bool:
        """Whether the entry holding the state to read is new and distinct from the write entry."""
        return self.mode is MambaCacheMode.ALIGN and first_new > 0 and old_len <= keep_from < new_len - 1

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        if self.mode is MambaCacheMode.ALL:
            return super()._num_real(old_len, new_len, keep_from, first_new)
        if new_len <= old_len:
            return 0
        return 1 + self._read_entry(old_len, new_len, keep_from, first_new)

    def _fill(self, ids: Ids, old_len: int, new_len: int, keep_from: int, first_new: int, blocks: Ids) -> None:
        if self.mode is MambaCacheMode.ALL:
            super()._fill(ids, old_len, new_len, keep_from, first_new, blocks)
            return
        ids[:, new_len - 1] = blocks[:, 0]
        if self._read_entry(old_len, new_len, keep_from, first_new):
            ids[:, keep_from] = blocks[:, 1]

    def find_hits(self, view: GroupsView, block_hashes: Sequence[BlockHash],
                  max_length: int) -> list[list[int]]:
        if self.mode is MambaCacheMode.NONE:
            return [[] for _ in view.cols]
        i, slots = self._last_checkpoint(view, block_hashes, max_length)
        if i < 0:
            return [[] for _ in view.cols]
        return [[self._null] * i + blocks for blocks in view.blocks_at(slots[i : i + 1])]

    def _last_checkpoint(self, view: GroupsView, block_hashes: Sequence[BlockHash], max_length: int) -> tuple[int, Ids]:
        """(index of the last block within `max_length` whose checkpoint every group holds, -1 if none;
        the slots of the looked-up keys)."""
        row, slots = view.held(block_hashes[: max_length // self.block_size])
        return row.rfind(1), slots

    def hit_block_ids(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]], num_tokens: int) -> list[int]:
        """The checkpoint at `num_tokens` alone (the hit's other entries are null): no k-page lists."""
        index = num_tokens // self.block_size - 1
        if self.mode is MambaCacheMode.ALL or self.partial_unit or index < 0:
            return super().hit_block_ids(view, hashes, num_tokens)
        return view.real_blocks_at(int(view.slots(hashes[self.block_size][index : index + 1])[0]))

    def hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]], max_length: int) -> int:
        if self.partial_unit or self.mode is MambaCacheMode.NONE:
            return super().hit_tokens(view, hashes, max_length)
        i = self._probes.last_held(view, hashes[self.block_size], max_length // self.block_size)
        return (i + 1) * self.block_size  # (no k-page block lists: a probe of a multi-page state is cheap)

    def find_hit_tokens(self, view: GroupsView, hashes: Mapping[int, Sequence[BlockHash]],
                        max_length: int) -> tuple[list[list[int]], int]:
        """With partial hits (align mode): the last `partial_unit` boundary whose state is cached,
        at a block boundary (a full checkpoint) or inside a block (a partial entry)."""
        unit = self.partial_unit
        if not unit:
            return super().find_hit_tokens(view, hashes, max_length)
        size = self.block_size
        fine, full = hashes[unit], hashes[size]
        scale = size // unit
        count = min(max_length // unit, len(fine))
        keys = list(fine[:count])
        keys[scale - 1 :: scale] = full[: count // scale]
        row, slots = view.held(keys)
        i = row.rfind(1)
        if i < 0:
            return [[] for _ in view.cols], 0
        entry = i // scale
        return [[self._null] * entry + blocks for blocks in view.blocks_at(slots[i : i + 1])], (i + 1) * unit

    def producer_copied(self, request_id: RequestId, copies: Sequence[int]) -> None:
        """The copies now hold the partial checkpoint, filled by this step's copy: hits wait a step."""
        super().producer_copied(request_id, copies)
        hash_of = self._pool.hash_of
        self._cached_this_step.update(h for h in map(hash_of, copies) if h is not None)

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Cache the checkpoints among the first `num_tokens` tokens not cached yet: ALIGN, the
        one of a step that ended on a block boundary (`num_tokens`); ALL, every full block."""
        table = self._tables[request.request_id]
        size = self.block_size
        num_full = num_tokens // size
        start = table.num_cached
        if self.partial_unit and num_tokens % size:
            self._cache_partial_tail(request, num_tokens)
        if self.mode is MambaCacheMode.NONE or num_full <= start:
            return
        table.num_cached = num_full
        if self.mode is MambaCacheMode.ALIGN:
            if num_tokens % size:
                return
            start = num_full - 1
        mask = self.retention.state_mask(start, num_full, block_size=size, request=request) if self.retention else None
        if mask is not None:  # sparse retention: cache the kept checkpoints only
            for i, keep in enumerate(mask):
                if keep:
                    self._cache_range(request, block_hashes, start + i, start + i + 1)
        else:
            self._cache_range(request, block_hashes, start, num_full)
        if self._last_only and self.mode is MambaCacheMode.ALIGN:
            self._replace_decode_checkpoint(request, block_hashes[start], table.ids[:, start].tolist())

    def _cache_partial_tail(self, request: KVRequest, num_tokens: int) -> None:
        """A step ending at the prompt's partial boundary: its state (in the running block) becomes
        a partial entry, moved to a copy before the next step overwrites it (`producer_cow`)."""
        if not self.partial_unit:
            return
        registered = self._register_tail(request, num_tokens, exact=True)
        if registered is None:
            return
        self._producer_cow[request.request_id] = registered
        self._tables[request.request_id].num_cached = registered[0]
        hash_of = self._pool.hash_of
        self._cached_this_step.update(h for h in map(hash_of, registered[1]) if h is not None)

    def _replace_decode_checkpoint(self, request: KVRequest, block_hash: BlockHash, blocks: list[int]) -> None:
        """DecodeCheckpoints.LAST: a checkpoint past the prompt drops the request's previous one."""
        prompt = request.num_prompt_tokens
        if prompt is None or request.num_computed_tokens < prompt:
            return  # a prompt checkpoint (or a recompute after preemption): kept
        if self._pool.hash_of(blocks[0]) != block_hash:
            return  # not cached (sparse retention skipped it): the previous one stays
        previous = self._decode_checkpoint.get(request.request_id)
        if previous is not None and previous[1] != block_hash:
            self._pool.discard(*previous)
        self._decode_checkpoint[request.request_id] = (blocks, block_hash)
        if self.marks is not None:  # a value-aware policy keeps it: the next turn resumes here
            self.marks.mark(blocks, BlockValue.ANCHOR)

    def free(self, request_id: RequestId) -> Ids:
        self._decode_checkpoint.pop(request_id, None)  # its last decode checkpoint stays cached
        return super().free(request_id)

    def _cache_range(self, request: KVRequest, block_hashes: Sequence[BlockHash], start: int, end: int) -> None:
        table = self._tables[request.request_id]
        num_full = end
        self._pool.cache(self.group_ids, table.ids, block_hashes, start, num_full, request.token_ids)
        cached = self._pool.slot_of[table.ids[:, start:num_full]]  # (this map's slots: the hashes the blocks carry)
        self._cached_this_step.update(self.view.keys_in(cached.ravel()))

    def state_entries(self, request_id: RequestId, row: int, start: int, end: int) -> StateEntries | None:
        """For a step computing tokens [start, end): (tokens, block) of the state it reads (None
        from token 0) and of every state it writes, ascending. Entry ceil(t/B) - 1 holds the
        state after t tokens; NONE mode keeps it in entry 0."""
        table = self._tables[request_id].ids[row]
        size = self.block_size
        if self.mode is MambaCacheMode.NONE:
            return ((start, int(table[0])) if start else None), [(end, int(table[0]))]
        read = (start, int(table[cdiv(start, size) - 1])) if start else None
        points = [end]
        if self.mode is MambaCacheMode.ALL:
            points = list(range((start // size + 1) * size, end + 1, size))
            if end % size:
                points.append(end)
        return read, [(t, int(table[cdiv(t, size) - 1])) for t in points]
