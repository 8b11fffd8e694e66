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
  retention rule keeps, not cached yet) asks for one (`cache_blocks`). At the end of the schedule,
  after every allocation of the step, `take_checkpoints` takes a fresh block per page group from
  the free blocks, caches it under the boundary's hash and releases it at once: it is free and
  cached (evictable), like a checkpoint a request released in align mode, and the engine copies the
  running state OUT into it after the forward (`KVCacheManager.take_checkpoint_copies`). Best
  effort: with fewer free blocks than page groups the checkpoint is skipped and counted, never a
  preemption. A checkpoint whose hash is already cached is not copied again.

A request that is freed before its step runs (preempted in the same schedule) drops its asked-for
checkpoint. The checkpoint's content arrives after the forward, so a hit on it waits for the next
step (`begin_step`), as for any checkpoint cached in the current step in align mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.free_queue import Ids
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.retention import Retention
from hybridkv.kvcache.type_managers.base import NEVER, SingleTypeManager, StateEntries
from hybridkv.kvcache.type_managers.state import MambaManager
from hybridkv.plan.kv_cache_config import RunningState
from hybridkv.plan.kv_cache_config import check_running_state as check_mode
from hybridkv.plan.match_unit import MatchUnit
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode


@dataclass(slots=True)
class _Wanted:
    """A checkpoint a scheduled step asked for: its request, position and running blocks."""

    request: KVRequest
    block_hashes: Sequence[BlockHash]
    index: int  # table entry (block) whose hash keys the checkpoint
    running: list[int]  # per page group: the running block the state is copied from


class FixedStateManager(MambaManager):
    """Align mode with one running state per request (module docstring)."""

    copies_hits = True
    skips_blocks = False

    def __init__(self, group: KVCacheGroupSpec | Sequence[KVCacheGroupSpec], pool: BlockPool, *,
                 retention: Retention | None = None) -> None:
        super().__init__(group, pool, mode=MambaCacheMode.ALIGN, retention=retention)
        self._wanted: dict[RequestId, _Wanted] = {}
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
                            blocks: Sequence[Sequence[int] | Ids] | None = None) -> Ids:
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
        """Ask for the checkpoint of a step that ends on a block boundary not cached yet (align
        mode's rule, retention included); `take_checkpoints` takes it."""
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
        if self.view.holds(block_hashes[index]):
            return
        self._wanted[request.request_id] = _Wanted(request=request, block_hashes=block_hashes, index=index,
                                                   running=table.ids[:, index].tolist())

    def take_checkpoints(self) -> list[tuple[int, int, int]]:
        """Take, cache and release a block per page group for every checkpoint asked for in this
        schedule (module docstring); the copies (group, running block, checkpoint block)."""
        wanted = list(self._wanted.values())
        self._wanted.clear()
        pool = self._pool
        taken: list[tuple[_Wanted, list[int]]] = []
        for item in wanted:  # every block first: none is reused by the next one's allocation
            if pool.num_free < self.num_groups:
                self.checkpoints_skipped += 1
                continue
            counts = [0] * pool.num_groups
            for g in self.group_ids:
                counts[g] = 1
            fresh = pool.allocate(counts)
            taken.append((item, [int(fresh[g][0]) for g in self.group_ids]))
        copies: list[tuple[int, int, int]] = []
        for item, blocks in taken:
            rows = np.zeros((self.num_groups, item.index + 1), np.int64)
            rows[:, item.index] = blocks
            pool.cache(self.group_ids, rows, item.block_hashes, item.index, item.index + 1, item.request.token_ids)
            self._cached_this_step.add(item.block_hashes[item.index])  # written after the forward: hits wait a step
            if self._last_only:
                self._replace_decode_checkpoint(item.request, item.block_hashes[item.index], blocks)
            copies += zip(self.group_ids, item.running, blocks, strict=True)
        self.checkpoints_copied += len(copies)
        pool.free([b for _, blocks in taken for b in blocks])
        return copies

    def free(self, request_id: RequestId) -> Ids:
        self._wanted.pop(request_id, None)  # its step did not run: no state to copy
        return super().free(request_id)


def fixed_state_managers(managers: Sequence[SingleTypeManager]) -> list[FixedStateManager]:
    """The managers of `managers` that keep one running state."""
    return [m for m in managers if isinstance(m, FixedStateManager)]


def check_running_state(running_state: RunningState, mamba_cache_mode: MambaCacheMode, unit: MatchUnit) -> None:
    """ConfigError for a running state the options cannot give: not a RunningState, FIXED with
    mamba_cache_mode ALL, or FIXED with partial hits (a hit inside a block is copied on write into
    the block the request goes on writing; not combined with one running state yet)."""
    check_mode(running_state, mamba_cache_mode)
    if running_state is RunningState.FIXED and unit.partial_hits:
        raise ConfigError(
            f"running_state=fixed with prefix_match_unit={unit.hash_unit_tokens} (hits inside the "
            f"{unit.scheduler_block_tokens}-token blocks) is not supported; expected a unit of at least "
            f"{unit.scheduler_block_tokens} tokens (or None), or running_state moving")
