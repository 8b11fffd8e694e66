"""The checks `KVCacheManager.allocate` runs on a step's start: a `CacheHit` passed back must be this
manager's, for this new request, of the right shape, and (if anything was evicted since `lookup`)
still cached; a step without a hit must agree with the blocks the request holds. Each failure is an
`AllocationError` (or `StaleHitError`) that says what was passed and what was expected."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from hybridkv.errors import AllocationError, StaleHitError
from hybridkv.kvcache.block_pool import NULL, BlockPool
from hybridkv.kvcache.coordinator import GroupBlocks
from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.results import CacheHit


def check_no_hit_start(request: KVRequest, *, running: bool, allocated: int) -> None:
    """A step without a hit: computed tokens only for a running request, within the slots it holds."""
    computed = request.num_computed_tokens
    if computed and not running:
        raise AllocationError(
            f"request {request.request_id!r} has num_computed_tokens={computed} but holds no blocks; "
            "expected 0 for a new or preempted request (pass loaded KV as num_external_tokens)"
        )
    if computed > allocated:
        raise AllocationError(
            f"request {request.request_id!r} has num_computed_tokens={computed} but holds slots for only "
            f"{allocated} tokens; expected at most that many "
            "(advance num_computed_tokens to the end of the step that ran, not further)"
        )


def resolve_hit(request: KVRequest, hit: CacheHit, *, running: bool, block_sizes: Sequence[int],
                num_blocks: int) -> GroupBlocks:
    """The hit's block lists, once it is this new request's and shaped as `lookup` made it."""
    if hit.request_id != request.request_id:
        raise AllocationError(f"cache hit of request {hit.request_id!r} passed for {request.request_id!r}")
    if running or request.num_computed_tokens:
        raise AllocationError(
            f"request {request.request_id!r} already holds blocks or computed tokens "
            f"({request.num_computed_tokens}); a cache hit applies only to a new request"
        )
    if len(hit.blocks) != len(block_sizes) or any(
        len(ids) != -(-hit.num_tokens // size) for ids, size in zip(hit.blocks, block_sizes, strict=False)
    ):
        raise AllocationError(
            f"cache hit of request {request.request_id!r} for {hit.num_tokens} tokens has "
            f"{[len(ids) for ids in hit.blocks]} blocks per group; expected "
            f"{[-(-hit.num_tokens // size) for size in block_sizes]} (pass the CacheHit of this manager unchanged)"
        )
    groups: GroupBlocks = [list(ids) for ids in hit.blocks]
    flat = np.fromiter(chain.from_iterable(hit.blocks), np.int64)  # (hundreds of page groups: one pass)
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= num_blocks):
        raise AllocationError(
            f"cache hit of request {request.request_id!r} names a block id outside this manager's "
            f"{num_blocks} blocks (pass the CacheHit of this manager unchanged)"
        )
    return groups


def verify_hit(request: KVRequest, groups: GroupBlocks, num_tokens: int, *, hashes: dict[int, list[BlockHash]],
               pool: BlockPool, block_sizes: Sequence[int], unit: int) -> None:
    """`StaleHitError` unless every block of the hit still holds its hash (the block a partial hit
    ends in: its partial entry) in its group."""
    group_of = pool.group_of.tolist()
    for g, blocks in enumerate(groups):
        size = block_sizes[g]
        expected = hashes[size]
        for i, block in enumerate(blocks):
            if block == NULL:
                continue
            if (i + 1) * size > num_tokens:  # the block a partial hit ends in: its partial entry
                held = pool.partial.holds(block, hashes[unit][num_tokens // unit - 1])
            else:
                held = pool.hash_of(block) == expected[i]
            if not held or group_of[block] != g:
                raise StaleHitError(
                    f"cache hit of request {request.request_id!r}: block {block} (group {g}, "
                    f"position {i}) was evicted after lookup; call lookup again right before allocate"
                )
