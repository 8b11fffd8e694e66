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
from the tail. The free cached blocks wait in runs, one per release (`value_runs.py`): a
release of a state's k pages or of a request's tables is one run of arrays, so `release`,
`protect` and `pop` cost a few array operations per run, not a Python step per block, and a
block taken back by a hit is skipped lazily (its stamp moved on). Per-block state (class,
marks, shares, stamps) lives in arrays indexed by block id; the empty blocks never used are a
range, not a list, so a pool of millions of blocks costs ~20 bytes per block.

`ValuePolicy` satisfies the `EvictionPolicy` protocol of `eviction.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import ConfigError, IntegrityError
from hybridkv.kvcache.eviction import BlockValue, Ids
from hybridkv.kvcache.policies.value_runs import RunQueues
from hybridkv.plan.specs import SpecKind

#: queue entries per block above which the stale ones are dropped (`ValuePolicy._drop_stale`)
STALE_ENTRIES_PER_BLOCK = 4
#: classes as plain ints for array comparisons (an IntEnum operand takes numpy's slow path: 3x per call)
_EMPTY, _PROTECTED = int(BlockValue.EMPTY), int(BlockValue.PROTECTED)


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
    """The free blocks: the empty ones on a stack, the cached ones in `value_runs.RunQueues`; see the
    module docstring. Per-block state lives in arrays indexed by block id."""

    def __init__(self, num_blocks: int, has_content: NDArray[np.bool_], weights: ValueWeights | None = None) -> None:
        self._content = has_content
        #: the class bonuses in use (`set_weights` changes them)
        self.weights = weights or ValueWeights()
        self._bonus = self.weights.bonuses(num_blocks)
        self._num_blocks = num_blocks
        self._stamp = np.zeros(num_blocks, np.int64)  # bumped when a block leaves the free set (or moves)
        self._where = np.zeros(num_blocks, np.int8)  # class of a free block, -1 when held
        self._where[0] = -1
        self._marks = np.zeros(num_blocks, np.int8)  # the highest mark set since the block was last reused
        self._share = np.ones(num_blocks, np.float64)  # an ANCHOR block's share of its bonus (`weigh`; 1: none set)
        self._weighed = np.zeros(num_blocks, np.bool_)  # whether `weigh` set the share since the block was reused
        self._runs = RunQueues(self._stamp)
        self._max_entries = STALE_ENTRIES_PER_BLOCK * num_blocks + 64  # (`_drop_stale`)
        self._group_of: NDArray[np.int64] | None = None
        self._group_values: NDArray[np.int8] = np.zeros(0, np.int8)
        self._clock = 0
        # EMPTY: the released ones on a stack (top = last), above the never-used ones [_fresh, num_blocks),
        # reused in id order (a never-used block taken back is remembered in `_taken_fresh`)
        self._empty: list[int] = []
        self._fresh = 1
        self._taken_fresh: set[int] = set()
        self.num_free = num_blocks - 1

    def set_weights(self, weights: ValueWeights) -> None:
        """Take `weights` from now on: every queued block is re-scored with them at once (its class and
        release clock kept; O(n)); the online choice switches between weightings (`ghosts.py`)."""
        self.weights = weights
        self._bonus = weights.bonuses(self._num_blocks)
        _, values, clocks, blocks = self._runs.live_entries()
        self._runs = RunQueues(self._stamp)
        order = np.argsort(clocks, kind="stable")
        values, clocks, blocks = values[order], clocks[order], blocks[order]
        for value in np.unique(values).tolist():
            chosen = values == value
            self._queue(value, blocks[chosen], clocks[chosen])

    def bind(self, group_of: NDArray[np.int64], kinds: Sequence[SpecKind]) -> None:
        """Read each block's group (the pool's array) and each group's kind, for its base class."""
        self._group_of = group_of
        self._group_values = np.array([int(kind_value(k)) for k in kinds], np.int8)

    def mark(self, ids: Sequence[int], value: BlockValue, share: float | None = None) -> None:
        """Raise the class of held blocks `ids` to at least `value` (applied when released); an ANCHOR
        mark with a `share` also gives them that share of the ANCHOR bonus (`weigh`)."""
        if share is not None and value is BlockValue.ANCHOR:
            self.weigh(ids, share)
        blocks = _real(ids)
        if len(blocks):
            self._marks[blocks] = np.maximum(self._marks[blocks], int(value))

    def weigh(self, ids: Sequence[int], share: float) -> None:
        """Give held blocks `ids` at least `share` (in [0, 1]) of the ANCHOR bonus when released as
        ANCHOR (the first share set replaces the default 1)."""
        if not 0.0 <= share <= 1.0:
            raise ConfigError(f"an anchor's share of its bonus must be in [0, 1], got {share}")
        blocks = _real(ids)
        if len(blocks):
            self._share[blocks] = np.where(self._weighed[blocks], np.maximum(self._share[blocks], share), share)
            self._weighed[blocks] = True

    def protect(self, ids: Sequence[int] | Ids) -> None:
        """Move free cached blocks `ids` into PROTECTED (a waiting request's hit), as if released now;
        held ones are left alone (a hit that takes a block back ends its protection)."""
        blocks = _real(ids)
        where = self._where[blocks]
        blocks = blocks[(where > _EMPTY) & (where != _PROTECTED)]
        if len(blocks) > 1:  # each block once, at its first place
            _, first = np.unique(blocks, return_index=True)
            if len(first) < len(blocks):
                blocks = blocks[np.sort(first)]
        if len(blocks):
            self._stamp[blocks] += 1
            self._where[blocks] = _PROTECTED
            self._queue(int(BlockValue.PROTECTED), blocks)
        self._drop_stale()

    def _queue(self, value: int, blocks: Ids, clocks: Ids | None = None) -> None:
        """Queue `blocks` in class `value` at `clocks` (default: the next ones, in order)."""
        if clocks is None:
            clocks = np.arange(self._clock, self._clock + len(blocks), dtype=np.int64)
            self._clock += len(blocks)
        bonus = self._bonus[value]
        scores = np.asarray(clocks + (bonus * self._share[blocks] if value == BlockValue.ANCHOR else bonus),
                            np.float64)
        self._runs.push(value, blocks, clocks, scores)

    def _drop_stale(self) -> None:
        """Drop the entries of blocks taken back or moved since they were queued, once the queues hold
        more than `STALE_ENTRIES_PER_BLOCK` per block or twice the free cached blocks: eviction drops
        them only as it reaches them, so a pool that never fills would otherwise keep one entry per
        release for ever (and a pool of 10M blocks up to 40M of them)."""
        if self._runs.entries > self._max_entries or self._runs.entries > 2 * self._cached_free() + 64:
            self._runs.drop_stale()  # (then at least half of them were stale: O(1) per entry dropped)

    def _cached_free(self) -> int:
        """Free blocks that are not empty: the live entries there can be at most."""
        return self.num_free - len(self._empty) - (self._num_blocks - self._fresh - len(self._taken_fresh))

    def num_entries(self) -> int:
        """Queue entries, stale ones included (bounded by `_drop_stale`)."""
        return self._runs.entries

    def share_of(self, block: int) -> float:
        """The share of the ANCHOR bonus `block` gets when released as ANCHOR (1 where none was set)."""
        return float(self._share.item(block))

    def value_of(self, block: int) -> BlockValue:
        """The class `block` would be released into now."""
        return BlockValue(int(self._values(np.array([block], np.int64))[0]))

    def _values(self, blocks: Ids) -> NDArray[np.int8]:
        """The class each of `blocks` would be released into now."""
        content = self._content[blocks]
        values = np.zeros(len(blocks), np.int8)
        if np.count_nonzero(content):
            cached = blocks[content]
            base = (self._group_values[self._group_of[cached]] if self._group_of is not None
                    else np.full(len(cached), int(BlockValue.LOW), np.int8))
            values[content] = np.maximum(base, self._marks[cached])
        return values

    # -- the EvictionPolicy protocol ---------------------------------------------------------------

    def pop(self, num_blocks: int) -> Ids:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        parts: list[Ids] = []
        empty = self._empty
        left = num_blocks
        if empty:
            top = empty[max(0, len(empty) - left) :]
            top.reverse()
            del empty[max(0, len(empty) - left) :]
            parts.append(np.array(top, np.int64))
            left -= len(top)
        while left and self._fresh < self._num_blocks:  # the never-used blocks, in id order
            stop = min(self._num_blocks, self._fresh + left)
            fresh = np.arange(self._fresh, stop, dtype=np.int64)
            if self._taken_fresh:
                taken = [b for b in range(self._fresh, stop) if b in self._taken_fresh]
                self._taken_fresh.difference_update(taken)
                fresh = fresh[~np.isin(fresh, taken)]
            self._fresh = stop
            parts.append(fresh)
            left -= len(fresh)
        if left:
            parts.append(self._runs.take(left))
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._stamp[out] += 1
        self._marks[out] = 0
        self._share[out] = 1.0
        self._weighed[out] = False
        self._where[out] = -1
        self.num_free -= num_blocks
        return out

    def pop_few(self, num_blocks: int) -> list[int]:
        out: list[int] = self.pop(num_blocks).tolist()
        return out

    def remove(self, ids: Ids) -> None:
        where = self._where[ids]
        assert np.count_nonzero(where < 0) == 0, f"blocks {ids[where < 0].tolist()} are not free"
        for block in ids[where == _EMPTY].tolist():
            if block >= self._fresh:
                self._taken_fresh.add(block)
            else:
                self._empty.remove(block)
        self._stamp[ids] += 1
        self._where[ids] = -1
        self.num_free -= len(ids)

    def remove_few(self, ids: list[int]) -> None:
        self.remove(np.array(ids, np.int64))

    def release(self, ids: Ids) -> None:
        values = self._values(ids)
        self._where[ids] = values
        queued = values != _EMPTY
        count = int(np.count_nonzero(queued))
        if count < len(ids):
            self._empty += ids[~queued].tolist()
        if count:
            blocks, values = (ids, values) if count == len(ids) else (ids[queued], values[queued])
            clocks = np.arange(self._clock, self._clock + count, dtype=np.int64)
            self._clock += count
            per_class = np.bincount(values, minlength=len(BlockValue))
            for value in np.flatnonzero(per_class).tolist():
                if per_class[value] == count:
                    self._queue(value, blocks, clocks)
                else:
                    chosen = values == value
                    self._queue(value, blocks[chosen], clocks[chosen])
        self.num_free += len(ids)
        self._drop_stale()

    def release_few(self, ids: list[int]) -> None:
        self.release(np.array(ids, np.int64))

    def release_cached(self, ids: Ids) -> None:
        self.release(ids)

    def ordered(self) -> list[int]:
        """Every free block in eviction order (EMPTY last released first, then by score)."""
        out = self._empty[::-1]
        out += [b for b in range(self._fresh, self._num_blocks) if b not in self._taken_fresh]
        scores, values, clocks, blocks = self._runs.live_entries()
        wrong = np.flatnonzero(self._where[blocks] != values)
        if len(wrong):
            block = int(blocks[wrong[0]])
            raise IntegrityError(f"block {block} is queued as class {int(values[wrong[0]])} but recorded as "
                                 f"{int(self._where[block])}")
        out += blocks[np.lexsort((blocks, clocks, values, scores))].tolist()
        if len(out) != self.num_free:
            raise IntegrityError(f"value policy holds {len(out)} free blocks but num_free={self.num_free}")
        return out


def _real(ids: Sequence[int] | Ids) -> Ids:
    """`ids` as an array without the null block."""
    blocks = np.asarray(ids, np.int64)
    return blocks[blocks != 0] if np.count_nonzero(blocks) != len(blocks) else blocks
