"""A naive reference for prefix hits: plain sets of token prefixes, no blocks, no eviction.

It *defines* the hit the real manager must find:

    cached[g]  = every block-aligned prefix (salt, tokens[:end]) whose block group g computed
                 (attention: every full block a step completed; Mamba: the block a step ended on)
    serve(g,L) = full:     prefixes of every block end <= L are cached
                 sliding:  the ceil((W-1)/B) blocks before L (or all of them, from 0) are cached
                 chunked:  the blocks from the start of L's chunk to L are cached
                 mamba:    L == 0 or the prefix of length L is cached
    hit        = the largest L <= num_tokens - 1, a multiple of every block size, that every
                 group can serve   (brute force, L descending)

Since nothing is ever evicted here, the real manager's hit is never longer; with a pool large
enough to never evict, the two are equal.

`ContentTracker` records which tokens every block id holds (from the block ids the real manager
hands out) and checks that a hit never uses a block whose content differs from the request's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.core.planner import KVCacheGroupSpec
from hybridkv.core.specs import SpecKind

Prefix = tuple[str | None, tuple[int, ...]]


def first_required_block(group: KVCacheGroupSpec, length: int) -> int | None:
    """First block a group needs cached to serve a hit of `length` tokens (None: cannot hit).
    Every block from there up to `length` is needed."""
    size = group.block_size
    if length == 0:
        return 0
    if group.kind is SpecKind.FULL:
        return 0
    if group.kind is SpecKind.SLIDING_WINDOW:
        return max(0, length // size - math.ceil((group.window_tokens - 1) / size))
    if group.kind is SpecKind.CHUNKED_LOCAL:
        return length // group.chunk_tokens * group.chunk_tokens // size
    if group.kind is SpecKind.MAMBA:
        return length // size - 1
    return None


class NaiveManager:
    """Sets of cached prefixes per group; see the module docstring."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec]) -> None:
        self.groups = list(groups)
        self.cached: list[set[Prefix]] = [set() for _ in self.groups]
        self.step = math.lcm(*(g.block_size for g in self.groups))

    def record_step(self, tokens: Sequence[int], salt: str | None, start: int, end: int) -> None:
        """A request computed tokens [start, end) (start = its computed tokens incl. hits)."""
        for g, group in enumerate(self.groups):
            size = group.block_size
            if group.kind is SpecKind.CROSS or end <= start:
                continue
            if group.kind is SpecKind.MAMBA:
                if end % size == 0 and end // size > start // size:
                    self.cached[g].add((salt, tuple(tokens[:end])))
                continue
            for index in range(start // size, end // size):
                self.cached[g].add((salt, tuple(tokens[: (index + 1) * size])))

    def reset(self) -> None:
        for cached in self.cached:
            cached.clear()

    def can_serve(self, g: int, tokens: Sequence[int], salt: str | None, length: int) -> bool:
        first = first_required_block(self.groups[g], length)
        if first is None:
            return False
        size = self.groups[g].block_size
        cached = self.cached[g]
        return all((salt, tuple(tokens[: (i + 1) * size])) in cached for i in range(first, length // size))

    def longest_hit(self, tokens: Sequence[int], salt: str | None) -> int:
        top = (len(tokens) - 1) // self.step * self.step
        for length in range(top, -1, -self.step):
            if all(self.can_serve(g, tokens, salt, length) for g in range(len(self.groups))):
                return length
        return 0


class ContentTracker:
    """Which tokens each block id holds, from the ids the real manager hands out.

    Attention blocks: entry i of group g holds the KV of tokens [i*B, (i+1)*B) of the request
    that received it. Mamba blocks: the last entry of a table holds the state after the step's
    last token. A hit is correct only if every non-null block holds exactly the request's
    prefix at that position.
    """

    def __init__(self, groups: Sequence[KVCacheGroupSpec]) -> None:
        self.groups = list(groups)
        self.attention: dict[int, tuple[int, int, list[int], str | None]] = {}
        self.state: dict[int, tuple[int, Prefix]] = {}

    def record_new(self, tokens: list[int], salt: str | None, old_lengths: Sequence[int],
                   new: Sequence[Sequence[int]]) -> None:
        for g, (old_len, entries) in enumerate(zip(old_lengths, new, strict=True)):
            if self.groups[g].kind is SpecKind.MAMBA:
                continue
            for offset, block_id in enumerate(entries):
                if block_id:
                    self.attention[block_id] = (g, old_len + offset, tokens, salt)

    def record_state(self, tokens: Sequence[int], salt: str | None, tables: Sequence[Sequence[int]],
                     end: int) -> None:
        for g, table in enumerate(tables):
            if self.groups[g].kind is SpecKind.MAMBA and table and table[-1]:
                self.state[table[-1]] = (g, (salt, tuple(tokens[:end])))

    def check_hit(self, tokens: Sequence[int], salt: str | None, length: int,
                  blocks: Sequence[Sequence[int]]) -> None:
        """The hit is sound: each group has one entry per block of `length`, every entry its
        rule needs is a real block, and every real block holds the request's own prefix."""
        for g, entries in enumerate(blocks):
            group = self.groups[g]
            size = group.block_size
            first = first_required_block(group, length)
            assert first is not None, f"group {g} ({group.kind.value}) cannot serve a hit of {length}"
            assert len(entries) == length // size, f"group {g}: {len(entries)} entries for a hit of {length}"
            missing = [i for i in range(first, length // size) if not entries[i]]
            assert not missing, f"group {g}: hit of {length} tokens lacks needed blocks at {missing}"
            for i, block_id in enumerate(entries):
                if block_id:
                    self._check_block(g, i, block_id, tokens, salt)

    def _check_block(self, g: int, i: int, block_id: int, tokens: Sequence[int], salt: str | None) -> None:
        end = (i + 1) * self.groups[g].block_size
        if self.groups[g].kind is SpecKind.MAMBA:
            assert self.state.get(block_id) == (g, (salt, tuple(tokens[:end]))), (
                f"group {g} position {i}: block {block_id} holds a state of other tokens")
            return
        owner_group, position, owner, owner_salt = self.attention[block_id]
        assert (owner_group, position, owner_salt) == (g, i, salt), (
            f"block {block_id} holds group {owner_group} position {position}, hit as group {g} position {i}")
        assert len(owner) >= end and owner[:end] == list(tokens[:end]), (
            f"group {g} position {i}: block {block_id} holds other tokens")
