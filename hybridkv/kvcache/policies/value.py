"""Value-aware eviction: one score per free block across groups (Marconi-style), lowest evicted first.

    score(block) = release clock when it was last released + bonus[its value class]

The release clock counts released blocks, so a bonus of `num_blocks` lets a block outlive a
block of a lower class released up to one whole pool's worth of releases after it (recency
plus compute saved per byte). The classes, lowest first:

    EMPTY       no cached content (a partial block, a running state): evicted before anything
                (score -inf, the last released first, as in vLLM's queue)
    LOW         a cached sliding-window block or state checkpoint at no known hit point: only a
                later request diverging exactly there could use it, and it saves nothing alone
    FULL        a cached full-attention block: every hit through its position needs it
    ANCHOR      a window tail or state checkpoint at a known hit point (the end of a prompt or of
                a finished sequence, a branch point, a shared-prefix junction, a `cache_checkpoints`
                hint): together with the full-attention prefix before it, a usable hit
    HOT         every block of a hit whose end was hit before (`checkpoints.Anchors`): a prefix that
                recurs, like a system prompt, rather than a chat turn its next turn extends once
    PROTECTED   a block a waiting request's hit will take (queue-aware retention)

A block's class is the highest of its group kind's class (full attention: FULL, others: LOW)
and the marks set on it while it was held (`mark`); the marks are forgotten when the block is
reused. An ANCHOR block gets only a share w in [0, 1] of its class's bonus (`mark` / `weigh`, the
highest share set; 1 when none is): how often anchors of its kind were hit, relative to the kind hit
most often (`checkpoints.ReuseRates`), so a prompt end or a sequence end that no request ever
extends leaves like an unanchored block while the system prompt's end stays. Within a class
blocks leave in release order (ANCHOR: by score), so a chain released tail first is evicted
from the tail. Each class is a FIFO of (block, clock) with lazy deletion (a hit that takes a
block back bumps its stamp), ANCHOR a heap of (score, clock, block), so `pop` is O(classes)
per block (ANCHOR: O(log n)) and `release` O(1) per block (ANCHOR: O(log n)).

`ValuePolicy` satisfies the `EvictionPolicy` protocol of `eviction.py`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import ConfigError, IntegrityError
from hybridkv.kvcache.eviction import BlockValue, Ids
from hybridkv.plan.specs import SpecKind

#: queue entries per block above which the stale ones are dropped (`ValuePolicy._drop_stale`)
STALE_ENTRIES_PER_BLOCK = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueWeights:
    """Bonus of each class, in pools' worth of releases (`bonus * num_blocks` clock ticks)."""

    low: float = 0.0
    full: float = 1.0
    anchor: float = 1.0
    hot: float = 4.0
    protected: float = 8.0

    def __post_init__(self) -> None:
        values = (self.low, self.full, self.anchor, self.hot, self.protected)
        if any(v < 0 for v in values) or list(values) != sorted(values):
            raise ConfigError(f"value weights must be >= 0 and ordered low <= full <= anchor <= hot <= protected, "
                              f"got {self}")

    @classmethod
    def recency_only(cls) -> ValueWeights:
        """No class bonus: content-free blocks first, then release order (LRU with empty blocks first)."""
        return cls(low=0.0, full=0.0, anchor=0.0, hot=0.0, protected=0.0)

    def bonuses(self, num_blocks: int) -> tuple[float, ...]:
        """Per class (EMPTY first): the clock ticks added to a block's release time."""
        return (-float("inf"), self.low * num_blocks, self.full * num_blocks, self.anchor * num_blocks,
                self.hot * num_blocks, self.protected * num_blocks)


def kind_value(kind: SpecKind) -> BlockValue:
    """The class a cached block of this group kind has with no mark."""
    return BlockValue.FULL if kind is SpecKind.FULL else BlockValue.LOW


class ValuePolicy:
    """Per class a FIFO of (block, release clock, stamp); see the module docstring."""

    def __init__(self, num_blocks: int, has_content: NDArray[np.bool_], weights: ValueWeights | None = None) -> None:
        self._content = has_content
        #: the class bonuses in use (`set_weights` changes them)
        self.weights = weights or ValueWeights()
        self._bonus = self.weights.bonuses(num_blocks)
        #: per class a FIFO of (block, clock, stamp); EMPTY's and ANCHOR's stay empty (`_empty`, `_anchors`)
        self._queues: list[deque[tuple[int, int, int]]] = [deque() for _ in BlockValue]
        self._stamp = [0] * num_blocks  # bumped when a block leaves the free set
        self._where = [-1] * num_blocks  # class of a free block, -1 when held
        self._marks = [0] * num_blocks  # the highest mark set since the block was last reused
        self._share = [1.0] * num_blocks  # an ANCHOR block's share of its bonus (`weigh`; 1: none set)
        self._weighed = [False] * num_blocks  # whether `weigh` set the share since the block was reused
        self._anchors: list[tuple[float, int, int, int]] = []  # ANCHOR's heap: (score, clock, block, stamp)
        self._max_entries = STALE_ENTRIES_PER_BLOCK * num_blocks + 64  # (`_drop_stale`)
        self._kind_value = [int(BlockValue.LOW)] * num_blocks
        self._group_of: NDArray[np.int64] | None = None
        self._group_values: list[int] = []
        self._clock = 0
        self._empty = list(range(num_blocks - 1, 0, -1))  # every block starts empty, reused in id order
        for b in range(1, num_blocks):
            self._where[b] = BlockValue.EMPTY
        self.num_free = num_blocks - 1

    def set_weights(self, weights: ValueWeights) -> None:
        """Take `weights` from now on: the queued blocks are scored with them at once (ANCHOR's heap
        re-scored, O(n)); the online choice switches between weightings (`ghosts.py`)."""
        self.weights = weights
        self._bonus = weights.bonuses(len(self._stamp))
        anchor = self._bonus[BlockValue.ANCHOR]
        share = self._share
        self._anchors = [(clock + anchor * share[block], clock, block, stamp)
                         for _, clock, block, stamp in self._anchors]
        heapq.heapify(self._anchors)

    def bind(self, group_of: NDArray[np.int64], kinds: Sequence[SpecKind]) -> None:
        """Read each block's group (the pool's array) and each group's kind, for its base class."""
        self._group_of = group_of
        self._group_values = [int(kind_value(k)) for k in kinds]

    def mark(self, ids: Sequence[int], value: BlockValue, share: float | None = None) -> None:
        """Raise the class of held blocks `ids` to at least `value` (applied when released); an ANCHOR
        mark with a `share` also gives them that share of the ANCHOR bonus (`weigh`)."""
        if share is not None and value is BlockValue.ANCHOR:
            self.weigh(ids, share)
        marks = self._marks
        for block in ids:
            if block and marks[block] < value:
                marks[block] = value

    def weigh(self, ids: Sequence[int], share: float) -> None:
        """Give held blocks `ids` at least `share` (in [0, 1]) of the ANCHOR bonus when released as
        ANCHOR (the first share set replaces the default 1)."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"an anchor's share of its bonus must be in [0, 1], got {share}")
        shares, weighed = self._share, self._weighed
        for block in ids:
            if block and (not weighed[block] or shares[block] < share):
                shares[block] = share
                weighed[block] = True

    def protect(self, ids: Sequence[int]) -> None:
        """Move free cached blocks `ids` into PROTECTED (a waiting request's hit), as if released now;
        held ones are left alone (a hit that takes a block back ends its protection)."""
        for block in ids:
            where = self._where[block] if block else -1
            if where > BlockValue.EMPTY and where != BlockValue.PROTECTED:
                self._stamp[block] += 1
                self._queues[BlockValue.PROTECTED].append((block, self._clock, self._stamp[block]))
                self._where[block] = BlockValue.PROTECTED
                self._clock += 1
        self._drop_stale()

    def _drop_stale(self) -> None:
        """Drop the entries of blocks taken back or moved since they were queued, once the queues hold
        more than `STALE_ENTRIES_PER_BLOCK` per block: eviction drops them only as it reaches them, so a
        pool that never fills would otherwise keep one entry per release for ever."""
        if len(self._anchors) + sum(map(len, self._queues)) <= self._max_entries:
            return
        stamp = self._stamp
        for queue in self._queues:
            live = [entry for entry in queue if stamp[entry[0]] == entry[2]]
            queue.clear()
            queue.extend(live)
        self._anchors = [entry for entry in self._anchors if stamp[entry[2]] == entry[3]]
        heapq.heapify(self._anchors)

    def num_entries(self) -> int:
        """Queue entries, stale ones included (bounded by `_drop_stale`)."""
        return len(self._anchors) + sum(map(len, self._queues))

    def share_of(self, block: int) -> float:
        """The share of the ANCHOR bonus `block` gets when released as ANCHOR (1 where none was set)."""
        return self._share[block]

    def value_of(self, block: int) -> BlockValue:
        """The class `block` would be released into now."""
        if not self._content[block]:
            return BlockValue.EMPTY
        base = self._group_values[int(self._group_of[block])] if self._group_of is not None else BlockValue.LOW
        return BlockValue(max(base, self._marks[block]))

    # -- the EvictionPolicy protocol ---------------------------------------------------------------

    def pop_few(self, num_blocks: int) -> list[int]:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        out: list[int] = []
        empty = self._empty
        while empty and len(out) < num_blocks:
            out.append(empty.pop())
        queues, bonus, stamp, anchors = self._queues, self._bonus, self._stamp, self._anchors
        while len(out) < num_blocks:
            best = -1
            best_score = 0.0
            for value in range(1, len(queues)):
                if value == BlockValue.ANCHOR:
                    while anchors and stamp[anchors[0][2]] != anchors[0][3]:
                        heapq.heappop(anchors)  # (lazy deletion, as below)
                    if anchors and (best < 0 or anchors[0][0] < best_score):
                        best, best_score = value, anchors[0][0]
                    continue
                queue = queues[value]
                while queue and stamp[queue[0][0]] != queue[0][2]:
                    queue.popleft()  # taken back by a hit (or moved) since it was queued
                if queue:
                    score = queue[0][1] + bonus[value]
                    if best < 0 or score < best_score:
                        best, best_score = value, score
            assert best >= 0, "the value policy holds fewer blocks than num_free says"
            out.append(heapq.heappop(anchors)[2] if best == BlockValue.ANCHOR else queues[best].popleft()[0])
        marks, where, shares, weighed = self._marks, self._where, self._share, self._weighed
        for block in out:
            stamp[block] += 1
            marks[block] = 0
            shares[block] = 1.0
            weighed[block] = False
            where[block] = -1
        self.num_free -= num_blocks
        return out

    def pop(self, num_blocks: int) -> Ids:
        return np.array(self.pop_few(num_blocks), np.int64)

    def remove_few(self, ids: list[int]) -> None:
        stamp, where = self._stamp, self._where
        for block in ids:
            assert where[block] >= 0, f"block {block} is not free"
            if where[block] == BlockValue.EMPTY:
                self._empty.remove(block)
            stamp[block] += 1
            where[block] = -1
        self.num_free -= len(ids)

    def remove(self, ids: Ids) -> None:
        self.remove_few(ids.tolist())

    def release_few(self, ids: list[int]) -> None:
        queues, stamp, where, clock = self._queues, self._stamp, self._where, self._clock
        for block in ids:
            value = self.value_of(block)
            where[block] = value
            if value is BlockValue.EMPTY:
                self._empty.append(block)
            elif value is BlockValue.ANCHOR:
                score = clock + self._bonus[value] * self._share[block]
                heapq.heappush(self._anchors, (score, clock, block, stamp[block]))
                clock += 1
            else:
                queues[value].append((block, clock, stamp[block]))
                clock += 1
        self._clock = clock
        self.num_free += len(ids)
        self._drop_stale()

    def release(self, ids: Ids) -> None:
        self.release_few(ids.tolist())

    def release_cached(self, ids: Ids) -> None:
        self.release_few(ids.tolist())

    def ordered(self) -> list[int]:
        """Every free block in eviction order (EMPTY last released first, then by score)."""
        out = self._empty[::-1]
        live = []
        queued = [(value, clock + self._bonus[value], clock, block, stamp)
                  for value in range(1, len(self._queues)) for block, clock, stamp in self._queues[value]]
        queued += [(int(BlockValue.ANCHOR), score, clock, block, stamp) for score, clock, block, stamp in self._anchors]
        for value, score, clock, block, stamp in queued:
            if self._stamp[block] == stamp:
                if self._where[block] != value:
                    raise IntegrityError(f"block {block} is queued as class {value} but recorded as "
                                         f"{self._where[block]}")
                live.append((score, value, clock, block))
        live.sort()
        out += [block for *_, block in live]
        if len(out) != self.num_free:
            raise IntegrityError(f"value policy holds {len(out)} free blocks but num_free={self.num_free}")
        return out
