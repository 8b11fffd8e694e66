"""The online choice (`policies/ghosts.py`): the candidates by hand, a switch of the value weights
against a hand-computed order, each ghost's hits against a separate manager run at that ghost's
choice, and the live manager ending on the choice whose separate run hit most."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.kvcache.eviction import BlockValue
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import PRESETS, CacheOptions, EvictionPolicyName, OnlineChoice, options_from
from hybridkv.kvcache.policies import ghosts
from hybridkv.kvcache.policies.ghosts import Choice, candidates
from hybridkv.kvcache.policies.value import ValuePolicy, ValueWeights
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.specs import SpecKind
from tests.factories import make_config, make_group, make_request

DENSE_VALUE = Choice(state_retention=None, value_bonuses=True)


def test_candidates_by_hand() -> None:
    assert candidates(DENSE_VALUE, has_value=True, has_states=True) == [
        DENSE_VALUE, Choice(state_retention=None, value_bonuses=False),
        Choice(state_retention=0, value_bonuses=True), Choice(state_retention=0, value_bonuses=False)]
    assert candidates(Choice(state_retention=0, value_bonuses=True), has_value=False, has_states=True) == [
        Choice(state_retention=0, value_bonuses=True), DENSE_VALUE]
    assert candidates(DENSE_VALUE, has_value=False, has_states=False) == [DENSE_VALUE]


def test_recency_only_weights_reorder_the_free_queue_by_release() -> None:
    """test_value_policy's hand-computed pool: blocks 1..6 released in order, 1 a full-attention block
    (bonus 1 pool), 3 an anchor (2 pools): order 2 4 5 6 1 3. With no bonus: release order, 1..6."""
    content = np.ones(7, np.bool_)
    policy = ValuePolicy(7, content, ValueWeights(full=1.0, anchor=2.0, hot=2.5, protected=3.0))
    policy.bind(np.array([0, 0, 1, 1, 1, 1, 1], np.int64), [SpecKind.FULL, SpecKind.SLIDING_WINDOW])
    policy.pop_few(6)
    policy.mark([3], BlockValue.ANCHOR)
    policy.release_few([1, 2, 3, 4, 5, 6])
    assert policy.ordered() == [2, 4, 5, 6, 1, 3]
    policy.set_weights(ValueWeights.recency_only())
    assert policy.ordered() == [1, 2, 3, 4, 5, 6]
    policy.set_weights(ValueWeights(full=1.0, anchor=2.0, hot=2.5, protected=3.0))
    assert policy.pop_few(6) == [2, 4, 5, 6, 1, 3]


def hybrid_manager(options: CacheOptions, num_blocks: int) -> KVCacheManager:
    groups = [make_group(kind="full", block_size=16), make_group(kind="mamba", block_size=16),
              make_group(kind="mamba", block_size=16)]
    return KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=4096, options=options)


def sessions(seed: int, num_requests: int) -> list[list[int]]:
    """Multi-turn conversations: each turn repeats its session's last prompt and adds 40-120 tokens
    (a session over 300 tokens starts over); a few shared system prompts open the sessions."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    open_sessions: list[list[int]] = []
    prompts = []
    for _ in range(num_requests):
        if not open_sessions or rng.random() < 0.3:
            open_sessions.append(list(rng.choice(systems)))
        index = rng.randrange(len(open_sessions))
        if len(open_sessions[index]) > 300:
            open_sessions[index] = list(rng.choice(systems))
        prompt = open_sessions[index] + [rng.randrange(1000) for _ in range(rng.randint(40, 120))]
        open_sessions[index] = prompt
        prompts.append(prompt)
    return prompts


def drive(manager: KVCacheManager, prompts: list[list[int]], chunk: int = 32,
          ends: list[list[int]] | None = None) -> int:
    """One request at a time, its prompt in `chunk`-token steps (align mode keeps a checkpoint at
    each step end), one decode token, freed; returns the hit tokens. `ends`, when given, collects
    each request's step ends."""
    hits = 0
    for i, prompt in enumerate(prompts):
        request = make_request(request_id=f"r{i}", token_ids=prompt)
        manager.begin_step()
        hit = manager.lookup(request)
        hits += hit.num_tokens
        done = hit.num_tokens
        steps: list[int] = []
        while done < len(prompt):
            end = min(len(prompt), (done // chunk + 1) * chunk)
            assert manager.allocate(request, end - done, hit=None if steps else hit) is not None
            steps.append(end)
            request.num_computed_tokens = done = end
            manager.begin_step()
        request.token_ids.append(7)
        assert manager.allocate(request, 1) is not None
        request.num_computed_tokens += 1
        steps.append(request.num_computed_tokens)
        manager.free(request)
        if ends is not None:
            ends.append(steps)
    return hits


def replay(manager: KVCacheManager, prompts: list[list[int]], ends: list[list[int]]) -> int:
    """What a ghost must do, written out: each request looked up, then allocated step by step to the
    live run's step ends past its own hit (the first step at least one token past it), then freed."""
    hits = 0
    for i, (prompt, steps) in enumerate(zip(prompts, ends, strict=True)):
        request = make_request(request_id=f"r{i}", token_ids=prompt)
        manager.begin_step()
        hit = manager.lookup(request)
        hits += hit.num_tokens
        done = hit.num_tokens
        for k, end in enumerate(steps):
            if k == len(steps) - 1:
                request.token_ids.append(7)  # (the decode step)
            if k == 0:
                target = max(end, done + 1)
                assert manager.allocate(request, target - done, hit=hit) is not None
                request.num_computed_tokens = done = target
            elif end > done:
                assert manager.allocate(request, end - done) is not None
                request.num_computed_tokens = done = end
            manager.begin_step()
        manager.free(request)
    return hits


BASE = options_from(PRESETS["vllm"], {"eviction": EvictionPolicyName.VALUE})


@pytest.mark.parametrize("seed", range(3))
def test_each_ghost_hits_what_a_manager_run_at_its_choice_hits(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ghosts, "DECIDE_EVERY", 10**9)  # (the live manager keeps its choice)
    monkeypatch.setattr(ghosts, "START_UNDER_PRESSURE", False)  # (ghosts from the first request)
    prompts = sessions(seed, 40)
    live = hybrid_manager(BASE.replace(online_choice=OnlineChoice.GHOSTS), num_blocks=40)
    ends: list[list[int]] = []
    live_hits = drive(live, [list(p) for p in prompts], ends=ends)
    online = live.policies.stats().online
    assert online is not None and online.switches == 0
    separate = []
    for choice in candidates(DENSE_VALUE, has_value=True, has_states=True):
        manager = hybrid_manager(BASE, num_blocks=40)
        manager.policies.apply(choice)
        separate.append((choice.describe(), replay(manager, [list(p) for p in prompts], ends), 0))
    assert online.ghosts == tuple(separate)
    assert live_hits == separate[0][1]
    assert len({hits for _, hits, _ in separate}) > 1  # (the choices differ on this workload)


def test_the_live_manager_ends_on_the_choice_that_hits_most(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ghosts, "HALF_LIFE_ADMISSIONS", 10**6)  # (scores: the hits so far)
    monkeypatch.setattr(ghosts, "START_UNDER_PRESSURE", False)
    prompts = sessions(7, 160)
    static = {}
    for choice in candidates(DENSE_VALUE, has_value=True, has_states=True):
        manager = hybrid_manager(BASE, num_blocks=40)
        manager.policies.apply(choice)
        static[choice] = drive(manager, [list(p) for p in prompts])
    best = max(static, key=lambda c: static[c])
    assert static[best] > static[DENSE_VALUE] * 1.05, static  # (a workload where the start is not the best)
    live = hybrid_manager(BASE.replace(online_choice=OnlineChoice.GHOSTS), num_blocks=40)
    live_hits = drive(live, prompts)
    online = live.policies.stats().online
    assert online is not None and online.current == best.describe()
    assert live.policies.choice == best
    assert live_hits > static[DENSE_VALUE]


def test_off_by_default_and_nothing_to_choose_without_switchable_knobs() -> None:
    assert hybrid_manager(BASE, num_blocks=40).policies.stats().online is None
    lru_full = KVCacheManager(make_config(num_blocks=16), max_model_len=256,
                              options=CacheOptions(online_choice=OnlineChoice.GHOSTS))
    assert lru_full.policies.duel is None  # one candidate: nothing to learn
    request = make_request(request_id="a", token_ids=list(range(40)))
    assert lru_full.allocate(request, 40, hit=lru_full.lookup(request)) is not None


def test_requests_keep_their_own_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ghost works on its own copy: the live request's computed tokens and stops are the live manager's."""
    monkeypatch.setattr(ghosts, "START_UNDER_PRESSURE", False)  # (this pool never evicts: ghosts from the start)
    live = hybrid_manager(BASE.replace(online_choice=OnlineChoice.GHOSTS), num_blocks=40)
    request: KVRequest = make_request(request_id="a", token_ids=list(range(70)))
    live.begin_step()
    hit = live.lookup(request)
    assert live.allocate(request, 70, hit=hit) is not None
    assert request.num_computed_tokens == 0
    live.check_integrity()


def test_ghosts_start_at_the_first_eviction() -> None:
    """A pool that holds the whole working set never builds ghosts; once it evicts a cached block they run."""
    prompts = sessions(3, 30)
    roomy = hybrid_manager(BASE.replace(online_choice=OnlineChoice.GHOSTS), num_blocks=2000)
    drive(roomy, [list(p) for p in prompts])
    online = roomy.policies.stats().online
    assert online is not None and not online.started and online.ghosts == ()
    tight = hybrid_manager(BASE.replace(online_choice=OnlineChoice.GHOSTS), num_blocks=40)
    drive(tight, [list(p) for p in prompts])
    online = tight.policies.stats().online
    assert online is not None and online.started and sum(hits for _, hits, _ in online.ghosts) > 0
