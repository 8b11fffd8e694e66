"""Copy on write: the block copies an allocation needs before the step's forward.

Two cases make a request's table take a copy of a cached block rather than the block itself:
a partial hit (a hit ending inside a block, `prefix_match_unit` below a state group's block: the
request goes on writing that block) and one running state per request (`RunningState.FIXED`: a
state checkpoint hit is copied into the request's running block). `plan` says per manager which
entry is copied from which blocks, `apply` takes the copies' blocks from the allocation and
records them, `take` hands them to the engine (`KVCacheManager.take_pending_copies`). Both ends
of a copy hold a reference until then, so neither is reused before the copy runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.eviction import Ids
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.seams import Adoption
from hybridkv.kvcache.type_managers.base import SingleTypeManager


class CopyOnWrite:
    """The copies of the current schedule (module docstring)."""

    def __init__(self, managers: Sequence[SingleTypeManager], pool: BlockPool, num_groups: int,
                 adoption: Adoption | None) -> None:
        self.managers = tuple(managers)
        self.pool = pool
        self.num_groups = num_groups
        self.adoption = adoption
        #: copies (group, src, dst) since the last `take`, in allocation order
        self.copies: list[tuple[int, int, int]] = []
        #: the blocks each copy holds a reference to until `take` (src and dst of each)
        self.retained: list[int] = []

    def plan(self, rid: RequestId, running: bool, manager_hits: list[list[list[int]] | None], hit_tokens: int,
             adopted: list[int]) -> list[tuple[int, list[int]] | None]:
        """Per manager, (entry, source block per group) to copy on write in this allocate, or None; a
        state hit moved instead (`StateAdoption.allows`) goes to `adopted`."""
        out: list[tuple[int, list[int]] | None] = []
        for m, hits in zip(self.managers, manager_hits, strict=True):
            cow = None
            if m.partial_unit:
                if hits and hits[0] and hit_tokens % m.block_size:  # a partial hit: the block it ends in
                    index = hit_tokens // m.block_size
                    cow = index, [row[index] for row in hits]
                elif running:
                    cow = m.producer_cow(rid)
            elif m.copies_hits and hits and hits[0]:  # the checkpoint hit, copied into the running block
                sources = [row[-1] for row in hits]
                if not running and self.adoption is not None and self.adoption.allows(sources):
                    adopted += sources  # (ADOPT: the hit block is the running block, `_fill`)
                else:
                    cow = len(hits[0]) - 1, sources
            out.append(cow)
        return out

    def apply(self, rid: RequestId, running: bool, cows: list[tuple[int, list[int]] | None],
              fresh: list[Sequence[int] | Ids]) -> list[Sequence[int]]:
        """Take each copy's block (the first popped of its group, so `fresh` keeps the rest) and
        record the copies. A new request's table takes the copy in place of the hit block; a
        running request keeps its block and its partial entry moves to the copy. Both ends of a
        copy keep a reference until `take` (the copy runs before the step's forward)."""
        pool = self.pool
        copied: list[Sequence[int]] = [()] * self.num_groups
        for m, cow in zip(self.managers, cows, strict=True):
            if cow is None:
                continue
            index, sources = cow
            dsts = []
            for g, src in zip(m.group_ids, sources, strict=True):
                dst = int(fresh[g][0])
                fresh[g] = fresh[g][1:]
                dsts.append(dst)
                self.copies.append((g, src, dst))
                self.retained += (src, dst)
                if running:
                    pool.partial.move(g, src, dst)
                    pool.ref_cnt[src] += 1
                else:
                    pool.ref_cnt[dst] += 1
                    copied[g] = () if m.copies_hits else (dst,)  # (FIXED: the table's new last entry)
            if running:
                m.producer_copied(rid, dsts)
            else:
                m.apply_cow(rid, index, dsts)
        return copied

    def take(self) -> list[tuple[int, int, int]]:
        """The pending copies (group, src, dst), group by group; their references are dropped."""
        copies = self.copies
        if not copies:
            return []
        order = sorted(range(len(copies)), key=lambda i: copies[i][0])
        self.pool.free([b for i in order for b in self.retained[2 * i : 2 * i + 2]])
        self.copies, self.retained = [], []
        return [copies[i] for i in order]
