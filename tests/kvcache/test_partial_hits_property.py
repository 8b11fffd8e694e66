"""Partial hits under random traces: small pools (eviction, preemption, refused copy-on-write steps),
the engine's scheduler loop (`simulate`), our manager checked after every verb.

Checked against a model that does not use the manager's code: every hit (not deferred) is a prefix
some step computed or computes now (the prefixes, every unit, of the steps allocated so far),
lands on the unit, and leaves the last prompt token; `check_integrity` holds
after every allocate, free and copy hand-out (the copies' retained blocks included).
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.errors import CapacityError
from hybridkv.kvcache.manager import (
    BlockCopy,
    CacheHit,
    CheckpointPlacement,
    EvictionPolicyName,
    KVCacheManager,
    NewBlocks,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.simulate.simulator import SimOptions, simulate
from hybridkv.simulate.trace import TraceRequest
from tests.factories import make_config, make_group

UNIT = 2
#: what the random runs exercised (the last test checks it): partial hits, copies, preemptions
COVERAGE = {"partial_hits": 0, "copies": 0, "preemptions": 0}
GROUPS = [make_group(kind="full", block_size=8), make_group(kind="mamba", block_size=8),
          make_group(kind="mamba", block_size=8)]


class Checked:
    """Our manager behind the verbs the loop calls, checking each answer (module docstring)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.inner = manager
        self.computed: set[tuple[int, ...]] = set()
        self.partial_hits = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record(self, request: KVRequest, end: int) -> None:
        tokens = request.token_ids
        for stop in range(UNIT, min(end, request.num_tokens) + 1, UNIT):
            self.computed.add(tuple(tokens[:stop]))

    def lookup(self, request: KVRequest) -> CacheHit:
        hit = self.inner.lookup(request)
        n = hit.num_tokens
        assert n % UNIT == 0 and n <= request.num_tokens - 1
        if not hit.deferred:  # (a deferred hit is refused by allocate)
            assert n == 0 or tuple(request.token_ids[:n]) in self.computed, f"unsound hit of {n} tokens"
            self.partial_hits += bool(n % 8)
        return hit

    def allocate(self, request: KVRequest, num_new_tokens: int, **options: Any) -> NewBlocks | None:
        hit = options.get("hit")
        new = self.inner.allocate(request, num_new_tokens, **options)
        self.inner.check_integrity()
        if new is not None:  # what this step computes (a hit on it in this step reads it in this forward)
            self._record(request, request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens)
        return new

    def free(self, request: KVRequest) -> None:
        self.inner.free(request)
        self.inner.check_integrity()

    def take_pending_copies(self) -> tuple[BlockCopy, ...]:
        copies = self.inner.take_pending_copies()
        self.inner.check_integrity()
        return copies


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    bases = draw(st.lists(st.lists(st.integers(1, 3), min_size=6, max_size=30), min_size=1, max_size=3))
    out = []
    for i in range(draw(st.integers(2, 12))):
        base = draw(st.sampled_from(bases))
        keep = draw(st.integers(1, len(base)))
        tail = draw(st.lists(st.integers(4, 9), max_size=10))
        out.append(TraceRequest(arrival_ms=30.0 * draw(st.integers(0, 3)) * i, new_tokens=tuple(base[:keep] + tail),
                                output_tokens=draw(st.integers(1, 6))))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=traces(), num_blocks=st.integers(10, 40), budget=st.sampled_from([4, 8, 13, 64]),
       eviction=st.sampled_from(list(EvictionPolicyName)), placement=st.sampled_from(list(CheckpointPlacement)))
def test_partial_hits_stay_sound_and_the_pool_consistent(trace: list[TraceRequest], num_blocks: int, budget: int,
                                                         eviction: EvictionPolicyName,
                                                         placement: CheckpointPlacement) -> None:
    config = make_config(groups=GROUPS, num_blocks=num_blocks)
    cache = CacheOptions(prefix_match_unit=UNIT, eviction=eviction, checkpoint_placement=placement)
    options = SimOptions(max_model_len=64, max_num_batched_tokens=budget, max_num_seqs=4, cache=cache)
    manager = Checked(KVCacheManager(config, max_model_len=64, options=cache))
    assert manager.match_unit.partial_hits
    try:
        report = simulate(trace, config, options, manager=manager)  # type: ignore[arg-type]
    except CapacityError:
        return  # a request alone does not fit this pool
    assert manager.inner.usage() == 0.0
    COVERAGE["partial_hits"] += manager.partial_hits
    COVERAGE["copies"] += report.block_copies
    COVERAGE["preemptions"] += report.preemptions


def test_the_random_runs_hit_inside_blocks_copy_and_preempt() -> None:
    """(runs after the property above, in file order)"""
    assert all(COVERAGE.values()), COVERAGE
