"""Publish a hybridkv engine's KV events exactly as vLLM 0.32 does (kv_events/wire.py), so every
consumer of vLLM's stream (this index, Dynamo, llm-d, Mooncake's conductor) reads `hybridkv serve` /
`run` too.

    engine step -> manager.take_events() -> wire_events() -> ZmqPublisher.publish(batch)
                                                              |  thread: PUB [topic, seq, payload]
                                                              |  ROUTER: replay from a sequence number

Block hashes go out as ints (the last 8 bytes of hybridkv's digest); a request's cache salt goes
out in `extra_keys` of its chain's first block (the index hashes it on arrival). The publisher
itself is kv_events/publisher.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hybridkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from hybridkv.kvcache.events import AllBlocksCleared as CacheCleared
from hybridkv.kvcache.events import BlockRemoved as CacheRemoved
from hybridkv.kvcache.events import BlockStored as CacheStored
from hybridkv.kvcache.events import KVEvent
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import SpecKind

__all__ = ["MEDIUM_GPU", "external_hash", "layout_events", "wire_events"]

MEDIUM_GPU = "GPU"
_KIND_NAMES = {SpecKind.FULL: "full_attention", SpecKind.SLIDING_WINDOW: "sliding_window",
               SpecKind.CHUNKED_LOCAL: "chunked_local_attention", SpecKind.MAMBA: "mamba",
               SpecKind.CROSS: "cross_attention"}


def external_hash(block_hash: bytes | int) -> int:
    """vLLM's default event hash: the digest's last 8 bytes as a big-endian int."""
    if isinstance(block_hash, int):
        return block_hash & ((1 << 64) - 1)
    return int.from_bytes(block_hash[-8:], "big")


def wire_events(events: Iterable[KVEvent], salts: Mapping[int, str] | None = None,
                medium: str = MEDIUM_GPU) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The manager's events as vLLM's; `salts` maps a chain's first external hash to its cache salt."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in events:
        if isinstance(e, CacheStored):
            hashes: list[int | bytes] = [external_hash(h) for h in e.block_hashes]
            salt = salts.get(external_hash(e.block_hashes[0])) if salts and e.parent_hash is None else None
            out.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if e.parent_hash is None else external_hash(e.parent_hash),
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=None, medium=medium,
                lora_name=None,
                extra_keys=[[salt]] + [None] * (len(hashes) - 1) if salt is not None else None,
                group_idx=int(e.group_id), kv_cache_spec_kind=_KIND_NAMES[e.kind],
                kv_cache_spec_sliding_window=e.window_tokens if e.kind is SpecKind.SLIDING_WINDOW else None))
        elif isinstance(e, CacheRemoved):
            removed: list[int | bytes] = [external_hash(h) for h in e.block_hashes]
            out.append(BlockRemoved(block_hashes=removed, medium=medium,
                                    group_idx=int(e.group_id)))
        elif isinstance(e, CacheCleared):
            out.append(AllBlocksCleared())
    return out


def layout_events(groups: Sequence[KVCacheGroupSpec], medium: str = MEDIUM_GPU) -> list[BlockStored]:
    """One empty `BlockStored` per KV cache group: its index, kind, window and block size.

    A consumer must know every group before it can promise a joint hit (a state group that has not
    stored a checkpoint yet still makes the hit 0); vLLM consumers skip empty events."""
    return [BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[], block_size=g.block_size, lora_id=None,
                        medium=medium, lora_name=None, group_idx=g.group_id, kv_cache_spec_kind=_KIND_NAMES[g.kind],
                        kv_cache_spec_sliding_window=g.window_tokens if g.kind is SpecKind.SLIDING_WINDOW else None)
            for g in groups]
