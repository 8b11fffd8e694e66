"""Prometheus metrics of one server (its own registry, so several servers can share a process
in tests). Tier usage and fault counters are read from the tiers at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.cache_server.l2_sizing import SizerStats
from hybridkv.cache_server.tiers.base import TierStats

P = "hybridkv_server_"
_SLICE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        og = ["object_group"]
        self.requests = Counter(P + "requests", "Control requests handled, by op", ["op"], registry=r)
        self.errors = Counter(P + "errors", "Error replies, by code", ["code"], registry=r)
        self.internal_errors = Counter(P + "internal_errors", "Requests that met a server bug (answered "
                                       "`internal`, logged once)", registry=r)
        self.store_requests = Counter(P + "store_requests", "Store requests", registry=r)
        self.chunks_stored = Counter(P + "chunks_stored", "Chunks committed by every object group", registry=r)
        self.objects_stored = Counter(P + "objects_stored", "Objects placed in L1", og, registry=r)
        self.objects_skipped = Counter(P + "objects_skipped", "Objects not needed (all blocks null)", og,
                                       registry=r)
        self.refused = Counter(P + "refused_stores", "Objects refused, by reason", [*og, "reason"], registry=r)
        self.lookups = Counter(P + "lookups", "Lookup requests", registry=r)
        self.lookup_hit_tokens = Counter(P + "lookup_hit_tokens", "Tokens of lookup hits", registry=r)
        self.hit_chunks = Counter(P + "lookup_hit_chunks", "Chunks an object group serves in lookup hits", og,
                                  registry=r)
        self.retrieves = Counter(P + "retrieves", "Retrieve requests", registry=r)
        self.retrieved_chunks = Counter(P + "retrieved_chunks", "Chunks copied to engines", og, registry=r)
        self.bytes_in = Counter(P + "bytes_in", "Page bytes copied from engines", registry=r)
        self.bytes_out = Counter(P + "bytes_out", "Page bytes copied to engines", registry=r)
        self.evictions = Counter(P + "l1_evictions", "Objects evicted from L1", registry=r)
        self.l2_errors = Counter(P + "l2_errors", "L2 operations that failed (I/O, connection)", ["tier"],
                                 registry=r)
        self.l2_promotions = Counter(P + "l2_promotions", "Objects read from L2 into L1", ["tier"], registry=r)
        self.l2_write_dropped = Counter(P + "l2_write_dropped", "Objects not queued for L2 (queue full)",
                                        ["tier"], registry=r)
        self.lock_expired = Counter(P + "lock_expired", "Lookups whose locks expired unretrieved", registry=r)
        self.slice_seconds = Histogram(P + "slice_seconds", "One slice of a control request's work (others wait "
                                       "at most one slice per busy connection)", buckets=_SLICE_BUCKETS, registry=r)
        self.longest_slice = Gauge(P + "longest_slice_seconds", "The longest slice since start", registry=r)
        self.l1_bytes = Gauge(P + "l1_bytes_used", "Bytes in L1", registry=r)
        self.l1_objects = Gauge(P + "l1_objects", "Objects in L1", registry=r)
        self.l1_resumable_prefixes = Gauge(P + "l1_resumable_prefixes", "Chunk prefixes L1 can serve as a hit "
                                           "(every object group's objects present)", registry=r)
        self.l1_dead_objects = Gauge(P + "l1_dead_objects", "L1 objects no resumable prefix needs", registry=r)
        self.l1_dead_bytes = Gauge(P + "l1_dead_bytes", "Bytes of L1 objects no resumable prefix needs", registry=r)
        self.bytes_by_kind = Gauge(P + "l1_bytes_by_kind", "Bytes of L1 objects by kind (state, attention)",
                                   ["kind"], registry=r)
        self.l1_capacity = Gauge(P + "l1_capacity_bytes", "L1 capacity", registry=r)
        self.engines = Gauge(P + "registered_engines", "Registered engine instances", registry=r)
        self.leases_released = Counter(P + "leases_released", "Registrations dropped because their registration "
                                       "connection closed (the engine exited or was killed)", registry=r)

    def watch_tiers(self, stats: Callable[[], list[TierStats]],
                    sized: Callable[[], list[tuple[str, SizerStats]]] = list) -> None:
        self.registry.register(_TierCollector(stats))
        self.registry.register(_SizedTierCollector(sized))


class _SizedTierCollector(Collector):
    """The L2 tiers the server sizes by resumable prefixes (`--l2-sizing resumable`)."""

    def __init__(self, sized: Callable[[], list[tuple[str, SizerStats]]]) -> None:
        self._sized = sized

    def collect(self) -> Iterable[Metric]:
        resumable = GaugeMetricFamily(P + "tier_resumable_prefixes", "Chunk prefixes a sized L2 tier and L1 "
                                      "together serve as a hit (each object in one of them)", labels=["tier"])
        dead = GaugeMetricFamily(P + "tier_dead_bytes", "Bytes in a sized L2 tier that no resumable prefix "
                                 "there needs", labels=["tier"])
        by_kind = GaugeMetricFamily(P + "tier_bytes_by_kind", "Bytes the server placed in a sized L2 tier, by "
                                    "kind (state, attention)", labels=["tier", "kind"])
        evicted = CounterMetricFamily(P + "tier_sized_evictions", "Objects the server deleted from a sized L2 "
                                      "tier to make room", labels=["tier"])
        for name, z in self._sized():
            resumable.add_metric([name], z.resumable_prefixes)
            dead.add_metric([name], z.dead_bytes)
            by_kind.add_metric([name, "state"], z.state_bytes)
            by_kind.add_metric([name, "attention"], z.attention_bytes)
            evicted.add_metric([name], z.evictions)
        return [resumable, dead, by_kind, evicted]


class _TierCollector(Collector):
    def __init__(self, stats: Callable[[], list[TierStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        objects = GaugeMetricFamily(P + "tier_objects", "Objects in an L2 tier", labels=["tier"])
        used = GaugeMetricFamily(P + "tier_bytes_used", "Bytes in an L2 tier", labels=["tier"])
        corrupt = CounterMetricFamily(P + "tier_corrupt_dropped", "Corrupt or truncated objects dropped",
                                      labels=["tier"])
        errors = CounterMetricFamily(P + "tier_errors", "Errors the tier counted itself", labels=["tier"])
        evicted = CounterMetricFamily(P + "tier_evictions", "Objects a tier removed for room", labels=["tier"])
        for s in self._stats():
            objects.add_metric([s.name], s.objects)
            used.add_metric([s.name], s.bytes_used)
            corrupt.add_metric([s.name], s.corrupt_dropped)
            errors.add_metric([s.name], s.errors)
            evicted.add_metric([s.name], s.evictions)
        return [objects, used, corrupt, errors, evicted]
