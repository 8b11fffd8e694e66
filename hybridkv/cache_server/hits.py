"""The hit rules of docs/design.md §6 as pure functions of a registered engine: which chunks each
object group needs for a hit, the longest hit every object group serves, and the block copies a
retrieve makes (only the blocks each group needs, none the engine holds already).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from hybridkv.cache_server.engines import Engine
from hybridkv.cache_server.limits import SLICE_CHUNKS
from hybridkv.cache_server.registered_layout import ObjectGroup, RequestError
from hybridkv.cache_server.shm import Bytes
from hybridkv.wire import ErrorCode, RetrieveRequest


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One block of an engine group from an L1 object: each of the group's layers' pages, in order."""

    object_group: int
    value: Bytes  # the object (a view of L1, locked for the copy)
    offset: int  # of the block's first page in the object
    group: int  # engine group
    block: int  # engine block id


def first_needed(engine: Engine, og: ObjectGroup, hit_chunks: int) -> int:
    """The first chunk `og` needs for a hit of `hit_chunks` chunks (= hit_chunks if none)."""
    return min(engine.rules.first_needed_chunk(gid, hit_chunks) for gid in og.groups)


def longest_hit_steps(engine: Engine, present: list[list[bool]],
                      max_chunks: int) -> Generator[None, None, tuple[int, list[int]]]:
    """(longest prefix in chunks every object group serves, each object group's own longest), a step
    per SLICE_CHUNKS candidate lengths; `present[o][j]`: object group o has chunk j."""
    prefix = [list(itertools.accumulate(p, initial=0)) for p in present]

    def serves(o: int, c: int) -> bool:  # always for c = 0
        lo = first_needed(engine, engine.groups[o], c)
        return prefix[o][c] - prefix[o][lo] == c - lo

    per_group: list[int] = []
    for o in range(len(present)):
        c = max_chunks
        while not serves(o, c):
            c -= 1
            if c % SLICE_CHUNKS == 0:
                yield
        per_group.append(c)
    hit = min(per_group, default=max_chunks)
    while not all(serves(o, hit) for o in range(len(present))):
        hit -= 1
        if hit % SLICE_CHUNKS == 0:
            yield
    return hit, per_group


def retrieved_tokens(req: RetrieveRequest, hit_chunks: int, chunk_tokens: int) -> int:
    """The tokens a retrieve of a hit of `hit_chunks` chunks copies (BAD_REQUEST for a span outside it)."""
    tokens = hit_chunks * chunk_tokens if req.num_tokens == -1 else req.num_tokens
    if tokens % chunk_tokens or not 0 <= tokens <= hit_chunks * chunk_tokens:
        raise RequestError(ErrorCode.BAD_REQUEST, f"retrieve num_tokens {req.num_tokens} must be a multiple of "
                           f"{chunk_tokens} and at most the hit ({hit_chunks * chunk_tokens})")
    if not 0 <= req.skip_tokens <= tokens:
        raise RequestError(ErrorCode.BAD_REQUEST, f"retrieve skip_tokens {req.skip_tokens} must be in "
                           f"[0, {tokens}] (the tokens retrieved)")
    return tokens


def plan_retrieve(engine: Engine, hit: int, req: RetrieveRequest,
                  value_of: Callable[[ObjectGroup, int], Bytes | None]) -> Iterator[list[BlockCopy]]:
    """The block copies of a retrieve of `hit` chunks, a list per object group and chunk (`value_of(og,
    j)`: the L1 object of chunk j); RequestError when an object is gone or a needed block is null."""
    rules, chunk_tokens = engine.rules, engine.rules.chunk_tokens
    for og in engine.groups:
        for j in range(first_needed(engine, og, hit), hit):
            if not rules.object_bytes(og, j) or not _wanted(engine, og, j, hit, req.skip_tokens):
                continue
            value = value_of(og, j)
            if value is None:
                raise RequestError(ErrorCode.BAD_REQUEST, f"chunk {j} of object group {og.name} is no longer "
                                   "cached; retrieve the whole hit or look up again")
            copies: list[BlockCopy] = []
            for gid in og.groups:
                g, bpc = engine.layout.groups[gid], rules.blocks_per_chunk[gid]
                for b in rules.needed(gid, j, hit):
                    if j * chunk_tokens + (b + 1) * g.block_tokens <= req.skip_tokens:
                        continue  # the engine holds this block already (its own prefix hit)
                    dst = req.block_ids[gid][j * bpc + b]
                    if dst == 0:
                        raise RequestError(ErrorCode.BAD_REQUEST, f"retrieve: group {gid} needs block {b} of "
                                           f"chunk {j} but its block id is the null block 0")
                    copies.append(BlockCopy(og.index, value, rules.block_offset(og, j, gid, b), gid, dst))
            yield copies


def _wanted(engine: Engine, og: ObjectGroup, chunk: int, hit: int, skip_tokens: int) -> bool:
    """Whether chunk `chunk` of `og` has a needed block that ends after `skip_tokens`."""
    start = chunk * engine.rules.chunk_tokens
    for gid in og.groups:
        size = engine.layout.groups[gid].block_tokens
        needed = engine.rules.needed(gid, chunk, hit)
        if needed and start + needed.stop * size > skip_tokens:
            return True
    return False
