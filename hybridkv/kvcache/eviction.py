"""Eviction policies: which free block the pool reuses next.

A policy owns the *free* block ids (ref count 0), whether or not they still hold cached content.
The block pool asks it for blocks to reuse (`pop`), tells it about blocks a prefix hit takes
back (`remove`) and about blocks whose last holder let go (`release`). The pool itself drops the
stale hash of a popped block, so a policy only decides the order. Block ids travel as numpy
int64 arrays: every operation is a few array operations, whatever the number of blocks.

`LRUPolicy` is the reference behaviour, vLLM's free queue unchanged: a released block that
holds no cached content (a partial block, a cross-attention block, a Mamba running state) goes
to the *front*, since evicting it loses nothing; cached blocks go to the back in release order
(vLLM 0.32's free queue treats blocks without a hash the same way). A smarter,
usefulness-aware policy plugs in here (docs/design.md §4 and §8, "eviction policy").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from itertools import chain
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from hybridkv.errors import IntegrityError
from hybridkv.plan.specs import SpecKind

Ids = NDArray[np.int64]
#: A policy is built from the pool's size and its per-block "holds cached content" flags (which
#: the pool keeps current); every block but the null block 0 starts free, in id order.
PolicyFactory = Callable[[int, NDArray[np.bool_]], "EvictionPolicy"]


class BlockValue(IntEnum):
    """The value classes of `ValuePolicy` (module docstring), lowest evicted first."""

    EMPTY = 0
    LOW = 1
    FULL = 2
    ANCHOR = 3
    HOT = 4
    PROTECTED = 5


class BlockMarks(Protocol):
    """What a value-aware policy (`policies/value.py`) takes besides the queue verbs: the class a held
    block is released into (`mark`, an ANCHOR with its `share` of the bonus), and the free cached
    blocks a waiting request will hit (`protect`). The manager hands it to whoever marks."""

    def mark(self, ids: Sequence[int], value: BlockValue, share: float | None = None) -> None: ...

    def protect(self, ids: Sequence[int] | Ids) -> None: ...

    def value_of(self, block: int) -> BlockValue: ...

    def share_of(self, block: int) -> float: ...


class EvictionPolicy(Protocol):
    """Contract of an eviction policy.

    `num_free` is the number of blocks it holds. `pop(n)` removes and returns the n blocks to
    reuse next (n <= num_free, checked by the caller). `remove(ids)` takes back blocks that it
    holds (a prefix hit; they hold cached content). `release(ids)` adds blocks whose ref count
    just dropped to 0, in release order (a request's tail first). `ordered()` lists its blocks in
    eviction order, checking its own structure and raising `IntegrityError` on a broken one.
    The `_few` variants do the same on Python lists, for the handful of blocks of a decode step
    (no array call overhead); `release_cached` is `release` of blocks that all hold cached
    content (the caller knows: no per-block check).
    """

    num_free: int

    def bind(self, group_of: NDArray[np.int64], kinds: Sequence[SpecKind]) -> None:
        """Called once by the pool: its per-block group array (kept current) and each group's kind."""

    def pop(self, num_blocks: int) -> Ids: ...

    def pop_few(self, num_blocks: int) -> list[int]: ...

    def remove(self, ids: Ids) -> None: ...

    def remove_few(self, ids: list[int]) -> None: ...

    def release(self, ids: Ids) -> None: ...

    def release_few(self, ids: list[int]) -> None: ...

    def release_cached(self, ids: Ids) -> None: ...

    def ordered(self) -> list[int]: ...


class LRUPolicy:
    """vLLM's free queue as a stack and an array; front = evicted first.

        front stack:  content-free blocks, the last released on top (reused first)
        queue:        cached blocks (and the initial blocks, by id) in release order,
                      live in _queue[head:tail]
        order:        front stack top .. bottom, then the queue without holes

    A prefix hit that takes a block back (`remove`) leaves a hole (0, the null block's id, which
    is never free) at the block's index in the array (`_pos[id]`). `pop` takes a slice and drops
    the holes in it; when the tail reaches the end of the array, the live entries move to its
    start (holes dropped, positions rewritten), so each entry is moved O(1) times on average.
    """

    def __init__(self, num_blocks: int, has_content: NDArray[np.bool_]) -> None:
        self._content = has_content
        self._front: list[int] = []
        self._queue = np.zeros(4 * num_blocks + 64, np.int64)  # (room: compacted every >= 3 * num_blocks releases)
        self._index = np.arange(len(self._queue), dtype=np.int64)  # _index[i] = i: positions to write
        self._queue[: num_blocks - 1] = np.arange(1, num_blocks)
        self._pos = np.full(num_blocks, -1, np.int64)
        self._pos[1:] = np.arange(num_blocks - 1)
        self._head = 0
        self._tail = num_blocks - 1
        self._holes = 0  # holes in _queue[head:tail]
        self.num_free = num_blocks - 1

    def bind(self, group_of: NDArray[np.int64], kinds: Sequence[SpecKind]) -> None:
        """LRU orders by release alone: it reads no groups."""
        del group_of, kinds

    def pop(self, num_blocks: int) -> Ids:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        self.num_free -= num_blocks
        front = self._front
        first: list[int] = []
        if front:
            take = min(num_blocks, len(front))
            first = front[len(front) - take :]
            first.reverse()
            del front[len(front) - take :]
            num_blocks -= take
            if not num_blocks:
                return np.array(first, np.int64)
        head = self._head
        stop = head + num_blocks
        taken = self._queue[head:stop]
        if self._holes:
            taken = taken[taken != 0]
            while len(taken) < num_blocks:  # the slice held holes: take as many more
                assert stop < self._tail, "the free queue holds fewer blocks than num_free says"
                more = self._queue[stop : stop + num_blocks - len(taken)]
                stop += len(more)
                taken = np.concatenate((taken, more[more != 0]))
            self._holes -= stop - head - num_blocks
        else:
            taken = taken.copy()
        self._head = stop
        if first:
            return np.concatenate((np.array(first, np.int64), taken))
        return taken

    def pop_few(self, num_blocks: int) -> list[int]:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        self.num_free -= num_blocks
        front = self._front
        out: list[int] = []
        if front:
            take = min(num_blocks, len(front))
            out = front[len(front) - take :]
            out.reverse()
            del front[len(front) - take :]
            num_blocks -= take
            if not num_blocks:
                return out
        head = self._head
        stop = head + num_blocks
        taken: list[int] = self._queue[head:stop].tolist()
        if self._holes:
            taken = [b for b in taken if b]
            while len(taken) < num_blocks:  # the slice held holes: take as many more
                assert stop < self._tail, "the free queue holds fewer blocks than num_free says"
                more = self._queue[stop : stop + num_blocks - len(taken)].tolist()
                stop += len(more)
                taken += [b for b in more if b]
            self._holes -= stop - head - num_blocks
        self._head = stop
        return out + taken

    def remove_few(self, ids: list[int]) -> None:
        queue = self._queue
        pos = self._pos
        for block in ids:
            index = pos.item(block)
            assert queue.item(index) == block, f"block {block} is not at its free-queue position"
            queue[index] = 0
        self._holes += len(ids)
        self.num_free -= len(ids)

    def release_few(self, ids: list[int]) -> None:
        self.num_free += len(ids)
        if self._tail + len(ids) > len(self._queue):
            self._compact(len(ids))
        content = self._content
        queue = self._queue
        pos = self._pos
        tail = self._tail
        for block in ids:
            if content.item(block):
                queue[tail] = block
                pos[block] = tail
                tail += 1
            else:
                self._front.append(block)
        self._tail = tail

    def remove(self, ids: Ids) -> None:
        index = self._pos[ids]
        assert not np.count_nonzero(self._queue[index] != ids), f"blocks {ids.tolist()} are not at their positions"
        self._queue[index] = 0
        self._holes += len(ids)
        self.num_free -= len(ids)

    def release(self, ids: Ids) -> None:
        self.num_free += len(ids)
        content = self._content[ids]
        if np.count_nonzero(content) != len(ids):  # (count_nonzero: no ufunc reduce, ~0.5 us)
            self._front += ids[~content].tolist()
            ids = ids[content]
        if len(ids):
            self._append(ids)

    def release_cached(self, ids: Ids) -> None:
        self.num_free += len(ids)
        self._append(ids)

    def _append(self, ids: Ids) -> None:
        """Put cached blocks at the back, in order."""
        count = len(ids)
        if self._tail + count > len(self._queue):
            self._compact(count)
        tail = self._tail
        self._queue[tail : tail + count] = ids
        self._pos[ids] = self._index[tail : tail + count]
        self._tail = tail + count

    def _compact(self, room: int) -> None:
        """Move the live entries (without holes) to the start of the array, growing it if
        `room` more entries would not fit."""
        live = self._queue[self._head : self._tail]
        live = live[live != 0]
        size = max(len(self._queue), 2 * (len(live) + room))
        if size > len(self._queue):
            self._queue = np.zeros(size, np.int64)
            self._index = np.arange(size, dtype=np.int64)
        self._queue[: len(live)] = live
        self._pos[live] = self._index[: len(live)]
        self._head, self._tail, self._holes = 0, len(live), 0

    def ordered(self) -> list[int]:
        out = self._front[::-1]
        live = self._queue[self._head : self._tail]
        index = np.flatnonzero(live)
        ids = live[index]
        wrong = np.flatnonzero(self._pos[ids] != index + self._head)
        if len(wrong):
            bad = int(ids[wrong[0]])
            raise IntegrityError(
                f"LRU free queue entry {int(index[wrong[0]]) + self._head} is block {bad}, whose position says "
                f"{int(self._pos[bad])}"
            )
        holes = len(live) - len(ids)
        out += ids.tolist()
        if holes != self._holes or len(out) != self.num_free:
            raise IntegrityError(
                f"LRU free queue holds {len(out)} blocks and {holes} holes but num_free={self.num_free} "
                f"and {self._holes} holes are recorded"
            )
        return out


def interleave(lists: Sequence[Sequence[int]]) -> list[int]:
    """`lists[0][0], lists[1][0], ..., lists[0][1], lists[1][1], ...`, skipping exhausted lists.

    Built from `zip` over the rows all remaining lists still have (a few slices per distinct
    length, no per-block test).
    """
    rest = [blocks for blocks in lists if blocks]
    if len(rest) == 1:
        return list(rest[0])
    out: list[int] = []
    start = 0
    while rest:
        stop = min(map(len, rest))
        if len(rest) == 1:
            out += rest[0][start:]
            break
        out += chain.from_iterable(zip(*(blocks[start:stop] for blocks in rest), strict=True))
        rest = [blocks for blocks in rest if len(blocks) > stop]
        start = stop
    return out


def interleave_rows(parts: Sequence[tuple[Sequence[int], Ids]], num_groups: int) -> Ids:
    """`interleave` of the rows of `parts` (per part: its group ids and a (groups, n) array, row i
    for group `group_ids[i]`), groups in id order, as one array (nulls included): row k of a
    (longest, groups) grid holds the k-th entry of each group, read row by row."""
    filled = [(group_ids, blocks) for group_ids, blocks in parts if blocks.size]
    if len(filled) == 1 and list(filled[0][0]) == sorted(filled[0][0]):  # the grid without the other groups
        out: Ids = filled[0][1].T.ravel()
        return out
    grid = np.zeros((max(blocks.shape[1] for _, blocks in parts), num_groups), np.int64)
    for group_ids, blocks in filled:
        first = group_ids[0]
        if group_ids[-1] - first == len(group_ids) - 1:  # consecutive groups: a slice, not a gather
            grid[: blocks.shape[1], first : first + len(group_ids)] = blocks.T
        else:
            grid[: blocks.shape[1], list(group_ids)] = blocks.T
    return grid.ravel()
