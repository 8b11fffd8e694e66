"""`hybridkv server --kv-events-config JSON`: the server's L1 tier as vLLM KV events (medium "CPU"),
so that an index (`hybridkv index`, the server registered as type "hybridkv-server") answers which
prompt prefixes the server can hand to an engine.

    L1 pool: placed / dropped (pool.PoolListener)  ->  BlockStored / BlockRemoved of one chunk id
    a thread: every `interval_s`, what came in as one batch  ->  kv_events.publisher (PUB + replay)

An event is one object: `block_hashes` = [its chunk id] (kv_events/chunk_ids.py: the connector's
chained chunk hash, folded with the cache salt when there is one), `block_size` = the server's chunk
tokens, `group_idx` = the object group, `kv_cache_spec_kind` (and window) = the object group's hit
rule; no token ids, no parent, no salt. Objects outside any prefix tree and object groups that gate
no hit (cross attention) are not published. The disk and Valkey tiers do not publish: their own
bounds delete objects the server is not told of.
"""

from __future__ import annotations

import threading

from hybridkv.cache_server.prefix_index import ObjectPlace
from hybridkv.cache_server.registered_layout import TreeRules
from hybridkv.kv_events.chunk_ids import chunk_id
from hybridkv.kv_events.publisher import ZmqPublisher
from hybridkv.kv_events.wire import BlockRemoved, BlockStored, KVEventsConfig

__all__ = ["MEDIUM_CPU", "SERVER_TYPE", "TierEvents"]

MEDIUM_CPU = "CPU"
SERVER_TYPE = "hybridkv-server"  # (the `type` to register the server's stream under at an index)


class TierEvents:
    """A pool listener that publishes what enters and leaves L1 (thread-safe: the store calls it under
    its lock, the publishing thread drains it)."""

    def __init__(self, config: KVEventsConfig, chunk_tokens: int, *, interval_s: float = 0.01) -> None:
        self.publisher = ZmqPublisher(config)
        self._chunk_tokens = chunk_tokens
        self._interval_s = interval_s
        self._published: dict[bytes, tuple[bytes, int]] = {}  # L1 key -> (chunk id, object group)
        self._pending: list[BlockStored | BlockRemoved] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-server-events", daemon=True)
        self._thread.start()

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        if place is None or not isinstance(place.rules, TreeRules):
            return
        kind = place.rules.event_kind(place.object_group)
        if kind is None:
            return
        cid = chunk_id(place.chunk_hash, place.rules.salt)
        event = BlockStored(block_hashes=[cid], parent_block_hash=None, token_ids=[], block_size=self._chunk_tokens,
                            lora_id=None, medium=MEDIUM_CPU, lora_name=None, group_idx=place.object_group,
                            kv_cache_spec_kind=kind[0], kv_cache_spec_sliding_window=kind[1])
        with self._lock:
            self._published[key] = (cid, place.object_group)
            self._pending.append(event)

    def used(self, key: bytes) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        with self._lock:
            entry = self._published.pop(key, None)
            if entry is not None:
                self._pending.append(BlockRemoved(block_hashes=[entry[0]], medium=MEDIUM_CPU, group_idx=entry[1]))

    def flush(self) -> None:
        """Publish what came in since the last batch (nothing when nothing did)."""
        with self._lock:
            events, self._pending = self._pending, []
        self.publisher.publish(list(events))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.flush()
        self.publisher.shutdown()
