"""`hybridkv server --kv-events-config JSON`: the server's tiers as vLLM KV events, so that an index
(`hybridkv index`, the server registered as type "hybridkv-server") answers which prompt prefixes
the server can hand to an engine, per tier.

    L1 pool: placed / dropped (pool.PoolListener)              ->  medium "CPU"
    a sized L2 tier: written / deleted / cleared (l2.L2Listener) ->  medium "DISK"
    a thread: every `interval_s`, what came in as one batch    ->  kv_events.publisher (PUB + replay)

An event is one object: `block_hashes` = [its chunk id] (kv_events/chunk_ids.py: the connector's
chained chunk hash, folded with the cache salt when there is one), `block_size` = the server's chunk
tokens, `group_idx` = the object group, `kv_cache_spec_kind` (and window) = the object group's hit
rule; no token ids, no parent, no salt. Objects outside any prefix tree and object groups that gate
no hit (cross attention) are not published.

The disk tier is published when the server sizes it (`--l2-sizing resumable`, the default): the
server then decides every deletion there itself. Not published: the disk tier under `--l2-sizing
objects` and the Valkey tier (they delete objects on their own, unseen), objects a disk tier holds
from an earlier run (a lookup finds them; the index does not), and a write that fails on the disk
(known, and published as removed, when a lookup next reads it). So `DISK` can fall short of the
server's lookup, and for a failed write be over it until then.
"""

from __future__ import annotations

import threading

from hybridkv.cache_server.prefix_index import ObjectPlace
from hybridkv.cache_server.registered_layout import TreeRules
from hybridkv.kv_events.chunk_ids import MEDIUM_CPU, MEDIUM_DISK, SERVER_TYPE, chunk_id
from hybridkv.kv_events.publisher import ZmqPublisher
from hybridkv.kv_events.wire import BlockRemoved, BlockStored, KVEventsConfig

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "SERVER_TYPE", "TierEvents"]


class TierEvents:
    """A pool listener that publishes what enters and leaves L1 (thread-safe: the store calls it under
    its lock, the publishing thread drains it)."""

    def __init__(self, config: KVEventsConfig, chunk_tokens: int, *, interval_s: float = 0.01) -> None:
        self.publisher = ZmqPublisher(config)
        self._chunk_tokens = chunk_tokens
        self._interval_s = interval_s
        self._published: dict[tuple[str, bytes], tuple[bytes, int]] = {}  # (medium, key) -> (chunk id, object group)
        self._pending: list[BlockStored | BlockRemoved] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-server-events", daemon=True)
        self._thread.start()

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        self._stored(MEDIUM_CPU, key, place)

    def used(self, key: bytes) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        self._removed(MEDIUM_CPU, key)

    # -- the sized L2 tiers (l2.L2Listener) ---------------------------------------------------------

    def l2_stored(self, tier: str, key: bytes, place: ObjectPlace | None) -> None:
        self._stored(MEDIUM_DISK, key, place)

    def l2_removed(self, tier: str, key: bytes) -> None:
        self._removed(MEDIUM_DISK, key)

    def l2_cleared(self, tier: str) -> None:
        medium = MEDIUM_DISK
        with self._lock:
            keys = [k for k in self._published if k[0] == medium]
        for k in keys:
            self._removed(medium, k[1])

    def _stored(self, medium: str, key: bytes, place: ObjectPlace | None) -> None:
        if place is None or not isinstance(place.rules, TreeRules):
            return
        kind = place.rules.event_kind(place.object_group)
        if kind is None:
            return
        cid = chunk_id(place.chunk_hash, place.rules.salt)
        event = BlockStored(block_hashes=[cid], parent_block_hash=None, token_ids=[], block_size=self._chunk_tokens,
                            lora_id=None, medium=medium, lora_name=None, group_idx=place.object_group,
                            kv_cache_spec_kind=kind[0], kv_cache_spec_sliding_window=kind[1])
        with self._lock:
            if (medium, key) in self._published:  # (written again: already published)
                return
            self._published[(medium, key)] = (cid, place.object_group)
            self._pending.append(event)

    def _removed(self, medium: str, key: bytes) -> None:
        with self._lock:
            entry = self._published.pop((medium, key), None)
            if entry is not None:
                self._pending.append(BlockRemoved(block_hashes=[entry[0]], medium=medium, group_idx=entry[1]))

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

