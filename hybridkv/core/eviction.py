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

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

from hybridkv.core.block_pool import Block
from hybridkv.core.errors import IntegrityError
from hybridkv.core.ids import BlockId


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
    """A doubly-linked free queue with sentinels; front = evicted first; every operation O(1).

    Initial order is by block id. Popped blocks keep stale `prev`/`next` links (clearing them
    would cost two writes per block on the hot path); only queue members are ever unlinked.
    """

    def __init__(self, free_blocks: Sequence[Block]) -> None:
        self._head = Block(block_id=BlockId(-1))
        self._tail = Block(block_id=BlockId(-2))
        prev = self._head
        for block in free_blocks:
            prev.next = block
            block.prev = prev
            prev = block
        prev.next = self._tail
        self._tail.prev = prev
        self.num_free = len(free_blocks)

    def pop(self, num_blocks: int) -> list[Block]:
        assert num_blocks <= self.num_free, f"pop({num_blocks}) from {self.num_free} free blocks"
        head = self._head
        node = head.next
        out: list[Block] = []
        append = out.append
        for _ in range(num_blocks):
            assert node is not None
            append(node)
            node = node.next
        assert node is not None
        head.next = node
        node.prev = head
        self.num_free -= num_blocks
        return out

    def remove(self, blocks: list[Block]) -> None:
        for block in blocks:
            prev, nxt = block.prev, block.next
            assert prev is not None and nxt is not None
            prev.next = nxt
            nxt.prev = prev
        self.num_free -= len(blocks)

    def release(self, blocks: list[Block]) -> None:
        tail = self._tail
        last = tail.prev
        assert last is not None
        content_free: list[Block] = []
        for block in blocks:
            if block.block_hash is None:
                content_free.append(block)
                continue
            last.next = block
            block.prev = last
            last = block
        last.next = tail
        tail.prev = last
        head = self._head
        for block in content_free:
            first = head.next
            assert first is not None
            block.prev = head
            block.next = first
            first.prev = block
            head.next = block
        self.num_free += len(blocks)

    def ordered(self) -> list[Block]:
        out: list[Block] = []
        prev = self._head
        node = self._head.next
        while node is not self._tail:
            if node is None or node.prev is not prev or len(out) > self.num_free:
                raise IntegrityError(
                    f"LRU free queue is broken after {len(out)} blocks (num_free={self.num_free}): "
                    f"{'a missing link' if node is None else f'block {node.block_id} has a wrong prev link'}"
                )
            out.append(node)
            prev, node = node, node.next
        if self._tail.prev is not prev:
            raise IntegrityError("LRU free queue tail sentinel does not point back at the last block")
        return out


PolicyFactory = Callable[[Sequence[Block]], EvictionPolicy]

POLICIES: dict[EvictionPolicyName, PolicyFactory] = {
    EvictionPolicyName.LRU: LRUPolicy,
}
