"""KV events: what the block pool reports about cached blocks (for a connector or an external
index), when a `KVCacheManager` is built with `events=KVEvents.ON`. Re-exported by `block_pool`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from hybridkv.kvcache.ids import NULL, BlockHash, GroupId
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import SpecKind

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventLog", "KVEvent", "KVEvents"]


class KVEvents(Enum):
    """Whether the pool records KV events (for a connector or an external index)."""

    OFF = "off"
    ON = "on"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Contiguous full blocks of one group were cached; `parent_hash` precedes the first."""

    group_id: GroupId
    kind: SpecKind
    window_tokens: int
    block_size: int
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Cached blocks of one group were evicted (their content is gone)."""

    group_id: GroupId
    kind: SpecKind
    window_tokens: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventLog:
    """The block pool's KV events in the order they happened (the pool records only when events are ON)."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec]) -> None:
        self._groups = tuple(groups)
        self._events: list[KVEvent] = []

    def removed(self, group_id: int, block_hash: BlockHash) -> None:
        spec = self._groups[group_id]
        self._events.append(BlockRemoved(group_id=GroupId(group_id), kind=spec.kind,
                                         window_tokens=spec.window_tokens, block_hashes=(block_hash,)))

    def stored(self, group_id: int, blocks: Sequence[int], hashes: Sequence[BlockHash],
               start: int, end: int, token_ids: Sequence[int]) -> None:
        """`blocks` = a table's entries [start, end): one event per run of real (non-null) blocks."""
        spec = self._groups[group_id]
        size = spec.block_size
        run_start = start
        for i in range(start, end + 1):
            if i < end and blocks[i - start] != NULL:
                continue
            if i > run_start:
                self._events.append(BlockStored(
                    group_id=GroupId(group_id), kind=spec.kind, window_tokens=spec.window_tokens,
                    block_size=size, block_hashes=tuple(hashes[run_start:i]),
                    parent_hash=hashes[run_start - 1] if run_start else None,
                    token_ids=tuple(token_ids[run_start * size : i * size]),
                ))
            run_start = i + 1

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call (forgotten here)."""
        events, self._events = self._events, []
        return events
