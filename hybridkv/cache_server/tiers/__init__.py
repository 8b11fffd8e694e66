"""L2 tiers of the KV cache server: local disk and Valkey/Redis, behind one `L2Tier` protocol,
fed by a `WriteBehind` thread."""

from hybridkv.cache_server.tiers.base import L2Tier, TierError, TierStats
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.cache_server.tiers.valkey import ValkeyTier
from hybridkv.cache_server.tiers.write_behind import WriteBehind, WriteBehindStats

__all__ = ["DiskTier", "L2Tier", "TierError", "TierStats", "ValkeyTier", "WriteBehind", "WriteBehindStats"]
