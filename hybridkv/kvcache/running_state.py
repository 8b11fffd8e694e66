"""One running state per request in align mode (`RunningState.FIXED`): checkpoints taken by copy.

In align mode (vLLM's, `RunningState.MOVING`) a step writes its state into the table entry of the
block it ends in and reads the previous entry, so a request that has crossed a block boundary holds
two states per state group. `FixedStateManager` keeps one instead, the *running* block, always in
the last table entry (the entries before it are null):

    ids[row]:  | null ... null | running |
               0               ^ length - 1: moves (the id, not the state) as the request advances

- **Hit.** A new request's hit on a cached checkpoint is copied INTO a fresh running block before
  the step's forward: the coordinator's copy on write (`copies_hits`), handed out by
  `KVCacheManager.take_pending_copies`. The checkpoint itself is held only until that call.
- **Checkpoint.** A step that ends where align mode keeps a checkpoint (a block boundary the
  retention rule keeps, not cached yet) takes a free block per page group when it is allocated
  (`cache_blocks`) and caches it under the boundary's hash; its content arrives after the forward
  (the engine copies the running state OUT into it: `KVCacheManager.take_checkpoint_copies`), so a
  hit on it waits for the next step, as for any checkpoint cached in the current step: a sibling
  looked up later in the same schedule waits for it instead of missing it. The request never holds
  it: the manager holds it until the end of the schedule (`take_checkpoints`), then it is free and
  cached (evictable), like a checkpoint a request released in align mode. A checkpoint whose hash
  is already cached is not copied again.
- **Best effort.** A running request's checkpoint without free blocks is skipped (counted,
  `checkpoints_skipped`); when a running request's step would be refused (someone preempted), the
  coordinator first takes back the newest checkpoints of the schedule (`reclaim`: uncached, freed).
  A checkpoint never costs a preemption. A *new* request whose first step ends on a block boundary
  is admitted only with room for its checkpoint (`checkpoint_blocks`): align mode's write block is
  that checkpoint, and the siblings of a shared prefix hit it (measured: without this a burst of
  short requests lost a third of its hits). A request admitted while nothing else runs is never
  refused for it (then it is best effort too).

**Eviction.** Align mode's request holds its newest checkpoint (its hit, then the last it wrote)
until it crosses the next block boundary, so a value-aware policy classes it by the marks set
meanwhile (`checkpoints.Anchors`: at a junction, a hit point, a placed stop, the prompt's or the
sequence's end it is ANCHOR, elsewhere LOW). Here the request remembers it (`_last`) instead: a mark
at its entry (`anchor`; one set before the checkpoint is taken waits for it) raises its class, held
or free (a free one is released again: a sequence end marked when its request is freed, where align
mode releases it). Otherwise it keeps its early release time (measured: releasing every one again
where align mode does, at the request's next checkpoint or its end, lost hits with LRU and value).

A request freed before its step ran (preempted in the same schedule) gives its checkpoint back; one
freed with fewer computed tokens than its last checkpoint holds (a forward that failed) has that
checkpoint dropped from the cache (`uncomputed_cached_blocks`), as align mode drops its write block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.errors import AllocationError
from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.eviction import BlockValue, Ids
from hybridkv.kvcache.ids import BlockHash, BlockId, GroupId, RequestId
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.results import StateCheckpoint, StateStep
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.type_managers.base import NEVER, SingleTypeManager, StateEntries
from hybridkv.kvcache.type_managers.state import MambaManager
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode


@dataclass(frozen=True, slots=True, kw_only=True)
class _Checkpoint:
    """A checkpoint a request took or hit: its table entry, blocks (per page group) and hash."""

    index: int
    blocks: list[int]
    key: BlockHash


@dataclass(slots=True)
class _Pending:
    """A checkpoint taken for a scheduled step: its request, position, running and checkpoint blocks."""

    request: KVRequest
    num_tokens: int  # where the step ends: the state the checkpoint holds
    key: BlockHash  # the hash of the block the step ends on
    running: list[int]  # per page group: the running block the state is copied from
    blocks: list[int]  # per page group: the checkpoint block (held until `take_checkpoints`)


class FixedStateManager(MambaManager):
    """Align mode with one running state per request (module docstring)."""

    copies_hits = True
    skips_blocks = False

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool, *,
                 retention: Retention | None = None) -> None:
        super().__init__(group, pool, mode=MambaCacheMode.ALIGN, retention=retention)
        self._pending: dict[RequestId, _Pending] = {}
        #: per request, its checkpoint taken last: (tokens it holds, blocks, hash), until the step ran
        self._taken: dict[RequestId, tuple[int, list[int], BlockHash]] = {}
        #: per request, the checkpoint align mode would still hold (its hit, then its newest one)
        self._last: dict[RequestId, _Checkpoint] = {}
        #: per request, the entries at its hit points whose checkpoint is not taken yet, with their share
        #: of the ANCHOR bonus (`anchor`)
        self._anchored: dict[RequestId, dict[int, float]] = {}
        #: block copies of checkpoints handed out (one per page group), checkpoints skipped for want of
        #: free blocks, since construction
        self.checkpoints_copied = 0
        self.checkpoints_skipped = 0

    def first_needed_block(self, num_tokens: int) -> int:
        del num_tokens
        return 0  # nothing is released as the request advances: the running block moves

    def quiet_first(self, num_skipped: int) -> int:
        del num_skipped
        return NEVER

    def _num_real(self, old_len: int, new_len: int, keep_from: int, first_new: int) -> int:
        del keep_from, first_new
        return 1 if old_len == 0 < new_len else 0  # a hit's running block is its copy (copy on write)

    def _fill(self, ids: Ids, old_len: int, new_len: int, keep_from: int, first_new: int, blocks: Ids) -> None:
        del old_len, keep_from, first_new
        ids[:, new_len - 1] = blocks[:, 0]

    def allocate_new_blocks(self, request: KVRequest, first_new: int, total_tokens: int,
                            blocks: Sequence[Sequence[int] | Ids] | Ids | None = None) -> Ids:
        """As the base class; a table that grows moves its running block to the new last entry."""
        table = self._tables[request.request_id]
        old_len = table.length
        new = super().allocate_new_blocks(request, first_new, total_tokens, blocks)
        new_len = table.length
        if 0 < old_len < new_len:
            ids = table.ids
            ids[:, new_len - 1] = ids[:, old_len - 1]
            ids[:, old_len - 1] = NULL
        table.num_skipped = max(0, new_len - 1)
        return new

    def state_entries(self, request_id: RequestId, row: int, start: int, end: int) -> StateEntries | None:
        """Every step reads and writes the running block (read None from token 0)."""
        table = self._tables[request_id]
        running = int(table.ids[row, table.length - 1])
        return ((start, running) if start else None), [(end, running)]

    def cache_blocks(self, request: KVRequest, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Take the checkpoint of a step that ends on a block boundary not cached yet (align mode's
        rule, retention included): a free block per page group, cached now (a hit on it waits for
        the next step) and held until `take_checkpoints`; skipped (counted) without free blocks."""
        table = self._tables[request.request_id]
        size = self.block_size
        num_full = num_tokens // size
        if num_full <= table.num_cached:
            return
        table.num_cached = num_full
        index = num_full - 1
        if num_tokens % size or table.length != num_full:
            return
        if self.retention is not None:
            mask = self.retention.state_mask(index, num_full, block_size=size, request=request)
            if mask is not None and not mask[0]:
                return
        key = block_hashes[index]
        pool = self._pool
        if self.view.holds(key) or request.request_id in self._pending:
            return
        if pool.num_free < self.num_groups:
            self.checkpoints_skipped += 1
            return
        counts = [0] * pool.num_groups
        for g in self.group_ids:
            counts[g] = 1
        blocks: list[int] = pool.allocate_flat(counts).tolist()  # (one per group, in group id order)
        if list(self.group_ids) != sorted(self.group_ids):
            by_group = dict(zip(sorted(self.group_ids), blocks, strict=True))
            blocks = [by_group[g] for g in self.group_ids]
        pool.cache_position(self.group_ids, blocks, block_hashes, index, request.token_ids)
        self._cached_this_step.add(key)
        share = self._anchored.get(request.request_id, {}).get(index)
        if share is not None:
            self._mark(blocks, share=share)
        self._pending[request.request_id] = _Pending(request=request, num_tokens=num_tokens, key=key,
                                                     blocks=blocks, running=table.ids[:, index].tolist())

    def take_checkpoints(self) -> list[tuple[int, int, int]]:
        """The copies (group, running block, checkpoint block) of this schedule's checkpoints, whose
        blocks are released (free and cached) now: the engine copies after the forward and allocates
        nothing before it."""
        copies: list[tuple[int, int, int]] = []
        for item in self.settle_checkpoints():
            copies += zip(self.group_ids, item.running, item.blocks, strict=True)
        return copies

    def settle_checkpoints(self) -> list[_Pending]:
        """`take_checkpoints` without its copies (a ghost of the online choice runs none, `shadow.py`):
        this schedule's checkpoints, their blocks released now."""
        pending = list(self._pending.values())
        self._pending.clear()
        for item in pending:
            rid = item.request.request_id
            self._taken[rid] = item.num_tokens, item.blocks, item.key
            self._last[rid] = _Checkpoint(index=item.num_tokens // self.block_size - 1, blocks=item.blocks,
                                          key=item.key)
            if self._last_only:
                self._replace_decode_checkpoint(item.request, item.key, item.blocks)
        self.checkpoints_copied += self.num_groups * len(pending)  # (one copy per page group)
        if pending:  # (distinct blocks: released in array operations)
            self._pool.free(np.array([b for item in pending for b in item.blocks], np.int64))
        return pending

    def apply_cow(self, request_id: RequestId, index: int, blocks: Sequence[int]) -> None:
        """As the base class; the hit (entry `index` until now) is the request's newest checkpoint."""
        hit = self._tables[request_id].ids[:, index].tolist()
        key = self._pool.hash_of(hit[0])
        if key is not None:
            self._last[request_id] = _Checkpoint(index=index, blocks=hit, key=key)
        super().apply_cow(request_id, index, blocks)

    def anchor_checkpoint(self, request_id: RequestId, index: int, value: BlockValue, share: float) -> bool:
        """The request's checkpoint at entry `index` is at one of its hit points (`Anchors`): `value`
        for a value-aware policy, now where it is taken (the hit or the newest checkpoint, pending,
        held or free and still cached), else (ANCHOR) when it is taken; an ANCHOR gets `share` of its
        class's bonus (`policies/anchors.py`). An older checkpoint is left alone, as align mode's
        request no longer holds it."""
        pending = self._pending.get(request_id)
        last = self._last.get(request_id)
        if pending is not None and pending.num_tokens // self.block_size - 1 == index:
            self._mark(pending.blocks, value, share)
        elif last is not None and last.index == index:
            if self._cached(last):
                self._mark(last.blocks, value, share)
                self._release_again([b for b in last.blocks if not self._pool.ref_cnt.item(b)])
        elif last is None or index > last.index:
            shares = self._anchored.setdefault(request_id, {})
            shares[index] = max(share, shares.get(index, 0.0))
        return True

    def _mark(self, blocks: list[int], value: BlockValue = BlockValue.ANCHOR, share: float = 1.0) -> None:
        if self.marks is not None:
            self.marks.mark(blocks, value, share)

    def _cached(self, checkpoint: _Checkpoint) -> bool:
        hash_of = self._pool.hash_of
        return all(hash_of(b) == checkpoint.key for b in checkpoint.blocks)

    def _release_again(self, free: list[int]) -> None:
        """Free blocks marked since their release are released again now, in their new class (align
        mode releases them now: a sequence end marked when its request is freed)."""
        if free and self.marks is not None:
            self._pool.touch([free])
            self._pool.free(free)

    def checkpoint_blocks(self, total_tokens: int) -> int:
        """A new request's first step that ends on a block boundary takes its checkpoint's blocks: a
        request is admitted with the checkpoint a sibling will hit (align mode's write block is that
        checkpoint), not without it."""
        return 0 if total_tokens % self.block_size else self.num_groups

    def reclaim(self, num_blocks: int) -> None:
        """Give up the newest pending checkpoints until `num_blocks` blocks came back (or none is left):
        a running request's step needs them (a checkpoint never costs a preemption)."""
        freed = 0
        while freed < num_blocks and self._pending:
            self._drop(next(reversed(self._pending)))
            freed += self.num_groups

    @property
    def held_checkpoints(self) -> list[int]:
        """The blocks of the checkpoints taken in this schedule (held until `take_checkpoints`)."""
        return [b for item in self._pending.values() for b in item.blocks]

    def _drop(self, request_id: RequestId) -> None:
        item = self._pending.pop(request_id)
        self._pool.uncache(item.blocks)
        self._pool.free(item.blocks)
        self.checkpoints_skipped += 1

    def uncomputed_cached_blocks(self, request_id: RequestId, num_computed_tokens: int) -> list[int]:
        """As the base class; a checkpoint taken for a step that did not run (the request is freed
        with fewer computed tokens: a forward that failed) is dropped from the cache here."""
        taken = self._taken.pop(request_id, None)
        if taken is not None and num_computed_tokens < taken[0]:
            self._pool.discard(taken[1], taken[2])
        return super().uncomputed_cached_blocks(request_id, num_computed_tokens)

    def free(self, request_id: RequestId) -> Ids:
        self._taken.pop(request_id, None)
        self._anchored.pop(request_id, None)
        self._last.pop(request_id, None)
        if request_id in self._pending:  # its step did not run: its checkpoint holds nothing
            self._drop(request_id)
            self.checkpoints_skipped -= 1
        return super().free(request_id)


def fixed_state_managers(managers: Sequence[SingleTypeManager]) -> list[FixedStateManager]:
    """The managers of `managers` that keep one running state."""
    return [m for m in managers if isinstance(m, FixedStateManager)]


def state_steps(groups: Sequence[tuple[SingleTypeManager, int]], request_id: RequestId, start_tokens: int,
                end_tokens: int) -> tuple[StateStep, ...]:
    """`KVCacheManager.state_steps` over its groups ((manager, row) per group): per state group, where
    the step `[start_tokens, end_tokens)` reads its state and writes its states."""
    steps = []
    for manager, row in groups:
        entries = manager.state_entries(request_id, row, start_tokens, end_tokens)
        if entries is None:
            continue
        read, writes = entries
        if read is not None and read[1] == NULL:
            raise AllocationError(
                f"request {request_id!r} no longer holds its state after {start_tokens} tokens in group "
                f"{manager.group_ids[row]}; start_tokens must be the first token of the step just allocated"
            )
        steps.append(StateStep(
            group_id=GroupId(manager.group_ids[row]),
            read=None if read is None else StateCheckpoint(num_tokens=read[0], block_id=BlockId(read[1])),
            writes=tuple(StateCheckpoint(num_tokens=t, block_id=BlockId(b)) for t, b in writes),
        ))
    return tuple(steps)
