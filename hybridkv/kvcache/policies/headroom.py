"""Admission headroom (`AdmissionHeadroom`): what a new request's first allocation must leave free.

NEXT_BLOCK: one block per group for every running request (what each needs when it crosses its
next block boundary), so a request admitted into the last free blocks is not preempted by the
first running request that does. WAITING_HITS: also the free cached blocks the waiting requests'
hits will take (the scheduler names them each step through `KVCacheManager.protect_waiting`), so
admitting one request does not evict the prefix another waiting request would hit.

The coordinator asks `blocks(hits, running)` when it admits a request; nothing else reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.options import AdmissionHeadroom


class AdmissionReserve:
    """The blocks a new request must leave free (module docstring)."""

    def __init__(self, pool: BlockPool, *, mode: AdmissionHeadroom, num_groups: int) -> None:
        self._pool = pool
        self.blocks_per_running = num_groups
        self.keeps_waiting_hits = mode is AdmissionHeadroom.WAITING_HITS
        #: the blocks the waiting requests' hits take, as named this step (every request's array, kept as given:
        #: the set is built only when an admission reads it, not for each of hundreds of page groups' blocks)
        self._named: list[np.ndarray] = []
        self._distinct: np.ndarray | None = None  # `_named`'s ids, each once (until more are named)

    @property
    def waiting_hits(self) -> set[int]:
        """The blocks the waiting requests' hits take (named again every step)."""
        return set(np.concatenate(self._named).tolist()) if self._named else set()

    def blocks(self, hits: Sequence[Sequence[int]] | None, running: int) -> int:
        """Blocks to leave free when a request whose hit is `hits` joins `running` requests."""
        reserve = self.blocks_per_running * running
        if self._named and running:  # (the waiting hits free and still cached, less the request's own)
            pool = self._pool
            if self._distinct is None:  # (several admissions in a step read the same names)
                self._distinct = np.unique(np.concatenate(self._named))
            ids = self._distinct
            kept = ids[(pool.ref_cnt[ids] == 0) & pool.has_hash[ids]].tolist()
            if kept:  # (a state hit's rows are mostly null: one set built in C, null never kept)
                reserve += len(kept) - len(set(chain.from_iterable(hits or ())).intersection(kept))
        return reserve

    def waiting(self, ids: Sequence[int] | np.ndarray) -> None:
        """A waiting request will hit `ids` (this step; an array is kept, not copied: the caller leaves it as is)."""
        if self.keeps_waiting_hits and len(ids):
            self._named.append(np.asarray(ids, np.int64))
            self._distinct = None

    def new_step(self) -> None:
        self._named.clear()
        self._distinct = None


def admission_reserve(pool: BlockPool, mode: AdmissionHeadroom, num_groups: int) -> AdmissionReserve | None:
    """The reserve for `mode`; None for NONE (vLLM's: nothing is left free)."""
    return None if mode is AdmissionHeadroom.NONE else AdmissionReserve(pool, mode=mode, num_groups=num_groups)
