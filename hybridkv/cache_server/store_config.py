"""How one store is set up (the server's `ServerConfig` makes one; tests make their own)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.l2_sizing import L2Sizing


class ObjectGroupMode(Enum):
    SEPARATE = "separate"  # full / each window / each chunked size / each state group
    ONE = "one"  # every group in one object per chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    chunk_tokens: int = 256
    l1_bytes: int = 1 << 30
    eviction_policy: L1EvictionPolicyName = L1EvictionPolicyName.LRU
    l2_sizing: L2Sizing = L2Sizing.RESUMABLE
    object_groups: ObjectGroupMode = ObjectGroupMode.SEPARATE
    lock_ttl_s: float = 30.0
    max_registrations: int = 256

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0 or self.l1_bytes <= 0 or self.lock_ttl_s <= 0 or self.max_registrations <= 0:
            raise ValueError(f"chunk_tokens, l1_bytes, lock_ttl_s and max_registrations must be positive, got "
                             f"{self.chunk_tokens}, {self.l1_bytes}, {self.lock_ttl_s}, {self.max_registrations}")
