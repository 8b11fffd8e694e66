"""Eviction policies: which free block the pool reuses next.

A policy owns the *free* blocks (ref count 0), whether or not they still hold cached content.
The block pool asks it for blocks to reuse (`pop`), tells it about blocks a prefix hit takes
back (`remove`) and about blocks whose last holder let go (`release`). The pool itself drops the
stale hash of a popped block, so a policy only decides the order.

`LRUPolicy` is the reference behaviour, vLLM's free queue unchanged: a released block that
holds no cached content (a partial block, a cross-attention block, a Mamba running state) goes
to the *front*, since evicting it loses nothing; cached blocks go to the back in release order
(vLLM 0.32's free queue treats blocks without a hash the same way). A smarter,
usefulness-aware policy plugs in here (design.md section 4, 8.7).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

from hybridkv.core.block_pool import Block
from hybridkv.core.errors import IntegrityError


class EvictionPolicyName(Enum):
    """The eviction policies a `KVCacheManager` can be built with."""

    LRU = "lru"


class EvictionPolicy(Protocol):
    """Contract of an eviction policy.

    `num_free` is the number of blocks it holds. `pop(n)` removes and returns the n blocks to
    reuse next (n <= num_free, checked by the caller). `remove(blocks)` takes back blocks that
    it holds (a prefix hit). `release(blocks)` adds blocks whose ref count just dropped to 0,
    in release order (a request's tail first). `ordered()` lists its blocks in eviction order,
    checking its own structure and raising `IntegrityError` on a broken one.
    """

    num_free: int

    def pop(self, num_blocks: int) -> list[Block]: ...

    def remove(self, blocks: list[Block]) -> None: ...

    def release(self, blocks: list[Block]) -> None: ...

    def ordered(self) -> list[Block]: ...


class LRUPolicy:
    """vLLM's free queue as two Python lists; front = evicted first; every operation O(1)
    amortized, and the bulk ones (release, pop) at list-slice speed.

        front stack:  content-free blocks, the last released on top (reused first)
        queue:        cached blocks (and the initial blocks, by id) in release order
        order:        front stack top .. bottom, then queue[head:] without holes

    A prefix hit that takes a block back (`remove`) leaves a hole (None) at the block's queue
    position (`Block.queue_pos`, an absolute index: the list is compacted from the front);
    the positions of holes sit in a heap, so `pop` only walks a slice that holds one. Only
    cached blocks are ever removed, and they live in the queue.
    """

    def __init__(self, free_blocks: Sequence[Block]) -> None:
        self._front: list[Block] = []
        self._queue: list[Block | None] = list(free_blocks)
        for pos, block in enumerate(free_blocks):
            block.queue_pos = pos
        self._head = 0  # index of the first live entry of `_queue`
        self._base = 0  # absolute position of `_queue[0]`
        self._holes: list[int] = []  # absolute positions of holes at or after the head
        self.num_free = len(free_blocks)

    def pop(self, num_blocks: int) -> list[Block]:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        self.num_free -= num_blocks
        front = self._front
        out: list[Block] = []
        if front:
            take = min(num_blocks, len(front))
            out = front[len(front) - take:]
            out.reverse()
            del front[len(front) - take:]
            num_blocks -= take
            if not num_blocks:
                return out
        queue = self._queue
        head = self._head
        stop = head + num_blocks
        holes = self._holes
        if holes and holes[0] - self._base < stop:
            return out + self._pop_around_holes(num_blocks)
        out += queue[head:stop]  # type: ignore[arg-type]  # no hole in the slice
        self._head = stop
        if stop > 4096 and stop * 2 > len(queue):
            self._compact()
        return out

    def _pop_around_holes(self, num_blocks: int) -> list[Block]:
        queue = self._queue
        holes = self._holes
        out: list[Block] = []
        head = self._head
        while len(out) < num_blocks:
            stop = head + num_blocks - len(out)
            out += [b for b in queue[head:stop] if b is not None]
            head = stop
            while holes and holes[0] - self._base < head:
                heapq.heappop(holes)
        self._head = head
        return out

    def _compact(self) -> None:
        del self._queue[: self._head]
        self._base += self._head
        self._head = 0

    def remove(self, blocks: list[Block]) -> None:
        queue = self._queue
        base = self._base
        holes = self._holes
        for block in blocks:
            pos = block.queue_pos
            assert queue[pos - base] is block, f"block {block.block_id} is not at its free-queue position"
            queue[pos - base] = None
            heapq.heappush(holes, pos)
        self.num_free -= len(blocks)

    def release(self, blocks: list[Block]) -> None:
        self.num_free += len(blocks)
        lead = 0  # the content-free blocks a request's tail puts first (its partial blocks)
        for block in blocks:
            if block.block_hash is not None:
                break
            lead += 1
        rest = blocks
        if lead:
            self._front += blocks[:lead]
            rest = blocks[lead:]
        queue = self._queue
        pos = self._base + len(queue)
        for block in rest:
            if block.block_hash is None:
                break
            block.queue_pos = pos
            pos += 1
        else:  # the rest holds content: to the back, in order
            queue += rest
            return
        pos = self._base + len(queue)
        front = self._front
        for block in rest:
            if block.block_hash is None:
                front.append(block)
            else:
                block.queue_pos = pos
                pos += 1
                queue.append(block)

    def ordered(self) -> list[Block]:
        out = self._front[::-1]
        base = self._base
        live = self._queue[self._head:]
        for index, block in enumerate(live, start=self._head + base):
            if block is None:
                continue
            if block.queue_pos != index:
                raise IntegrityError(
                    f"LRU free queue entry {index} is block {block.block_id}, whose position says {block.queue_pos}"
                )
            out.append(block)
        holes = len(live) - (len(out) - len(self._front))
        if holes != len(self._holes) or len(out) != self.num_free:
            raise IntegrityError(
                f"LRU free queue holds {len(out)} blocks and {holes} holes but num_free={self.num_free} "
                f"and {len(self._holes)} holes are recorded"
            )
        return out


PolicyFactory = Callable[[Sequence[Block]], EvictionPolicy]

POLICIES: dict[EvictionPolicyName, PolicyFactory] = {
    EvictionPolicyName.LRU: LRUPolicy,
}
