"""A query's hit per instance from as few table probes as the rules allow.

`rules.py` states the joint hit over whole arrays (block i of the prompt held or not, per group):
the reference, and what a test compares this module with. Filling those arrays costs one probe
of a 1M-entry dict per prompt block (~0.1 us each, mostly a cache miss: ~200 us for a 32k-token
prompt) before any rule runs. A query asks far less:

    full attention   the end of the held prefix: a binary search (log2(2048) = 11 probes)
    state            one block per candidate hit point, from the top down
    sliding window   the `need` blocks before a candidate point; a miss at block i rules out
                     every point up to i + need at once (the walk jumps below i)

    block:    0 1 2 3 4 5 6 7 8 9 ...    15 16 ...     2047
    full      x x x x x x x x x x  x x x x  x  .  . . .  .      binary search: ~11 probes -> 16 blocks held
    state     . . . x . . . x . . .  x . . .  x  .  . . .  .      a hit of 16 blocks needs block 15: one probe

The binary search relies on a chain's full-attention blocks being held as a prefix: an engine
evicts a chain tail first (vLLM's free queue gets a request's blocks in reverse order, and a block
is touched whenever any later block of its chain is; hybridkv's LRU and value policies keep that
order within a class, and their classes of full-attention blocks are marked on whole prefixes), so a
held block's predecessors are held. Probes are memoized per query: instances (and groups of one
block size) share them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from enum import Enum

from hybridkv.index.rules import GroupRule, RuleKind

__all__ = ["HeldOrder", "PromptBlocks", "instance_hit"]


class HeldOrder(Enum):
    """What an instance's full-attention blocks of a chain look like."""

    PREFIX = "prefix"  # a held block's predecessors are held (engines: the module docstring): binary search
    ANY = "any"  # holes anywhere (a KV cache server's tiers: an LRU tier drops a chain's head first): a walk


class PromptBlocks:
    """The prompt's blocks at one block size: each block's slot mask, probed once, on demand."""

    __slots__ = ("_get", "_hashes", "_masks")

    def __init__(self, hashes: Sequence[int], get: Callable[[int, int], int]) -> None:
        self._hashes = hashes
        self._get = get
        self._masks = [-1] * len(hashes)

    def __len__(self) -> int:
        return len(self._hashes)

    def mask(self, i: int) -> int:
        """The slot bits that hold block i (0: none)."""
        m = self._masks[i]
        if m < 0:
            m = self._masks[i] = self._get(self._hashes[i], 0)
        return m

    def prefix_end(self, bit: int) -> int:
        """The number of leading blocks `bit` holds, by binary search (a held prefix: module docstring)."""
        hi = len(self._hashes)
        if not bit or not hi:
            return 0
        if self.mask(hi - 1) & bit:
            return hi
        lo, hi = 0, hi - 1  # (the first miss is in [lo, hi])
        while lo < hi:
            mid = (lo + hi) // 2
            if self.mask(mid) & bit:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def run_end(self, bit: int) -> int:
        """The number of leading blocks `bit` holds, block by block (for groups that may hold holes)."""
        n = 0
        while n < len(self._hashes) and self.mask(n) & bit:
            n += 1
        return n


Group = tuple[GroupRule, int]  # a group's rule and its slot bit in the table (0: it holds nothing)


def _next_point(group: Group, blocks: PromptBlocks, p: int, step: int) -> int:
    """p when the group serves a hit of p tokens; else the largest point below p it might serve."""
    rule, bit = group
    k = p // rule.block_size
    if rule.kind is RuleKind.STATE:
        return p if blocks.mask(k - 1) & bit else p - step
    for i in range(k - 1, max(0, k - rule.need_blocks) - 1, -1):  # (SLIDING)
        if not blocks.mask(i) & bit:
            return i * rule.block_size // step * step  # (every window over block i misses)
    return p


def instance_hit(groups: Sequence[Group], blocks: dict[int, PromptBlocks], max_tokens: int,
                 order: HeldOrder = HeldOrder.PREFIX) -> tuple[int, int]:
    """(the joint hit, the attention-only hit) in tokens of one instance (rules.py's two answers).

    `blocks` holds the prompt's blocks per block size; a group of a size it lacks makes both 0 (no
    hit can be promised)."""
    if not groups or any(rule.block_size not in blocks for rule, _ in groups):
        return 0, 0
    step = math.lcm(*(rule.block_size for rule, _ in groups))
    limit = max(0, max_tokens) // step * step
    full = [rule.block_size * (blocks[rule.block_size].prefix_end(bit) if order is HeldOrder.PREFIX
                               else blocks[rule.block_size].run_end(bit)) for rule, bit in groups
            if rule.kind is RuleKind.FULL]
    if full:
        attention = min(full)
    else:
        attention = min((rule.block_size * blocks[rule.block_size].run_end(bit) for rule, bit in groups
                         if rule.kind is RuleKind.SLIDING), default=0)
    if any(rule.kind is RuleKind.NEVER for rule, _ in groups):
        return 0, attention
    p = min([limit, *full]) // step * step
    others = [g for g in groups if g[0].kind is not RuleKind.FULL]
    while p > 0:
        lower = min((_next_point(g, blocks[g[0].block_size], p, step) for g in others), default=p)
        if lower == p:
            return p, attention
        p = lower
    return 0, attention
