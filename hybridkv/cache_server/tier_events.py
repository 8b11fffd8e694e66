"""`hybridkv server --kv-events-config JSON`: the server's tiers as vLLM KV events, so that an index
(`hybridkv index`, the server registered as type "hybridkv-server") answers which prompt prefixes
the server can hand to an engine, per tier.

    L1 pool: placed / dropped (pool.PoolListener)                    ->  medium "CPU"
    a sized L2 tier: queued / deleted / cleared (l2.L2Listener)        ->  medium "DISK"
    a watched L2 tier: written / removed by anyone (tiers.TierWatcher) ->  medium "DISK"
    a thread: every `interval_s`, what came in as one batch          ->  kv_events.publisher (PUB + replay)

An event is one object: `block_hashes` = [its chunk id] (kv_events/chunk_ids.py: the connector's
chained chunk hash, folded with the cache salt when there is one), `block_size` = the server's chunk
tokens, `group_idx` = the object group, `kv_cache_spec_kind` (and window) = the object group's hit
rule; no token ids, no parent, no salt. Objects outside any prefix tree and object groups that gate
no hit (cross attention) are not published.

A tier the server sizes (the disk tier under `--l2-sizing resumable`, the default) is published as
the server decides its content: stored when queued for writing, removed when the server deletes it.
A tier that bounds itself is watched (l2.py, `L2Tier.watch`): an object is published once its write
is done, and removed whoever removes it: the disk tier under `--l2-sizing objects` reports its own
evictions; the Valkey tier subscribes to Valkey's keyspace notifications (evictions, expiries,
anyone's DEL; tiers/valkey_watch.py, which turns them on with CONFIG SET, and re-checks the published
objects after a lost subscription and every 30 s). A Valkey that refuses CONFIG gets a startup
warning and its objects are not published at all. An object held by two tiers (disk and Valkey) is
one DISK entry, removed when the last of them drops it.

Not published: objects a tier holds from an earlier run or from another server sharing the Valkey
namespace (a lookup finds them; the index does not), and a sized tier's write that fails (known, and
published as removed, when a lookup next reads it). So `DISK` can fall short of the server's lookup;
it is over it only for a sized tier's failed write until that read, or for a Valkey deletion until
its notification arrives (milliseconds; at most an audit period when notifications were lost).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hybridkv.cache_server.prefix_index import ObjectPlace
from hybridkv.cache_server.registered_layout import TreeRules
from hybridkv.kv_events.chunk_ids import MEDIUM_CPU, MEDIUM_DISK, SERVER_TYPE, chunk_id
from hybridkv.kv_events.publisher import ZmqPublisher
from hybridkv.kv_events.wire import BlockRemoved, BlockStored, KVEventsConfig

__all__ = ["MEDIUM_CPU", "MEDIUM_DISK", "SERVER_TYPE", "TierEvents"]

L1 = "L1"  # (the holder name of L1's objects)
MAX_QUEUED = 1 << 16  # watched tiers' objects waiting for their write (the oldest forgotten past it)


@dataclass(slots=True)
class _Published:
    chunk_id: bytes
    object_group: int
    holders: set[str] = field(default_factory=set)  # the tiers holding the object (L1 for CPU)


class TierEvents:
    """A pool listener that publishes what enters and leaves L1 (thread-safe: the store calls it under
    its lock, the publishing thread drains it)."""

    def __init__(self, config: KVEventsConfig, chunk_tokens: int, *, interval_s: float = 0.01) -> None:
        self.publisher = ZmqPublisher(config)
        self._chunk_tokens = chunk_tokens
        self._interval_s = interval_s
        self._published: dict[tuple[str, bytes], _Published] = {}  # (medium, object key) -> what was published
        self._queued: dict[tuple[str, bytes], ObjectPlace | None] = {}  # (tier, key) -> place, until written
        self._pending: list[BlockStored | BlockRemoved] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-server-events", daemon=True)
        self._thread.start()

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        self._stored(MEDIUM_CPU, key, place, L1)

    def used(self, key: bytes) -> None:
        pass

    def dropped(self, key: bytes) -> None:
        self._removed(MEDIUM_CPU, key, L1)

    # -- the L2 tiers (l2.L2Listener) ---------------------------------------------------------------

    def l2_stored(self, tier: str, key: bytes, place: ObjectPlace | None) -> None:
        self._stored(MEDIUM_DISK, key, place, tier)

    def l2_queued(self, tier: str, key: bytes, place: ObjectPlace | None) -> None:
        with self._lock:
            self._queued[(tier, key)] = place
            if len(self._queued) > MAX_QUEUED:  # (writes that failed: never written)
                del self._queued[next(iter(self._queued))]

    def l2_written(self, tier: str, key: bytes) -> None:
        with self._lock:
            if (tier, key) not in self._queued:  # (not this run's object: unknown place)
                return
            place = self._queued.pop((tier, key))
        self._stored(MEDIUM_DISK, key, place, tier)

    def l2_removed(self, tier: str, key: bytes) -> None:
        self._removed(MEDIUM_DISK, key, tier)

    def l2_cleared(self, tier: str) -> None:
        for key in self.l2_keys(tier):
            self._removed(MEDIUM_DISK, key, tier)

    def l2_keys(self, tier: str) -> list[bytes]:
        with self._lock:
            return [k[1] for k, entry in self._published.items() if k[0] == MEDIUM_DISK and tier in entry.holders]

    def _stored(self, medium: str, key: bytes, place: ObjectPlace | None, holder: str) -> None:
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
            entry = self._published.get((medium, key))
            if entry is None:
                entry = self._published[(medium, key)] = _Published(cid, place.object_group)
                self._pending.append(event)
            entry.holders.add(holder)  # (written again, or by another tier: already published)

    def _removed(self, medium: str, key: bytes, holder: str) -> None:
        with self._lock:
            entry = self._published.get((medium, key))
            if entry is None or holder not in entry.holders:
                return
            entry.holders.discard(holder)
            if not entry.holders:  # (the last tier of the medium let it go)
                del self._published[(medium, key)]
                self._pending.append(BlockRemoved(block_hashes=[entry.chunk_id], medium=medium,
                                                  group_idx=entry.object_group))

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

