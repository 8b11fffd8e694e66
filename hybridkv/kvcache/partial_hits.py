"""Partial (sub-block) prefix hits: `prefix_match_unit` below a state group's block in align mode.

What the rest of the package needs of them, in one place (docs/prefix_caching.md has the rules):

- `PartialEntries`, the block pool's record of which blocks hold a partial entry (a key for a
  prefix ending inside the block) and which of those hold it as an *extra* key, beside the hash
  the block already carries (an attention block filled by decoding after its prompt registered
  its last unit boundary there);
- `check_partial_hits`, the options this manager does not combine with partial hits.

`KVCacheCoordinator.enable_partial_hits` turns them on in a coordinator and its managers.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.errors import ConfigError, IntegrityError
from hybridkv.kvcache.free_queue import Ids
from hybridkv.kvcache.ids import BlockHash
from hybridkv.plan.kv_cache_config import KVCacheConfig
from hybridkv.plan.match_unit import MatchUnit

__all__ = ["PartialEntries", "check_partial_hits"]


class PartialEntries:
    """Block -> the partial key it holds (at most one), and per group the extra holders of a key."""

    def __init__(self, num_groups: int) -> None:
        self.key_of: dict[int, BlockHash] = {}
        self._extra: list[dict[BlockHash, list[int]]] = [{} for _ in range(num_groups)]

    def __bool__(self) -> bool:
        return bool(self.key_of)

    def add(self, group_id: int, block: int, key: BlockHash, *, extra: bool) -> None:
        """Record that `block` holds `key` (`extra`: beside the hash it carries)."""
        self.key_of[block] = key
        if extra:
            self._extra[group_id].setdefault(key, []).append(block)

    def extra_holder(self, group_id: int, key: BlockHash) -> int | None:
        """The first block of the group holding `key` as an extra key, None if none."""
        holders = self._extra[group_id].get(key)
        return holders[0] if holders else None

    def forget(self, blocks: Sequence[int], group_of: Ids) -> None:
        """Drop the records of `blocks` (evicted, uncached or re-keyed); `group_of[b]` is b's group."""
        for block in blocks:
            key = self.key_of.pop(block, None)
            if key is None:
                continue
            extra = self._extra[group_of.item(block)]
            holders = extra.get(key)
            if holders and block in holders:
                holders.remove(block)
                if not holders:
                    del extra[key]

    def clear(self) -> None:
        self.key_of.clear()
        for extra in self._extra:
            extra.clear()

    def check(self, has_hash: Sequence[bool], group_of: Sequence[int]) -> None:
        """IntegrityError unless every extra holder is recorded, carries a hash and is of its group."""
        for group_id, extra in enumerate(self._extra):
            for key, blocks in extra.items():
                for block in blocks:
                    if self.key_of.get(block) != key or not has_hash[block] or group_of[block] != group_id:
                        raise IntegrityError(f"extra partial entry of block {block} (group {group_id}) is not "
                                             f"recorded, or the block carries no hash or belongs to group "
                                             f"{group_of[block]}")


def check_partial_hits(unit: MatchUnit, config: KVCacheConfig) -> None:
    """ConfigError for partial hits combined with an option this manager does not pair them with
    (EAGLE with state groups is refused by `retention.check_spec_decode`). With
    `prefix_cache_retention_interval` they compose as in vLLM 0.32 (bench_hits.py's runs at retention
    0 and unit 16 hit what vLLM does, request by request)."""
    if not unit.partial_hits:
        return
    other = "the multi_page state layout" if config.pages_per_state > 1 else None
    if other is not None:
        raise ConfigError(
            f"prefix_match_unit={unit.hash_unit_tokens} makes hits land inside the {unit.scheduler_block_tokens}-token "
            f"blocks of this layout (partial hits), which this manager does not combine with {other}; expected a "
            f"unit of at least {unit.scheduler_block_tokens} tokens (or None), or that option off")
