"""KV events: what the block pool reports about cached blocks (for a connector or an external
index), when a `KVCacheManager` is built with `events=KVEvents.ON`. Re-exported by `block_pool`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridkv.kvcache.ids import BlockHash, GroupId
from hybridkv.plan.specs import SpecKind

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEvents"]


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
