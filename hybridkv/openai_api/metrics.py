"""Prometheus metrics of `hybridkv serve` (its own registry, so tests can run several servers).

Request-side metrics (counters, TTFT / inter-token / end-to-end latency histograms) are observed
by the HTTP handlers. Engine-side ones are read from an `EngineSnapshot`, which the engine thread
takes when `/metrics` is scraped (the engine is only touched on its own thread):

    hybridkv_serve_prefix_cache_{queries,hits}_tokens    prompt tokens looked up / served locally
    hybridkv_serve_prefix_cache_group_hits_tokens{group}  what each KV cache group alone could serve
    hybridkv_serve_prefix_cache_hit_limited_by{group,reason}  lookups a group stopped, by reason
    hybridkv_serve_kv_cache_blocks{group}                 blocks held by requests, per group
    hybridkv_serve_kv_cache_usage_ratio                   held / usable blocks (one shared pool)
    hybridkv_serve_num_preemptions                        requests preempted (recomputed)
    hybridkv_serve_engine_steps / _scheduled_tokens       steps run, tokens they computed
    hybridkv_serve_num_requests_{running,waiting}
    hybridkv_serve_external_hits_tokens                   prompt tokens served by the KV cache server
    hybridkv_serve_external_{loads,failed_loads,saved_chunks}, hybridkv_serve_kv_server_attached
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridkv.connector.base import TransferStats
from hybridkv.engine.llm import LLM
from hybridkv.kvcache.hit_limits import HitLimit

P = "hybridkv_serve_"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    """The engine counters and gauges `/metrics` reports, taken on the engine thread."""

    query_tokens: int
    hit_tokens: int
    group_hit_tokens: tuple[int, ...]
    limited_by: tuple[dict[HitLimit, int], ...]
    group_blocks: tuple[int, ...]
    usage: float
    usable_blocks: int
    preemptions: int
    steps: int
    scheduled_tokens: int
    running: int
    waiting: int
    kv_server: bool  # a KV cache server is attached
    external_hit_tokens: int  # tokens the KV cache server served (looked up and allocated)
    external_loads: int
    external_failed_loads: int
    external_saved_chunks: int

    @classmethod
    def of(cls, llm: LLM) -> EngineSnapshot:
        stats = llm.manager_stats()
        ext = llm.transfer.connector.stats if llm.transfer is not None else TransferStats()
        return cls(kv_server=llm.transfer is not None, external_hit_tokens=ext.external_hit_tokens,
                   external_loads=ext.loads, external_failed_loads=ext.failed_loads,
                   external_saved_chunks=ext.saved_chunks,
                   query_tokens=stats.query_tokens, hit_tokens=stats.hit_tokens,
                   group_hit_tokens=stats.group_hit_tokens, group_blocks=llm.manager.group_usage(),
                   limited_by=stats.limited_by,
                   usage=llm.manager.usage(), usable_blocks=llm.plan.config.num_blocks - 1,
                   preemptions=llm.stats.preemptions, steps=llm.stats.steps,
                   scheduled_tokens=llm.stats.scheduled_tokens, running=len(llm.scheduler.running),
                   waiting=len(llm.scheduler.waiting))


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "Finished requests, by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.bad_requests = Counter(P + "bad_requests", "Requests refused with an error status", ["status"],
                                    registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between two generated tokens of a request",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS_S,
                             registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def set_engine(self, snapshot: EngineSnapshot) -> None:
        self._engine.snapshot = snapshot


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterable[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield _counter("prefix_cache_queries_tokens", "Prompt tokens looked up in the local prefix cache",
                       s.query_tokens)
        yield _counter("prefix_cache_hits_tokens", "Prompt tokens served by the local prefix cache", s.hit_tokens)
        groups = CounterMetricFamily(P + "prefix_cache_group_hits_tokens",
                                     "Tokens a KV cache group alone could serve at lookup", labels=["group"])
        blocks = GaugeMetricFamily(P + "kv_cache_blocks", "KV cache blocks held by requests", labels=["group"])
        for g, (hits, held) in enumerate(zip(s.group_hit_tokens, s.group_blocks, strict=True)):
            groups.add_metric([str(g)], hits)
            blocks.add_metric([str(g)], held)
        yield groups
        yield blocks
        limited = CounterMetricFamily(P + "prefix_cache_hit_limited_by", "Lookups a KV cache group stopped short, "
                                      "by reason (docs/prefix_caching.md)", labels=["group", "reason"])
        for g, counts in enumerate(s.limited_by):
            for limit, count in counts.items():
                limited.add_metric([str(g), limit.value], count)
        yield limited
        yield GaugeMetricFamily(P + "kv_cache_usage_ratio", "Held / usable KV cache blocks", value=s.usage)
        yield GaugeMetricFamily(P + "kv_cache_usable_blocks", "Usable KV cache blocks (shared by all groups)",
                                value=s.usable_blocks)
        yield _counter("num_preemptions", "Requests preempted (recomputed)", s.preemptions)
        yield _counter("engine_steps", "Engine steps run", s.steps)
        yield _counter("scheduled_tokens", "Tokens computed by engine steps (prefill chunks + decodes)",
                       s.scheduled_tokens)
        yield GaugeMetricFamily(P + "num_requests_running", "Requests running", value=s.running)
        yield GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting", value=s.waiting)
        yield GaugeMetricFamily(P + "kv_server_attached", "1 when a KV cache server is attached", value=s.kv_server)
        yield _counter("external_hits_tokens", "Prompt tokens served by the KV cache server", s.external_hit_tokens)
        yield _counter("external_loads", "Loads from the KV cache server", s.external_loads)
        yield _counter("external_failed_loads", "Loads that failed (recomputed)", s.external_failed_loads)
        yield _counter("external_saved_chunks", "Chunks stored in the KV cache server", s.external_saved_chunks)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, documentation, value=value)
