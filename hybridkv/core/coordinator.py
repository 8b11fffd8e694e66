"""The coordinator: one hit and one allocation across all KV cache groups.

Lookup (`find_longest_cache_hit`): the hit is the longest prefix L that *every* group can serve
under its own rule, aligned to the lcm of the group block sizes.

    L = max_length aligned down
    full attention classes: looked up once at L; L = min(L, their hit)     (downward closed)
    repeat until no class shortens L:
        every other class whose last answer is not exactly L: look up at L; L = min(L, answer)
    full attention answers are cut to L

Groups with the same hit rule (e.g. the five identical sliding-window groups of Gemma 3) share
one manager and are looked up together: a block index hits only if it hits in each of them.
Each re-query returns the rightmost valid length <= L for its class, so the loop never skips a
length every group can serve: the result is the largest one, and it is reached in at most one
pass per distinct answer.

The decode fast path: after each allocate the coordinator keeps, per request, bounds (F, T) from
every group (`quiet_bounds`): a later allocate starting at first_new <= F with <= T slots adds no
entry, releases none and caches nothing in any group, so the facade only records the slots. A
decode step that crosses no block boundary (and no window or chunk edge) is a few integer tests.

Allocation runs in phases so that a refusal changes nothing:

    0. defer:   a hit on a state checkpoint cached in this step  ->  return None (next step)
    1. count:   sum over groups of (new real blocks + free hit blocks - blocks released by skipping)
                > free blocks  ->  return None   (an upper bound without per-block work first)
    2. release: out-of-window / finished-chunk / old-state blocks, all groups interleaved tail first
    3. touch:   hit blocks of every group (before any pop, so no group pops another's hit)
    4. allocate new blocks for every group in one pop (group 0's first), then extend the tables
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.errors import ConfigError
from hybridkv.core.eviction import Ids
from hybridkv.core.ids import BlockHash, RequestId
from hybridkv.core.request import KVRequest
from hybridkv.core.single_type_manager import EMPTY, SingleTypeManager

GroupBlocks = list[list[int]]  # block ids per group, 0 = null
NewEntries = list[Ids]  # new table entries per group (array views), 0 = null


class KVCacheCoordinator:
    """Lookup and allocation over all groups; subclasses differ only in how they look up.

    `managers`: one per hit rule, each serving one or more groups (`group_ids`); `groups[g]`
    is (manager, row) of group g."""

    def __init__(self, managers: Sequence[SingleTypeManager], pool: BlockPool) -> None:
        self.managers = tuple(managers)
        self.pool = pool
        placed = {g: (m, row) for m in managers for row, g in enumerate(m.group_ids)}
        if sorted(placed) != list(range(len(placed))):
            raise ConfigError(f"the managers serve groups {sorted(placed)}; expected each of 0..{len(placed) - 1} once")
        if len({m.hit_rule for m in managers}) != len(managers):
            raise ConfigError("two managers share one hit rule; expected one manager per rule (make_manager "
                              "takes every group of a rule)")
        self.groups = tuple(placed[g] for g in range(len(placed)))
        self.num_groups = len(self.groups)
        self.block_sizes = tuple(sorted({m.block_size for m in managers}))
        self.lcm_block_size = math.lcm(*self.block_sizes)
        self._allocated_tokens: dict[RequestId, int] = {}
        #: rid -> [F, T]: an allocate starting at <= F with <= T slots is a no-op (`quiet_bounds`)
        self.quiet: dict[RequestId, list[int]] = {}
        # Managers whose hits wait a step when cached in this one (state groups in a caching mode).
        self._deferring = tuple(m for m in managers if m.defers_same_step_hits)
        # Managers that may release leading blocks as a request advances.
        self._skipping = tuple(m for m in managers if m.skips_blocks)

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int) -> tuple[GroupBlocks, int, list[int]]:
        """(blocks per group, hit tokens, each group's answer when first asked, in tokens)."""
        del hashes, max_length
        return [[] for _ in self.groups], 0, [0] * self.num_groups

    # -- allocation -----------------------------------------------------------------------------

    def is_running(self, request_id: RequestId) -> bool:
        return request_id in self._allocated_tokens

    def running_requests(self) -> list[RequestId]:
        return list(self._allocated_tokens)

    def allocated_tokens(self, request_id: RequestId) -> int:
        return self._allocated_tokens.get(request_id, 0)

    def note_slots(self, request_id: RequestId, total_tokens: int) -> None:
        """A fast-path allocate: the request's tables already cover `total_tokens` slots."""
        if total_tokens > self._allocated_tokens[request_id]:
            self._allocated_tokens[request_id] = total_tokens

    def _by_manager(self, hits: GroupBlocks | None) -> list[list[list[int]] | None]:
        if not hits:
            return [None] * len(self.managers)
        return [[hits[g] for g in m.group_ids] for m in self.managers]

    def allocate(self, request: KVRequest, hits: GroupBlocks | None, first_new: int,
                 total_tokens: int) -> NewEntries | None:
        """New entries per group for `total_tokens` slots, or None (nothing changed)."""
        managers = self.managers
        rid = request.request_id
        pool = self.pool
        if hits and self.defers(hits):
            return None
        manager_hits = self._by_manager(hits)
        bounds = [m.blocks_upper_bound(request, h, first_new, total_tokens)
                  for m, h in zip(managers, manager_hits, strict=True)]
        if sum(bounds) > pool.num_free:  # tight: count exactly (free hit blocks, blocks released)
            need = sum(m.get_num_blocks_to_allocate(request, h, first_new, total_tokens)
                       for m, h in zip(managers, manager_hits, strict=True))
            if need > pool.num_free:
                return None
        counts = [0] * self.num_groups
        if rid in self._allocated_tokens:  # running: its bound is exactly its new blocks
            released = [(m.group_ids, m.remove_skipped_blocks(rid, first_new)) for m in self._skipping]
            if any(part.size for _, part in released):
                pool.free_tables(released)
            for m, bound in zip(managers, bounds, strict=True):
                if bound:
                    for g in m.group_ids:
                        counts[g] = bound // m.num_groups
        else:
            touched: list[Sequence[int]] = [[]] * self.num_groups
            for m, h in zip(managers, manager_hits, strict=True):
                for g, kept in zip(m.group_ids, m.save_hits(request, h, first_new), strict=True):
                    touched[g] = kept
            if any(touched):
                pool.touch_groups(touched)
            for m in managers:
                count = m.num_new_blocks(request, first_new, total_tokens)
                for g in m.group_ids:
                    counts[g] = count
        fresh = pool.allocate_groups(counts) if any(counts) else None
        new: NewEntries = [EMPTY] * self.num_groups
        for m in managers:  # (a table may grow by null entries alone: a Mamba table in align mode)
            blocks = [fresh[g] for g in m.group_ids] if fresh is not None else [[]] * m.num_groups
            for g, row in zip(m.group_ids, m.allocate_new_blocks(request, first_new, total_tokens, blocks),
                              strict=True):
                new[g] = row
        self._allocated_tokens[rid] = max(total_tokens, self._allocated_tokens.get(rid, 0))
        return new

    def update_quiet(self, request_id: RequestId) -> None:
        """Recompute the request's no-op bounds (after an allocate and its caching)."""
        first = total = 1 << 62
        for manager in self.managers:
            f, t = manager.quiet_bounds(request_id)
            if f < first:
                first = f
            if t < total:
                total = t
        self.quiet[request_id] = [first, total]

    def new_step(self) -> None:
        for manager in self._deferring:
            manager.new_step()

    def defers(self, hits: GroupBlocks) -> bool:
        """Whether a hit uses a state checkpoint cached in this step (usable from the next one)."""
        return any(m.refuses_hit([hits[g] for g in m.group_ids]) for m in self._deferring)

    def cache_blocks(self, request: KVRequest, hashes: dict[int, list[BlockHash]], num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, hashes[manager.block_size], num_tokens)

    def free(self, request: KVRequest) -> None:
        """Release every block of the request, all groups interleaved, tail first.

        Blocks the request cached for tokens it has not computed (`num_computed_tokens` did not
        reach them: the step was allocated, then the request was preempted before it ran) hold
        no valid KV: their hashes are dropped first, so no later lookup can hit them.
        """
        rid = request.request_id
        allocated = self._allocated_tokens.pop(rid, None)
        if allocated is None:
            return
        del self.quiet[rid]
        managers = self.managers
        if request.num_computed_tokens < allocated:
            computed = request.num_computed_tokens
            for manager in managers:
                self.pool.uncache(manager.uncomputed_cached_blocks(rid, computed))
        self.pool.free_tables([(m.group_ids, m.free(rid)) for m in managers])


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: never hits, never caches."""

    def cache_blocks(self, request: KVRequest, hashes: dict[int, list[BlockHash]], num_tokens: int) -> None:
        return


def _find(manager: SingleTypeManager, hashes: dict[int, list[BlockHash]], max_length: int) -> list[list[int]]:
    """The hit of every group of `manager`, looked up together."""
    return manager.find_hits(manager.view, hashes[manager.block_size], max_length)


class UnitaryCoordinator(KVCacheCoordinator):
    """All groups share one hit rule (one type, one block size): a single lookup."""

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int) -> tuple[GroupBlocks, int, list[int]]:
        blocks: GroupBlocks = [[] for _ in self.groups]
        tokens = 0
        for manager in self.managers:  # one manager, unless several were built for one rule
            hits = _find(manager, hashes, max_length)
            tokens = len(hits[0]) * manager.block_size
            for g, group_hits in zip(manager.group_ids, hits, strict=True):
                blocks[g] = group_hits
        return blocks, tokens, [tokens] * self.num_groups


class HybridCoordinator(KVCacheCoordinator):
    """Any number of hit rules; the fixed-point lookup of the module docstring."""

    def __init__(self, managers: Sequence[SingleTypeManager], pool: BlockPool) -> None:
        super().__init__(managers, pool)
        self._closed = [m for m in self.managers if m.downward_closed]
        self._others = [m for m in self.managers if not m.downward_closed]

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int) -> tuple[GroupBlocks, int, list[int]]:
        step = self.lcm_block_size
        length = max_length // step * step
        first = [0] * self.num_groups
        found: list[tuple[SingleTypeManager, list[list[int]]]] = []
        for cls in self._closed:
            hits = _find(cls, hashes, length)
            got = len(hits[0]) * cls.block_size
            for g in cls.group_ids:
                first[g] = got
            length = min(length, got) // step * step
            found.append((cls, hits))
        answers: dict[int, tuple[int, list[list[int]]]] = {}
        settled = False
        while not settled:
            settled = True
            for i, cls in enumerate(self._others):
                if i in answers and answers[i][0] == length:
                    continue
                hits = _find(cls, hashes, length)
                got = len(hits[0]) * cls.block_size
                if i not in answers:
                    for g in cls.group_ids:
                        first[g] = got
                answers[i] = (got, hits)
                assert got <= length, f"hit class answered {got} tokens when asked for {length}"
                if got < length:
                    length = got // step * step
                    settled = False
            if any(a[0] != length for a in answers.values()):
                settled = False
        blocks: GroupBlocks = [[] for _ in self.groups]
        for cls, hits in found:
            for g, group_hits in zip(cls.group_ids, hits, strict=True):
                blocks[g] = group_hits[: length // cls.block_size]
        for i, cls in enumerate(self._others):
            for g, group_hits in zip(cls.group_ids, answers[i][1], strict=True):
                blocks[g] = group_hits
        return blocks, length, first
