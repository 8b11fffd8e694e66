"""`probe_memo.py`: a waiting request's remembered probe equals a fresh lookup after every step of a pool
that evicts and caches anew, and a simulation with the memo takes exactly the decisions it takes without."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import PRESETS, CacheOptions, MambaCacheMode
from hybridkv.kvcache.prefix_map import PrefixMap
from hybridkv.kvcache.probe_memo import MAX_CHANGES, ProbeMemo, WaitingProbes
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate
from hybridkv.simulate.simulator import SimOptions, simulate
from tests.factories import make_config, make_group, make_request, run_and_free

R = RequestId("w")


def chain(n: int, start: int = 0) -> dict[int, list[bytes]]:
    return {4: [bytes([start + i]) for i in range(n)]}


def test_an_answer_lives_until_a_key_it_read_changes() -> None:
    pmap = PrefixMap((0,), num_blocks=64)
    memo = ProbeMemo([pmap])
    keys = chain(10)
    memo.store(R, 41, hit_tokens=12, hashes=keys, reach_tokens=12)  # read keys 0..3 (one past the hit's 3)
    pmap.slot_for(keys[4][5])  # a key past what the probe read: the answer stands
    answer = memo.hit(R, 41)
    assert answer is not None and answer.hit_tokens == 12
    assert memo.hit(R, 45) is None  # (the request grew: another chain end)
    pmap.slot_for(keys[4][3])  # the key after the hit was cached: the hit may be longer now
    assert memo.hit(R, 41) is None


def test_an_evicted_key_drops_the_answer_and_a_flood_of_changes_drops_all() -> None:
    pmap = PrefixMap((0,), num_blocks=64)
    memo = ProbeMemo([pmap])
    keys = chain(6)
    slots = pmap.slots_for(keys[4][:2])
    pmap.count[slots] = 1
    memo.store(R, 30, hit_tokens=8, hashes=keys, reach_tokens=8)
    memo.store(RequestId("x"), 30, hit_tokens=0, hashes=chain(3, start=100), reach_tokens=0)
    pmap.release_one(int(slots[1]))  # the hit's second block evicted
    assert memo.hit(R, 30) is None and memo.hit(RequestId("x"), 30) is not None
    memo.store(R, 30, hit_tokens=4, hashes=keys, reach_tokens=4)
    for i in range(MAX_CHANGES + 1):
        pmap.changes.append(bytes(8) + i.to_bytes(4, "big"))  # type: ignore[union-attr]
    memo.bound()  # (a step without a probe: the log does not grow past the bound)
    assert pmap.changes == [] and memo.hit(R, 30) is None
    memo.store(R, 30, hit_tokens=4, hashes=keys, reach_tokens=4)
    for i in range(MAX_CHANGES + 1):
        pmap.changes.append(bytes(8) + i.to_bytes(4, "big"))  # type: ignore[union-attr]
    assert memo.hit(R, 30) is None  # (read past the bound: every answer dropped too)


def hybrid_groups(kind: str) -> list[KVCacheGroupSpec]:
    second = (make_group(kind="sliding_window", block_size=4, window_tokens=8) if kind == "sliding"
              else make_group(kind="mamba", block_size=4))
    return [make_group(kind="full", block_size=4), second]


@pytest.fixture
def memo_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the answers the memo gave back (0: the test would not test the memo)."""
    reads = [0]
    real = ProbeMemo.hit

    def counted(self: ProbeMemo, request_id: RequestId, num_tokens: int) -> object:
        answer = real(self, request_id, num_tokens)
        reads[0] += answer is not None
        return answer

    monkeypatch.setattr(ProbeMemo, "hit", counted)
    yield reads


@pytest.mark.parametrize("kind", ["sliding", "mamba"])
@pytest.mark.parametrize("seed", range(3))
def test_remembered_peeks_equal_fresh_lookups(kind: str, seed: int, memo_reads: list[int]) -> None:
    rng = random.Random(seed)
    options = CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN) if kind == "mamba" else CacheOptions()
    manager = KVCacheManager(make_config(groups=hybrid_groups(kind), num_blocks=48), max_model_len=512,
                             options=options)
    roots = [[rng.randrange(50) for _ in range(rng.randint(12, 60))] for _ in range(4)]
    waiting = [make_request(request_id=f"w{i}", token_ids=[*rng.choice(roots), rng.randrange(50)]) for i in range(6)]
    hits = 0
    for step in range(150):
        root = rng.choice(roots)
        running = make_request(request_id=f"r{step}", token_ids=[*root[: rng.randint(4, len(root))], step])
        run_and_free(manager, running, chunk=8)
        if rng.random() < 0.1:  # a waiting request grows (a preempted one, resumed longer)
            rng.choice(waiting).token_ids.extend([rng.randrange(50)] * 4)
        for request in waiting:
            peeked = manager.peek(request)
            assert peeked == manager.lookup(request).num_tokens, (step, request.request_id)
            hits += peeked > 0
    assert hits > 100 and memo_reads[0] > 200


@pytest.mark.parametrize("layout", ["sliding", "mamba"])
def test_a_simulation_takes_the_same_decisions_with_the_memo(layout: str, memo_reads: list[int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybridkv preset (cache-aware order, queue-aware retention, the online choice's ghosts) under
    pressure: its hits, prefill, preemptions and waits equal those of the run that probes afresh each time."""
    groups = [make_group(kind="full", block_size=16),
              make_group(kind="sliding_window", block_size=16, window_tokens=64) if layout == "sliding"
              else make_group(kind="mamba", block_size=16)]
    config = make_config(groups=groups, num_blocks=200)
    trace = generate(Generator.CHAT, GeneratorOptions(num_requests=80, seed=3, gap_ms=10, mean_prompt_tokens=200))
    options = SimOptions(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=16,
                         cache=dataclasses.replace(PRESETS["hybridkv"]))
    with_memo = simulate(trace, config, options)
    monkeypatch.setattr(WaitingProbes, "_memo", lambda self: None)
    fresh = simulate(trace, config, options)
    assert memo_reads[0] > 100 and with_memo.hit_tokens > 0
    assert dataclasses.replace(with_memo, wall_s=0) == dataclasses.replace(fresh, wall_s=0)
