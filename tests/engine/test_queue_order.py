"""`--queue-order cache_aware`: the longest cached prefix admitted first, ties and starved requests
in arrival order; against hand-computed orders and the real manager (no model)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.request import Request
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import QueueOrder
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.queue_order import MAX_BYPASS, PROBE_WINDOW, Bypasses, cache_aware
from hybridkv.scheduling.scheduler import Scheduler
from tests.engine.test_scheduler import make_scheduler, step
from tests.factories import make_config, make_group


@dataclass
class Queued:
    arrival_seq: int
    hit: int

    @property
    def request_id(self) -> RequestId:
        return RequestId(f"q{self.arrival_seq}")


def joined(*queued: Queued, bypasses: Bypasses | None = None) -> Bypasses:
    """Bypasses with `queued` joined in arrival order."""
    bypasses = bypasses or Bypasses()
    for q in sorted(queued, key=lambda q: q.arrival_seq):
        bypasses.joined(q)
    return bypasses


def order(waiting: list[Queued], bypasses: Bypasses | None = None) -> list[int]:
    out = cache_aware(deque(waiting), lambda q: q.hit, bypasses or joined(*waiting))
    return [q.arrival_seq for q in out]


def test_the_longest_hit_goes_first_and_ties_keep_arrival_order() -> None:
    queue = [Queued(4, 0), Queued(1, 64), Queued(2, 16), Queued(3, 64), Queued(0, 0), Queued(5, 64)]
    assert order(queue) == [1, 3, 5, 2, 0, 4]


def test_requests_behind_the_probe_window_keep_their_place() -> None:
    queue = [Queued(i, 0) for i in range(PROBE_WINDOW)] + [Queued(PROBE_WINDOW, 999), Queued(PROBE_WINDOW + 1, 5)]
    assert order(queue)[-2:] == [PROBE_WINDOW, PROBE_WINDOW + 1]


def test_a_request_passed_over_max_bypass_times_goes_first() -> None:
    old = Queued(0, 0)
    bypasses = joined(old)
    for seq in range(1, MAX_BYPASS + 1):
        later = Queued(seq, 32)
        joined(later, bypasses=bypasses)
        assert order([old, later], bypasses)[0] == seq
        bypasses.admitted([later], [old])  # a later joiner went first: one bypass
    assert bypasses.starved(old)
    last = Queued(99, 32)
    joined(last, bypasses=bypasses)
    assert order([old, last], bypasses) == [0, 99]
    bypasses.admitted([old], [last])
    assert not bypasses.starved(old)  # admitted: its count is forgotten
    assert not bypasses.starved(last)  # an earlier joiner going first is no bypass


def test_an_admission_counts_only_against_earlier_joiners() -> None:
    early, middle, late = Queued(1, 0), Queued(5, 0), Queued(9, 0)
    bypasses = joined(early, middle, late)
    for _ in range(MAX_BYPASS):
        bypasses.admitted([middle], [early, late])
    assert bypasses.starved(early) and not bypasses.starved(late)


def test_a_preempted_request_keeps_its_place_in_join_order() -> None:
    first, second = Queued(1, 0), Queued(2, 0)
    bypasses = joined(first, second)
    joined(first, bypasses=bypasses)  # back in the queue after a preemption: still the first joiner
    assert order([second, first], bypasses) == [1, 2]
    bypasses.forget([first.request_id])  # finished: a new request of that id joins last
    joined(first, bypasses=bypasses)
    assert order([first, second], bypasses) == [2, 1]


def tokens(seq: int, length: int) -> list[int]:
    return torch.randint(3, 100, (length,), generator=torch.Generator().manual_seed(seq)).tolist()


def request(seq: int, token_ids: list[int]) -> Request:
    return Request(kv=KVRequest(request_id=RequestId(f"r{seq}"), token_ids=list(token_ids)), arrival_seq=seq,
                   prompt_len=len(token_ids), sampling=SamplingParams(max_tokens=2, eos=EosMode.IGNORE),
                   generator=torch.Generator(), arrival_s=float(seq))


@pytest.mark.parametrize(("queue_order", "first"), [(QueueOrder.FCFS, "r1"), (QueueOrder.CACHE_AWARE, "r2")])
def test_the_scheduler_admits_the_cached_prefix_first(queue_order: QueueOrder, first: str) -> None:
    scheduler = make_scheduler(blocks=64, budget=64, max_num_seqs=1)
    scheduler.queue_order = queue_order
    shared = tokens(0, 24)
    scheduler.add(request(0, shared + tokens(10, 4)))
    while scheduler.has_unfinished:  # r0 runs alone and leaves its 24-token prefix cached
        step(scheduler)
    scheduler.add(request(1, tokens(11, 20)))  # arrived first, hits nothing
    scheduler.add(request(2, shared + tokens(12, 4)))  # hits the 24 shared tokens
    out = step(scheduler)
    assert [w.request.request_id for w in out.work] == [first]
    assert out.work[0].start_pos == (24 if first == "r2" else 0)
    while scheduler.has_unfinished:  # the other one still runs
        step(scheduler)


def test_peek_finds_the_lookup_hit_and_counts_nothing() -> None:
    groups = [make_group(kind="full", block_size=4)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=16), max_model_len=64)
    manager.begin_step()
    owner = KVRequest(request_id=RequestId("a"), token_ids=list(range(10)))
    assert manager.allocate(owner, 10) is not None
    owner.num_computed_tokens = 10
    manager.free(owner)
    probe = KVRequest(request_id=RequestId("b"), token_ids=[*range(9), 99, 98])
    before = manager.stats()
    assert manager.peek(probe) == 8  # two whole 4-token blocks of the 9 shared tokens
    assert manager.stats() == before
    assert manager.lookup(probe).num_tokens == 8
    assert manager.stats().lookups == before.lookups + 1


def test_scheduler_default_is_fcfs_and_the_engine_config_names_a_bad_order() -> None:
    manager = KVCacheManager(make_config(groups=[make_group(kind="full", block_size=4)], num_blocks=8),
                             max_model_len=64)
    assert Scheduler(manager, max_num_batched_tokens=8, max_num_seqs=2).queue_order is QueueOrder.FCFS
    with pytest.raises(ConfigError, match="queue_order must be one of"):
        EngineConfig.from_options({"queue_order": "lifo"})  # type: ignore[arg-type]
    assert EngineConfig.from_options({"queue_order": "cache_aware"}).cache.queue_order is QueueOrder.CACHE_AWARE


def naive_order(waiting: list[Queued], starved: set[int]) -> list[int]:
    """Pick one at a time: a starved request (earliest to join) if any, else the longest hit
    (earliest to join among equals; here they joined in arrival order); only the first
    PROBE_WINDOW are candidates."""
    window, rest = list(waiting[:PROBE_WINDOW]), waiting[PROBE_WINDOW:]
    out = []
    while window:
        hungry = [q for q in window if q.arrival_seq in starved]
        pick = (min(hungry, key=lambda q: q.arrival_seq) if hungry
                else min(window, key=lambda q: (-q.hit, q.arrival_seq)))
        window.remove(pick)
        out.append(pick.arrival_seq)
    return out + [q.arrival_seq for q in rest]


@settings(max_examples=200, deadline=None)
@given(hits=st.lists(st.sampled_from([0, 16, 32, 64]), min_size=1, max_size=PROBE_WINDOW + 8),
       starved=st.sets(st.integers(0, PROBE_WINDOW + 8), max_size=4), seed=st.integers(0, 1000))
def test_the_order_matches_a_naive_selection(hits: list[int], starved: set[int], seed: int) -> None:
    import random

    arrivals = list(range(len(hits)))
    random.Random(seed).shuffle(arrivals)  # a queue not in arrival order (preempted requests go back first)
    queue = [Queued(a, h) for a, h in zip(arrivals, hits, strict=True)]
    bypasses = joined(*queue)
    newcomer = Queued(10_000, 0)
    joined(newcomer, bypasses=bypasses)
    for _ in range(MAX_BYPASS):
        bypasses.admitted([newcomer], [q for q in queue if q.arrival_seq in starved])
    assert order(queue, bypasses) == naive_order(queue, starved)
