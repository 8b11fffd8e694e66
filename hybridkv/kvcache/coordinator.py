"""The coordinator: one hit and one allocation across all KV cache groups.

Lookup (`find_longest_cache_hit`): the hit is the longest prefix L that *every* group can serve
under its own rule, aligned to the lcm of the group block sizes.

    L = max_length aligned down
    full attention classes: looked up once at L; L = min(L, their hit)     (downward closed)
    repeat until no class shortens L:
        every other class whose last answer is not exactly L: look up at L; L = min(L, answer)
    full attention answers are cut to L                  (L = 0: no other class is asked; none holds a block)

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
    3. touch:   hit blocks of every group (before any pop, so no group pops another's hit); an
                adopted state hit (`RunningState.ADOPT`) leaves the cache here
    4. allocate new blocks for every group in one pop (group 0's first), then extend the tables

The decode path (`decode`): a running request's step that adds at most one entry per group
(a decode step, a short chunk) runs the same phases in one function over the tables directly,
for every group at once: a few integer tests per manager, one pop of one block per group when
a block boundary is crossed, one array pass (or, for one position, one list) for the blocks that
left a window, one dict operation per newly full position, and the new no-op bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from hybridkv.errors import ConfigError
from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.copy_on_write import CopyOnWrite
from hybridkv.kvcache.eviction import Ids
from hybridkv.kvcache.group_spans import new_block_rows, put_groups, row_tuples
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.options import ReleaseOrder
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.seams import Adoption, Reserve
from hybridkv.kvcache.type_managers.base import SingleTypeManager, Table

GroupBlocks = list[list[int]]  # block ids per group, 0 = null


#: `decode`'s plan per manager: (index of its bounds, manager, table, keep from, grows by one entry, that entry is real)
_DecodeStep = tuple[int, SingleTypeManager, Table, int, bool, bool]
NewEntries = list[tuple[int, ...]]  # new table entries per group, 0 = null


class KVCacheCoordinator:
    """Lookup and allocation over all groups; subclasses differ only in how they look up.

    `managers`: one per hit rule, each serving one or more groups (`group_ids`); `groups[g]`
    is (manager, row) of group g."""

    def __init__(self, managers: Sequence[SingleTypeManager], pool: BlockPool, *,
                 release_order: ReleaseOrder = ReleaseOrder.INTERLEAVED, reserve: Reserve | None = None,
                 adoption: Adoption | None = None) -> None:
        self.managers = tuple(managers)
        self.pool = pool
        placed = {g: (m, row) for m in managers for row, g in enumerate(m.group_ids)}
        if sorted(placed) != list(range(len(placed))):
            raise ConfigError(f"the managers serve groups {sorted(placed)}; expected each of 0..{len(placed) - 1} once")
        if len({m.hit_rule for m in managers}) != len(managers):
            raise ConfigError("two managers share one hit rule; expected one manager per rule (make_manager "
                              "takes every group of a rule)")
        self.groups = tuple(placed[g] for g in range(len(placed)))
        self.release_order = release_order
        #: what a new request must leave free (`policies/headroom.py`); None: nothing (vLLM's)
        self.reserve = reserve
        #: RunningState.ADOPT: whether a state hit may be moved into the running state (`policies/adoption.py`)
        self.adoption = adoption
        self.num_groups = len(self.groups)
        self.block_sizes = tuple(sorted({m.block_size for m in managers}))
        self.lcm_block_size = math.lcm(*self.block_sizes)
        #: rid -> token slots its tables hold (the running requests; the facade's no-op path reads and raises it)
        self.allocated: dict[RequestId, int] = {}
        #: rid -> [F, T, F_0, T_0, F_1, T_1, ...]: an allocate starting at <= F with <= T slots is a
        #: no-op (`quiet_bounds`); (F_i, T_i) are manager i's own bounds, (F, T) their minimum
        self.quiet: dict[RequestId, list[int]] = {}
        # Managers whose hits wait a step when cached in this one (state groups in a caching mode).
        self._deferring = tuple(m for m in managers if m.defers_same_step_hits)
        self.may_defer = bool(self._deferring)  # `defers` can be True at all
        # Managers that may release leading blocks as a request advances.
        self._skipping = tuple(m for m in managers if m.skips_blocks)
        #: Every manager follows the base table rules (and serves ascending group ids): `decode` applies.
        self.decodes = all(m.plain_tables and list(m.group_ids) == sorted(m.group_ids) for m in managers)
        self._no_entries: tuple[tuple[int, ...], ...] = tuple(() for _ in self.groups)
        #: hits land every `hit_step` tokens (the lcm of the block sizes, or the prefix_match_unit
        #: where partial hits are on)
        self.hit_step = self.lcm_block_size
        #: the copies allocations need before the step's forward (`copy_on_write.py`)
        self.cow = CopyOnWrite(self.managers, pool, len(self.groups), adoption)
        #: a refused allocate of a running request still releases the blocks its step no longer
        #: needs (vLLM 0.32's order; set with partial hits, whose copy-on-write steps can be refused)
        self.release_when_refused = False
        #: hits may end inside blocks (`enable_partial_hits`): allocate may copy on write
        self.partial_hits = False
        #: a manager copies every hit into a fresh block (`RunningState.FIXED`): allocate may copy
        self.copies_hits = any(m.copies_hits for m in managers)
        self._reclaiming = tuple(m for m in managers if m.copies_hits)  # (checkpoints held for the schedule)
        self._no_cows: list[tuple[int, list[int]] | None] = []
        #: `allocate` answers the new entries (False: an empty entry per group, for a caller that reads
        #: none: a ghost of the online choice, `shadow.py`)
        self.reports_entries = True

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int, blocks: bool = True) -> tuple[GroupBlocks, int, list[int]]:
        """(blocks per group, hit tokens, each group's answer when first asked, in tokens); without
        `blocks`, the hit's length only (no block lists: a probe)."""
        del hashes, max_length, blocks
        return [[] for _ in self.groups], 0, [0] * self.num_groups

    def probe_reach(self, first: Sequence[int], max_length: int) -> int:
        """How far into a chain a lookup whose groups first answered `first` read it, in tokens: to the
        shortest downward-closed group's answer (no group is asked past it), else to `max_length`."""
        closed = [first[g] for m in self.managers if m.downward_closed for g in m.group_ids]
        return min(closed) if closed else max_length

    def eagle_hit(self, hashes: dict[int, list[BlockHash]], num_tokens: int,
                  max_length: int) -> tuple[GroupBlocks, int, list[int]]:
        """EAGLE's hit: every group matches one block past the candidate (a sliding window one more
        contiguous block), then the last block is dropped (vLLM 0.32's `drop_eagle_block`)."""
        step = self.lcm_block_size
        # vLLM's hybrid coordinator lets the match run one block past the candidate; its unitary one does not
        extended = max_length if len(self.managers) == 1 else min(max_length + step, num_tokens // step * step)
        hits, tokens, first = self.find_longest_cache_hit(hashes, extended)
        first = [max(0, f - step) for f in first]
        if not tokens:
            return hits, 0, first
        tokens -= step
        return [h[: tokens // step] for h in hits], tokens, first

    # -- allocation -----------------------------------------------------------------------------

    def enable_partial_hits(self, unit: int) -> None:
        """Hits land every `unit` tokens; the full-attention and state managers look up inside blocks;
        a refused allocate of a running request still releases its skipped blocks (vLLM 0.32's order)."""
        self.hit_step = unit
        self.partial_hits = True
        self.release_when_refused = True
        for manager in self.managers:
            if manager.block_size > unit and (manager.downward_closed or manager.is_state):
                manager.partial_unit = unit

    def is_running(self, request_id: RequestId) -> bool:
        return request_id in self.allocated

    def running_requests(self) -> list[RequestId]:
        return list(self.allocated)

    def allocated_tokens(self, request_id: RequestId) -> int:
        return self.allocated.get(request_id, 0)

    def _by_manager(self, hits: GroupBlocks | None) -> list[list[list[int]] | None]:
        if not hits:
            return [None] * len(self.managers)
        return [[hits[g] for g in m.group_ids] for m in self.managers]

    def allocate(self, request: KVRequest, hits: GroupBlocks | None, first_new: int,
                 total_tokens: int, hit_tokens: int = 0) -> NewEntries | None:
        """New entries per group for `total_tokens` slots, or None (nothing changed).

        A partial hit (`hit_tokens` inside a block of a group) or a state's partial entry in its
        running block (`producer_cow`) takes one more block per group: the copy (`copy_on_write.py`)."""
        managers = self.managers
        rid = request.request_id
        pool = self.pool
        if hits and self.defers(hits):
            return None
        manager_hits = self._by_manager(hits)
        adopted: list[int] = []  # (ADOPT: state hits moved into the running state, uncached once admitted)
        cows = (self.cow.plan(rid, rid in self.allocated, manager_hits, hit_tokens, adopted)
                if self.partial_hits or self.copies_hits else self._no_cows)
        extra = sum(m.num_groups for m, cow in zip(managers, cows, strict=True) if cow is not None) if cows else 0
        bounds = [m.blocks_upper_bound(request, h, first_new, total_tokens)
                  for m, h in zip(managers, manager_hits, strict=True)]
        reserve = self.reserve.blocks(hits, len(self.allocated)) if self.reserve and rid not in self.allocated else 0
        if self._reclaiming and self.allocated and rid not in self.allocated:  # (FIXED: room for its checkpoint)
            reserve += sum(m.checkpoint_blocks(total_tokens) for m in self._reclaiming)
        if sum(bounds) + extra + reserve > pool.num_free:  # tight: count exactly (free hit blocks, blocks released)
            need = sum(m.get_num_blocks_to_allocate(request, h, first_new, total_tokens)
                       for m, h in zip(managers, manager_hits, strict=True))
            if need + extra + reserve > pool.num_free and self._reclaiming and rid in self.allocated:
                for m in self._reclaiming:  # a running step comes before a checkpoint: never a preemption
                    m.reclaim(need + extra + reserve - pool.num_free)
            if need + extra + reserve > pool.num_free:
                if self.release_when_refused and rid in self.allocated:
                    self._release_skipped(rid, first_new)
                    self.update_quiet(rid)
                return None
        counts = [0] * self.num_groups
        if rid in self.allocated:  # running: its bound is exactly its new blocks
            self._release_skipped(rid, first_new)
            for m, bound in zip(managers, bounds, strict=True):
                if bound:
                    put_groups(counts, m.group_ids, [bound // m.num_groups] * m.num_groups)
        else:
            touched: list[Sequence[int]] = [[]] * self.num_groups
            for m, h in zip(managers, manager_hits, strict=True):
                put_groups(touched, m.group_ids, m.save_hits(request, h, first_new))
            if any(touched):
                pool.touch(touched)
            if adopted:  # the request's running state now: no lookup may find it
                pool.uncache(adopted)
                assert self.adoption is not None
                self.adoption.adoptions += 1
            for m in managers:
                put_groups(counts, m.group_ids, [m.num_new_blocks(request, first_new, total_tokens)] * m.num_groups)
        if extra:
            for m, cow in zip(managers, cows, strict=True):
                if cow is not None:
                    put_groups(counts, m.group_ids, [counts[g] + 1 for g in m.group_ids])
        flat = pool.allocate_flat(counts) if any(counts) else None
        starts = list(accumulate(counts, initial=0)) if flat is not None else []
        fresh: list[Sequence[int] | Ids] | None = None
        copied: list[Sequence[int]] = [()] * self.num_groups
        if extra and flat is not None:
            fresh = [flat[starts[g] : starts[g + 1]] for g in range(self.num_groups)]
            copied = self.cow.apply(rid, rid in self.allocated, cows, fresh)
        new: NewEntries = [()] * self.num_groups
        for m in managers:  # (a table may grow by null entries alone: a Mamba table in align mode)
            blocks = new_block_rows(m.group_ids, flat, starts, fresh)
            rows = m.allocate_new_blocks(request, first_new, total_tokens, blocks)
            if not self.reports_entries:
                continue
            if extra:
                put_groups(new, m.group_ids, [(*copied[g], *row) if len(copied[g]) else tuple(row)
                                              for g, row in zip(m.group_ids, rows.tolist(), strict=True)])
            elif rows.size:  # (one list per manager: hundreds of page groups share one)
                put_groups(new, m.group_ids, row_tuples(rows))
        self.allocated[rid] = max(total_tokens, self.allocated.get(rid, 0))
        return new

    def _release_skipped(self, rid: RequestId, first_new: int) -> None:
        """Release the blocks a running request no longer needs once `first_new` tokens precede its step."""
        released = [(m.group_ids, m.remove_skipped_blocks(rid, first_new)) for m in self._skipping]
        if any(part.size for _, part in released):
            self._release(released)

    def decode(self, request: KVRequest, first_new: int, end: int,
               hashes_of: Callable[[KVRequest], dict[int, list[BlockHash]]]) -> tuple[tuple[int, ...], ...] | None:
        """`allocate` + `cache_blocks` + `update_quiet` of a running request's step [first_new,
        end) without hits, lookahead or external tokens (only when `decodes`): the new entries
        per group, as ints. None, with nothing changed, where the general path must run: a group
        needs more than one new entry, or the pool may be too tight (it counts exactly)."""
        rid = request.request_id
        bounds = self.quiet[rid]
        steps: list[_DecodeStep] = []
        counts: list[int] | None = None
        releasing = 0
        release: tuple[Table, int] | None = None  # the one releasing manager's (table, keep)
        at = 2
        for m in self.managers:  # 1. count (a manager whose own no-op bounds hold changes nothing)
            if first_new > bounds[at] or end > bounds[at + 1]:
                table = m.table_of[rid]
                old = table.length
                grows = -(-end // m.block_size) - old
                if grows > 1:
                    return None
                keep = m.first_needed_block(first_new) if m.skips_blocks else 0
                real = grows == 1 and old >= keep
                if real:
                    if counts is None:
                        counts = [0] * self.num_groups
                    for g in m.group_ids:
                        counts[g] = 1
                if keep > table.num_skipped < old:
                    releasing += 1
                    release = table, keep
                steps.append((at, m, table, keep, grows == 1, real))
            at += 2
        pool = self.pool
        if counts is not None and sum(counts) > pool.num_free:  # (exact count: the general path)
            return None
        if releasing > 1:  # 2. release (several managers: interleaved position by position)
            pool.free_tables([(m.group_ids, m.remove_skipped_blocks(rid, first_new)) for m in self._skipping])
        elif release is not None:
            self._release_leading(release[0], min(release[1], release[0].length))
        fresh = None  # 3. pop (lists of ints)
        if counts is not None:
            fresh = [blocks if isinstance(blocks, list) else blocks.tolist() for blocks in pool.allocate(counts)]
        out = self._extend(request, steps, fresh, end, hashes_of, bounds)  # 4. extend, cache, bounds
        if end > self.allocated[rid]:
            self.allocated[rid] = end
        return out

    def _extend(self, request: KVRequest, steps: list[_DecodeStep], fresh: list[list[int]] | None, end: int,
                hashes_of: Callable[[KVRequest], dict[int, list[BlockHash]]],
                bounds: list[int]) -> tuple[tuple[int, ...], ...]:
        """`decode`'s last phases: append each manager's new entry (a fresh block, or null),
        cache the newly full blocks, update the no-op bounds; the new entries per group."""
        out = list(self._no_entries)
        hashes = None
        num_tokens = min(end, request.num_tokens)
        for at, m, table, _, grows, real in steps:
            old = table.length
            size = m.block_size
            if grows:  # one new entry per group: a fresh block, or null
                if old == table.ids.shape[1]:
                    table.grow(old + 1)
                if real and fresh is not None:
                    entry = [fresh[g][0] for g in m.group_ids]
                    table.ids[:, old] = entry
                    for g, block in zip(m.group_ids, entry, strict=True):
                        out[g] = (block,)
                else:
                    for g in m.group_ids:
                        out[g] = (NULL,)
                table.length = old + 1
                if table.num_skipped == old:
                    table.num_skipped = old if real else old + 1
            if num_tokens // size > table.num_cached:
                hashes = hashes or hashes_of(request)
                self._cache_table(m, table, hashes[size], num_tokens // size, request.token_ids)
            bounds[at] = m.quiet_first(table.num_skipped)
            bounds[at + 1] = min(table.length, table.num_cached + 1) * size - 1
        bounds[0] = min(bounds[2::2])
        bounds[1] = min(bounds[3::2])
        return tuple(out)

    def _release_leading(self, table: Table, keep: int) -> None:
        """Replace entries [num_skipped, keep) by null and release their blocks, tail first,
        the groups of each position in ascending order (as `free_tables` orders one manager's)."""
        ids = table.ids
        done = table.num_skipped
        if keep - done == 1:
            column = ids[:, done].tolist()
            ids[:, done] = NULL
            self.pool.free(column)
        else:
            # Base table rules: the entries from num_skipped on are real (nulls only lead), each once.
            part = ids[:, done:keep]
            order = part[:, ::-1].flatten("F")  # position by position from the tail (a copy)
            part[:] = NULL
            self.pool.free(order)
        table.num_skipped = keep

    def _cache_table(self, manager: SingleTypeManager, table: Table, block_hashes: Sequence[BlockHash],
                     num_full: int, token_ids: Sequence[int]) -> None:
        """`manager.cache_blocks` for the base table rules: entries [num_cached, num_full)."""
        start = table.num_cached
        self.pool.cache(manager.group_ids, table.ids, block_hashes, start, num_full, token_ids)
        table.num_cached = num_full

    def update_quiet(self, request_id: RequestId) -> None:
        """Recompute the request's no-op bounds (after an allocate and its caching)."""
        bounds = [0, 0]
        for manager in self.managers:
            bounds += manager.quiet_bounds(request_id)
        bounds[0] = min(bounds[2::2])
        bounds[1] = min(bounds[3::2])
        self.quiet[request_id] = bounds

    def new_step(self) -> None:
        if self.reserve is not None:
            self.reserve.new_step()  # (named again by this step's protect_waiting)
        if self.adoption is not None:
            self.adoption.new_step()
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
        allocated = self.allocated.pop(rid, None)
        if allocated is None:
            return
        del self.quiet[rid]
        managers = self.managers
        if request.num_computed_tokens < allocated:
            computed = request.num_computed_tokens
            for manager in managers:
                self.pool.uncache(manager.uncomputed_cached_blocks(rid, computed))
        self._release([(m.group_ids, m.free(rid)) for m in managers])

    def _release(self, tables: Sequence[tuple[Sequence[int], Ids]]) -> None:
        """Release blocks of several groups (per manager: its group ids and a (groups, n) array,
        each row tail first) in the release order (`ReleaseOrder`)."""
        if self.release_order is ReleaseOrder.INTERLEAVED:
            self.pool.free_tables(tables)
            return
        rows = sorted((g, blocks[i]) for group_ids, blocks in tables for i, g in enumerate(group_ids))
        if rows:
            self.pool.free(np.concatenate([row for _, row in rows]))


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: never hits, never caches."""

    def cache_blocks(self, request: KVRequest, hashes: dict[int, list[BlockHash]], num_tokens: int) -> None:
        return


def _find(manager: SingleTypeManager, hashes: dict[int, list[BlockHash]],
          max_length: int, blocks: bool = True) -> tuple[list[list[int]], int]:
    """The hit of every group of `manager`, looked up together, and its length in tokens (without
    `blocks`: the length only, the block lists left empty)."""
    if not blocks:
        return [], manager.hit_tokens(manager.view, hashes, max_length)
    return manager.find_hit_tokens(manager.view, hashes, max_length)


class UnitaryCoordinator(KVCacheCoordinator):
    """All groups share one hit rule (one type, one block size): a single lookup."""

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int, blocks: bool = True) -> tuple[GroupBlocks, int, list[int]]:
        out: GroupBlocks = [[] for _ in self.groups]
        tokens = 0
        for manager in self.managers:  # one manager, unless several were built for one rule
            hits, tokens = _find(manager, hashes, max_length, blocks)
            if blocks:
                for g, group_hits in zip(manager.group_ids, hits, strict=True):
                    out[g] = group_hits
        return out, tokens, [tokens] * self.num_groups


class HybridCoordinator(KVCacheCoordinator):
    """Any number of hit rules; the fixed-point lookup of the module docstring."""

    def __init__(self, managers: Sequence[SingleTypeManager], pool: BlockPool, *,
                 release_order: ReleaseOrder = ReleaseOrder.INTERLEAVED, reserve: Reserve | None = None,
                 adoption: Adoption | None = None) -> None:
        super().__init__(managers, pool, release_order=release_order, reserve=reserve, adoption=adoption)
        self._closed = [m for m in self.managers if m.downward_closed]
        self._others = [m for m in self.managers if not m.downward_closed]

    def find_longest_cache_hit(self, hashes: dict[int, list[BlockHash]],
                               max_length: int, blocks: bool = True) -> tuple[GroupBlocks, int, list[int]]:
        step = self.hit_step
        length = max_length // step * step
        first = [0] * self.num_groups
        found: list[tuple[SingleTypeManager, list[list[int]]]] = []
        for cls in self._closed:
            hits, got = _find(cls, hashes, length, blocks)
            put_groups(first, cls.group_ids, [got] * cls.num_groups)
            length = min(length, got) // step * step
            found.append((cls, hits))
        if not length:  # no group serves a block (no other class is asked; one empty list, read only)
            return [[]] * len(first), 0, first
        others = self._others
        got_of = [0] * len(others)  # per class, its last answer in tokens and its hits
        hits_of: list[list[list[int]]] = [[]] * len(others)  # (every one is replaced)
        for i, cls in enumerate(others):  # every class's first answer, each at the length left by the last
            hits_of[i], got = _find(cls, hashes, length, blocks)
            got_of[i] = got
            put_groups(first, cls.group_ids, [got] * cls.num_groups)
            assert got <= length, f"hit class answered {got} tokens when asked for {length}"
            length = got // step * step
        while got_of.count(length) < len(others):  # ask again each class that answered more than the length
            for i, cls in enumerate(others):
                if got_of[i] != length:
                    hits_of[i], got = _find(cls, hashes, length, blocks)
                    got_of[i] = got
                    assert got <= length, f"hit class answered {got} tokens when asked for {length}"
                    length = got // step * step
        out: GroupBlocks = [[]] * self.num_groups  # (every entry is replaced)
        if not blocks:
            return out, length, first
        for cls, hits in found:
            cut = -(-length // cls.block_size)  # (a partial hit keeps the block it ends in)
            put_groups(out, cls.group_ids, [h if len(h) <= cut else h[:cut] for h in hits])
        for cls, hits in zip(others, hits_of, strict=True):
            put_groups(out, cls.group_ids, hits)
        return out, length, first
