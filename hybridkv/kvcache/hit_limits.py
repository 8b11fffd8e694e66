"""Why a prefix hit stopped where it did, per KV cache group: the "hit limited by" counters.

After each lookup that did not reach the request's last token, every group is asked whether it
could serve the next aligned length `X = hit + lcm(block sizes)`; each group that cannot names
one reason (`HitLimit`), and the manager counts it (`ManagerStats.limited_by`):

    block_floor         X is past the prompt: the tokens left do not fill the alignment unit
                        (a unified hybrid block of 544..8320 tokens makes most short prefixes this)
    window              a sliding-window group holds the block ending at X but not the blocks
                        before it that the window needs (checked only when every full-attention
                        group could serve X: otherwise the hit stopped there anyway)
    missing_checkpoint  a state group (Mamba, GDN) has no checkpoint at X while another group of
                        that block size holds the block: the state there was never kept
    evicted             the needed block's content was cached and evicted (remembered for the
                        last `num_blocks` evicted hashes at least; older ones may count as never cached)
    same_step           the hit's state checkpoint was cached in this very step (the lookup is
                        repeated next step)
    never_cached        no group ever cached the content (new content, a partial block, or a
                        block the group's caching rule skipped)

Counts are per lookup: a request looked up again while it waits counts again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Protocol

from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.prefix_map import Fate


class HitLimit(Enum):
    """One reason a group could not extend a hit (module docstring)."""

    BLOCK_FLOOR = "block_floor"
    WINDOW = "window"
    MISSING_CHECKPOINT = "missing_checkpoint"
    EVICTED = "evicted"
    SAME_STEP = "same_step"
    NEVER_CACHED = "never_cached"


_LIMITS = tuple(HitLimit)
_SAME_STEP = _LIMITS.index(HitLimit.SAME_STEP)
_BLOCK_FLOOR = _LIMITS.index(HitLimit.BLOCK_FLOOR)


def limit_of_fate(fate: Fate, *, state_group: bool, caches_every_block: bool) -> HitLimit:
    """The reason for a block some group lacks, from what became of its hash (another group of
    its block size still holding it means this group lost it, unless this group's caching rule
    skips blocks: then it was never cached here)."""
    if fate is Fate.EVICTED:
        return HitLimit.EVICTED
    if fate is Fate.ELSEWHERE:
        if state_group:
            return HitLimit.MISSING_CHECKPOINT
        return HitLimit.EVICTED if caches_every_block else HitLimit.NEVER_CACHED
    return HitLimit.NEVER_CACHED


class _Rule(Protocol):
    """What the counter reads of one per-type manager (`type_managers.base.SingleTypeManager`)."""

    is_state: bool
    downward_closed: bool
    block_size: int

    def limit_at(self, block_hashes: Sequence[BlockHash], num_tokens: int, hit_tokens: int, *,
                 window_too: bool = True) -> HitLimit | None: ...


class HitLimitCounter:
    """The counts per manager (its groups are looked up together, so they always share them)."""

    def __init__(self, managers: Sequence[_Rule], manager_of_group: Sequence[_Rule], step_tokens: int) -> None:
        self._managers = managers
        self._step = step_tokens  # the lcm of the block sizes: hits grow by it
        # per manager, a count per reason in `_LIMITS` order (list indices: an Enum hashes in Python)
        self._counts: list[list[int]] = [[0] * len(_LIMITS) for _ in managers]
        self._of_group = [next(i for i, m in enumerate(managers) if m is g) for g in manager_of_group]
        # downward-closed (full attention) first: once one stopped the hit, windows are not checked
        order = sorted(range(len(managers)), key=lambda i: not managers[i].downward_closed)
        self._order = [(self._counts[i], managers[i]) for i in order]  # (its counts, the manager)

    def count(self, hashes: Mapping[int, Sequence[BlockHash]], num_tokens: int, max_length: int, *,
              deferred: bool) -> None:
        """Count why the hit of `num_tokens` did not reach `max_length` (module docstring)."""
        counts, managers = self._counts, self._managers
        if deferred:
            for i, manager in enumerate(managers):
                if manager.is_state:
                    counts[i][_SAME_STEP] += 1
        if num_tokens >= max_length:
            return
        following = num_tokens + self._step
        if following > max_length:
            for count in counts:
                count[_BLOCK_FLOOR] += 1
            return
        closed_failed = False
        for count, manager in self._order:
            limit = manager.limit_at(hashes[manager.block_size], following, num_tokens, window_too=not closed_failed)
            if limit is not None:
                count[_LIMITS.index(limit)] += 1
                closed_failed = closed_failed or manager.downward_closed

    def per_group(self) -> tuple[dict[HitLimit, int], ...]:
        return tuple(dict(zip(_LIMITS, self._counts[i], strict=True)) for i in self._of_group)
