"""The queues of value-aware eviction (`value.py`): free blocks in runs, one run per release.

A release (or a protect) of many blocks at once -- a state's k pages, a request's tables -- is one
*run*: arrays of (block, release clock, stamp, score), so queueing and evicting cost a few array
operations per run, not a Python step per block. An entry is live while its block's stamp equals
the entry's (a block taken back or moved bumps its stamp; its old entries are skipped lazily):

    FIFO classes (LOW, FULL, HOT, PROTECTED)   per class a deque of runs in clock order;
                                               score = clock + the class's bonus (increasing)
    ANCHOR                                     a heap of runs keyed by their first live entry's
                                               (score, clock); each run sorted by (score, clock),
                                               score = clock + bonus x the block's share

Eviction takes the entry of least (score, class, clock) over all classes (a tie in score goes to
the lower class, as a scan of the classes in order with a strict `<` would pick), and takes as many
entries at once from one run as come before every other source's first live entry.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.eviction import BlockValue, Ids

FIFO_CLASSES = (int(BlockValue.LOW), int(BlockValue.FULL), int(BlockValue.HOT), int(BlockValue.PROTECTED))
ANCHOR = int(BlockValue.ANCHOR)
Key = tuple[float, int, int]  # (score, class, clock): the eviction order, least first


class _Candidates(NamedTuple):
    """Queue entries as arrays: key (score, value, clock), block, and the index of the source it came from."""

    scores: NDArray[np.float64]
    values: Ids
    clocks: Ids
    blocks: Ids
    source: Ids

    def joined(self, other: _Candidates) -> _Candidates:
        return _Candidates(np.concatenate([self.scores, other.scores]), np.concatenate([self.values, other.values]),
                           np.concatenate([self.clocks, other.clocks]), np.concatenate([self.blocks, other.blocks]),
                           np.concatenate([self.source, other.source]))

    @property
    def last(self) -> Key:
        return float(self.scores[-1]), int(self.values[-1]), int(self.clocks[-1])


def _least(candidates: _Candidates, count: int) -> _Candidates:
    """The `count` least of `candidates` by key, in order (every live key is distinct: clocks are)."""
    order = np.lexsort((candidates.clocks, candidates.values, candidates.scores))[:count]
    return _Candidates(candidates.scores[order], candidates.values[order], candidates.clocks[order],
                       candidates.blocks[order], candidates.source[order])


@dataclass(slots=True)
class Run:
    """Entries queued together, sorted by (score, clock); `head`: the first not taken or skipped."""

    blocks: Ids
    clocks: Ids
    stamps: Ids
    scores: NDArray[np.float64]
    head: int = 0


class RunQueues:
    """Every queued entry of the cached free blocks (module docstring); `stamp` is the policy's array."""

    def __init__(self, stamp: Ids) -> None:
        self._stamp = stamp
        self._fifo: list[deque[Run]] = [deque() for _ in BlockValue]  # (only FIFO_CLASSES are used)
        self._anchors: list[tuple[float, int, int, Run]] = []  # heap: (score, clock, sequence, run)
        self._sequence = 0  # (unique heap tie-breaker: runs never compare)
        #: entries from each run's head on, stale ones included (`drop_stale`)
        self.entries = 0

    def push(self, value: int, blocks: Ids, clocks: Ids, scores: NDArray[np.float64]) -> None:
        """Queue `blocks` in class `value` with their clocks and scores (a FIFO class: clock order)."""
        run = Run(blocks=blocks, clocks=clocks, stamps=self._stamp[blocks], scores=scores)
        self.entries += len(blocks)
        if value != ANCHOR:
            self._fifo[value].append(run)
            return
        if len(blocks) > 1:
            order = np.lexsort((clocks, scores))
            run = Run(blocks=blocks[order], clocks=clocks[order], stamps=run.stamps[order], scores=scores[order])
        self._push_anchor(run)

    def _push_anchor(self, run: Run) -> None:
        self._sequence += 1
        heapq.heappush(self._anchors, (run.scores.item(run.head), run.clocks.item(run.head), self._sequence, run))

    def _live_head(self, run: Run) -> bool:
        """Move `run.head` to its first live entry; False when it has none left."""
        head, end = run.head, len(run.blocks)
        if head >= end:
            return False
        if self._stamp.item(run.blocks.item(head)) == run.stamps.item(head):
            return True
        live = np.flatnonzero(self._stamp[run.blocks[head:]] == run.stamps[head:])
        skip = int(live[0]) if len(live) else end - head
        self.entries -= skip
        run.head = head + skip
        return bool(len(live))

    def _fifo_head(self, value: int) -> Run | None:
        queue = self._fifo[value]
        while queue:
            if self._live_head(queue[0]):
                return queue[0]
            queue.popleft()
        return None

    def _anchor_head(self) -> Run | None:
        heap = self._anchors
        while heap:
            score, clock, _, run = heap[0]
            if not self._live_head(run):
                heapq.heappop(heap)
                continue
            if run.scores.item(run.head) == score and run.clocks.item(run.head) == clock:
                return run
            self._sequence += 1  # its head moved on: re-keyed
            heapq.heapreplace(heap, (run.scores.item(run.head), run.clocks.item(run.head), self._sequence, run))
        return None

    def take(self, count: int) -> Ids:
        """Remove and return the `count` least live entries (module docstring), in order; the caller
        checked that at least `count` are queued. Candidates: each FIFO class's first `count` live
        entries, then those of each anchor run whose head comes before the `count`-th least so far; the
        `count` least are kept sorted as sources join (a sort of at most 2 x `count` per anchor run), and
        each source gives up a prefix of its own."""
        gathered: list[list[tuple[Run, Ids]]] = []
        classes: list[int] = []
        for value in FIFO_CLASSES:
            if self._fifo_head(value) is not None:
                gathered.append(self._gather(self._fifo[value], count))
                classes.append(value)
        best = _least(self._candidates(gathered, classes), count)
        popped: list[Run] = []
        while (run := self._anchor_head()) is not None:
            if len(best.blocks) == count and (run.scores.item(run.head), ANCHOR, run.clocks.item(run.head)) > best.last:
                break
            heapq.heappop(self._anchors)
            popped.append(run)
            gathered.append(self._gather([run], count))
            classes.append(ANCHOR)
            joined = self._candidates(gathered[-1:], classes[-1:], first_source=len(gathered) - 1)
            best = _least(best.joined(joined), count)
        if len(best.blocks) < count:
            raise IntegrityError(f"the value policy's queues hold {len(best.blocks)} live entries; {count} asked for")
        for parts, taken in zip(gathered, np.bincount(best.source, minlength=len(gathered)).tolist(), strict=True):
            self._consume(parts, taken)
        for run in popped:
            if run.head < len(run.blocks):
                self._push_anchor(run)
        return best.blocks

    def _gather(self, runs: Iterable[Run], count: int) -> list[tuple[Run, Ids]]:
        """Up to `count` live entries of `runs`, in order: per run, the positions taken."""
        out: list[tuple[Run, Ids]] = []
        for run in runs:
            head, end = run.head, len(run.blocks)
            window = max(2 * count, 64)
            while count and head < end:  # (a window at a time: a long run is not scanned whole)
                stop = min(end, head + window)
                live = np.flatnonzero(self._stamp[run.blocks[head:stop]] == run.stamps[head:stop])[:count] + head
                if len(live):
                    out.append((run, live))
                    count -= len(live)
                head, window = stop, 2 * window
            if not count:
                break
        return out

    @staticmethod
    def _candidates(gathered: list[list[tuple[Run, Ids]]], classes: list[int], first_source: int = 0) -> _Candidates:
        """Every candidate of `gathered` as arrays (its sources numbered from `first_source`)."""
        parts = [(run, positions, value, i) for i, (source, value) in enumerate(zip(gathered, classes, strict=True),
                                                                                start=first_source)
                 for run, positions in source]
        if not parts:
            empty = np.zeros(0, np.int64)
            return _Candidates(np.zeros(0), empty, empty, empty, empty)
        lengths = [len(p) for _, p, _, _ in parts]
        return _Candidates(np.concatenate([run.scores[p] for run, p, _, _ in parts]),
                           np.repeat(np.array([value for _, _, value, _ in parts], np.int64), lengths),
                           np.concatenate([run.clocks[p] for run, p, _, _ in parts]),
                           np.concatenate([run.blocks[p] for run, p, _, _ in parts]),
                           np.repeat(np.array([i for _, _, _, i in parts], np.int64), lengths))

    def _consume(self, parts: list[tuple[Run, Ids]], taken: int) -> None:
        """Advance each run past the first `taken` of its gathered positions (and the stale ones before)."""
        for run, positions in parts:
            if not taken:
                return
            used = min(taken, len(positions))
            stop = int(positions[used - 1]) + 1
            self.entries -= stop - run.head
            run.head = stop
            taken -= used

    def drop_stale(self) -> None:
        """Keep only the live entries of every run (and the runs that have some)."""
        stamp = self._stamp
        self.entries = 0
        for value in FIFO_CLASSES:
            runs = [self._live(run, stamp) for run in self._fifo[value]]
            self._fifo[value] = deque(run for run in runs if len(run.blocks))
            self.entries += sum(len(run.blocks) for run in self._fifo[value])
        anchors = [self._live(run, stamp) for _, _, _, run in self._anchors]
        self._anchors = []
        for run in anchors:
            if len(run.blocks):
                self.entries += len(run.blocks)
                self._push_anchor(run)

    @staticmethod
    def _live(run: Run, stamp: Ids) -> Run:
        keep = np.flatnonzero(stamp[run.blocks[run.head:]] == run.stamps[run.head:]) + run.head
        return Run(blocks=run.blocks[keep], clocks=run.clocks[keep], stamps=run.stamps[keep], scores=run.scores[keep])

    def live_entries(self) -> tuple[NDArray[np.float64], Ids, Ids, Ids]:
        """Every live entry as arrays (score, class, clock, block), unordered (for `ordered`)."""
        runs = [(value, run) for value in FIFO_CLASSES for run in self._fifo[value]]
        runs += [(ANCHOR, run) for _, _, _, run in self._anchors]
        parts = [(value, self._live(run, self._stamp)) for value, run in runs]
        if not parts:
            empty = np.zeros(0, np.int64)
            return np.zeros(0), empty, empty, empty
        return (np.concatenate([run.scores for _, run in parts]),
                np.concatenate([np.full(len(run.blocks), value, np.int64) for value, run in parts]),
                np.concatenate([run.clocks for _, run in parts]), np.concatenate([run.blocks for _, run in parts]))
