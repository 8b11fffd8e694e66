"""The index's `longest_matched` equals the KV cache manager's own lookup, on random workloads.

Each workload runs requests through a real `KVCacheManager` (events on), ships its events through
the vLLM wire format into the index, and before each request compares the index's prediction with
the manager's `lookup` (the hit the engine would take)."""

from __future__ import annotations

import random

import pytest

from hybridkv.index.publisher import layout_events, wire_events
from hybridkv.index.service import IndexService, Query
from hybridkv.index.table import Registration
from hybridkv.kv_events.wire import EventBatch, decode_batch, encode_batch
from hybridkv.kvcache.block_pool import KVEvents
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions
from hybridkv.plan.planner import KVCacheGroupSpec
from tests.factories import make_config, make_group, make_request

KEY = ("default", "engine-0", 0)

LAYOUTS = {
    "full": [make_group(kind="full", block_size=4)],
    "full+sliding": [make_group(kind="full", block_size=4), make_group(kind="sliding", block_size=4, window_tokens=9)],
    "sliding-only": [make_group(kind="sliding", block_size=4, window_tokens=6)],
    "full+mamba": [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)],
    "full+sliding+mamba": [make_group(kind="full", block_size=4),
                           make_group(kind="sliding", block_size=4, window_tokens=5),
                           make_group(kind="mamba", block_size=4)],
    # (a state group listed first: its checkpoint's event comes before the attention blocks it chains onto)
    "mamba+full": [make_group(kind="mamba", block_size=4), make_group(kind="full", block_size=4)],
    "two block sizes": [make_group(kind="full", block_size=4), make_group(kind="sliding", block_size=8,
                                                                          window_tokens=12)],
}


def _service() -> IndexService:
    service = IndexService(subscribe=False)
    service.register(Registration(key=KEY, model="m", lora_name=None, block_size=4), None, None)
    return service


def _ship(service: IndexService, m: KVCacheManager, salts: dict[int, str] | None = None) -> None:
    events = wire_events(m.take_events(), salts)
    if events:
        service.apply(KEY, decode_batch(encode_batch(EventBatch(ts=0.0, events=events))))


def _workload(rng: random.Random, n: int) -> list[list[int]]:
    """Sessions that grow (multi-turn) over a few shared system prompts."""
    systems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(3)]
    sessions: list[list[int]] = []
    out = []
    for _ in range(n):
        if sessions and rng.random() < 0.6:
            s = rng.choice(sessions)
            s += [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        else:
            s = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 25))]
            sessions.append(s)
        out.append(list(s))
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prediction_equals_the_managers_hit(layout: str, seed: int) -> None:
    groups: list[KVCacheGroupSpec] = LAYOUTS[layout]
    m = KVCacheManager(make_config(groups=groups, num_blocks=48), max_model_len=4096,
                       options=CacheOptions(events=KVEvents.ON))
    service = _service()
    service.apply(KEY, EventBatch(ts=0.0, events=list(layout_events(m.config.groups))))
    rng = random.Random(seed)
    hits = 0
    for i, tokens in enumerate(_workload(rng, 120)):
        m.begin_step()
        request = make_request(request_id=f"r{i}", token_ids=tokens)
        predicted = service.query(Query(model="m", token_ids=tokens))["default"]["engine-0"]["longest_matched"]
        hit = m.lookup(request)
        assert predicted == hit.num_tokens, f"request {i} of {len(tokens)} tokens"
        hits += hit.num_tokens > 0
        # like the engine's scheduler: the prompt in two steps, the first ending on a block boundary
        # (where a state group checkpoints), then the rest
        aligned = request.num_tokens // 4 * 4 if request.num_tokens % 4 else request.num_tokens - 4
        if aligned > hit.num_tokens:
            if m.allocate(request, aligned - hit.num_tokens, hit=hit) is None:
                continue
            request.num_computed_tokens = aligned
            _ship(service, m)
            m.begin_step()
            hit = None
        if m.allocate(request, request.num_tokens - request.num_computed_tokens, hit=hit) is None:
            m.free(request)
            _ship(service, m)
            continue
        request.num_computed_tokens = request.num_tokens
        _ship(service, m)
        m.free(request)
        _ship(service, m)
    assert hits > 10  # (the workload exercises hits, not only misses)
