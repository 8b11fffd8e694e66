"""The engine's KV event stream: the manager's events go out as vLLM's (`--kv-events-config`,
hybridkv/index/publisher.py), so KV indexers and routers see this engine.

A step publishes twice: once right after scheduling, before the forward pass, and once after it.
Scheduling is where the cache changes (allocation evicts; blocks are cached as they are allocated,
as vLLM caches them: a request admitted in a later step hits them); the forward pass of a CPU step
takes 50-500 ms, and a router asking during it would otherwise see the cache as it was before the
step, while the request it routes is admitted after it (a stale prediction, over or under).

Salts: the manager's events carry no cache salt; a chain's first block hash is matched to the
salted requests of the step (their first block hash per block size) to put the salt where vLLM
puts it (`extra_keys` of the first block)."""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.index.publisher import external_hash, layout_events, wire_events
from hybridkv.kv_events.publisher import ZmqPublisher
from hybridkv.kv_events.wire import KVEventsConfig
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.request import KVRequest


class KVEventStream:
    """Publishes a manager's events; `close` stops the publisher thread and its sockets."""

    def __init__(self, config: KVEventsConfig, manager: KVCacheManager) -> None:
        self._manager = manager
        self.publisher = ZmqPublisher(config, announce=layout_events(manager.config.groups))

    def publish(self, requests: Iterable[KVRequest] = ()) -> None:
        """Send what the manager recorded since the last call (nothing when it recorded nothing)."""
        events = self._manager.take_events()
        if not events:
            return
        salts: dict[int, str] = {}
        for request in requests:
            if request.cache_salt is not None:
                for hashes in request.block_hashes.values():
                    if hashes:
                        salts[external_hash(hashes[0])] = request.cache_salt
        self.publisher.publish(wire_events(events, salts))

    def close(self) -> None:
        self.publisher.shutdown()
