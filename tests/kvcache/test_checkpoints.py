"""Checkpoint placement: stops computed by hand, a hint that turns into a state hit, and the anchors
a value-aware policy keeps (a finished sequence's window tail outlives the unanchored ones)."""

from __future__ import annotations

from hybridkv.engine.scheduler import RequestStatus, Scheduler
from hybridkv.kvcache.checkpoints import CheckpointPlacement, CheckpointPlanner
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.value_policy import BlockValue, ValuePolicy
from hybridkv.simulate.simulator import SimRequest
from tests.factories import make_config, make_group


def request(tokens: list[int], *, hints: tuple[int, ...] = (), name: str = "a") -> KVRequest:
    return KVRequest(request_id=RequestId(name), token_ids=tokens, cache_checkpoints=hints)


def test_stops_by_hand() -> None:
    placed = CheckpointPlanner(CheckpointPlacement.PLACED, alignment_tokens=16, interval_tokens=32)
    assert placed.stops(request(list(range(100)), hints=(50, 200))) == (32, 50, 64, 96)
    placed.observe(40)  # floored to 32: seen once, not yet popular
    assert placed.stops(request(list(range(20)))) == ()
    placed.observe(47)
    placed.observe(70)
    assert placed.stops(request(list(range(40)))) == (32,)  # 32 seen twice; 64 once
    junction = CheckpointPlanner(CheckpointPlacement.JUNCTION, alignment_tokens=16)
    junction.observe(40)
    junction.observe(40)
    assert junction.stops(request(list(range(100)), hints=(50,))) == (50,)  # hints only


def run_alone(scheduler: Scheduler[SimRequest], item: SimRequest) -> None:
    scheduler.add(item)
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        for work in out.work:
            if work.request.num_computed_tokens + work.num_tokens >= work.request.num_tokens:
                work.request.status = RequestStatus.FINISHED
        scheduler.finish_step(out.work)


def test_a_hint_places_a_state_checkpoint_a_sibling_hits() -> None:
    # full + Mamba, blocks of 16, one 64-token prefill step: the state is checkpointed at 48 (the last
    # boundary before the end) only. A sibling sharing 40 tokens hits nothing, unless a hint at 40
    # (floored to 32) cut the step there.
    hits = {}
    for hints in ((), (40,)):
        groups = [make_group(kind="full"), make_group(kind="mamba")]
        manager = KVCacheManager(make_config(groups=groups, num_blocks=64), max_model_len=1024)
        scheduler: Scheduler[SimRequest] = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4,
                                                     align_tokens=16)
        first = request(list(range(1, 65)), hints=hints)
        run_alone(scheduler, SimRequest(kv=first, arrival_seq=0, prompt_len=64, output_tokens=1))
        sibling = request([*range(1, 41), *[900] * 20], name="b")
        hits[hints] = manager.lookup(sibling).num_tokens
    assert hits == {(): 0, (40,): 32}


def test_a_finished_sequence_keeps_its_window_tail() -> None:
    # full + sliding window (W 17: 1 block of 16 before a hit), value policy, 8 usable blocks. A 64-token
    # request ends with 4 full blocks and its last window block held; its earlier window blocks left the
    # window while it ran (unanchored: LOW). At free, the tail before 64 is an anchor.
    from hybridkv.kvcache.free_queue import EvictionPolicyName

    groups = [make_group(kind="full"), make_group(kind="sliding_window", window_tokens=17)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=9), max_model_len=256,
                             eviction=EvictionPolicyName.VALUE)
    a = request(list(range(1, 66)))
    manager.begin_step()
    for start in range(0, 64, 16):
        assert manager.allocate(a, 16, hit=manager.lookup(a) if start == 0 else None) is not None
        a.num_computed_tokens = start + 16
    full = manager.block_ids(a.request_id)[0]
    tail = manager.block_ids(a.request_id)[1][3]
    manager.free(a)
    policy = manager._pool._policy  # (the eviction order is what is tested)
    assert isinstance(policy, ValuePolicy)
    assert policy.value_of(tail) is BlockValue.ANCHOR
    order = policy.ordered()
    window = [b for b in order if b not in full and b != tail]  # the blocks that left the window: LOW
    assert len(window) == 3 and order[:3] == window  # evicted first, whatever their age
    assert sorted(order[3:]) == sorted([*full, tail])  # the hit at 64 outlives them
    b = request([*range(1, 65), 5, 6], name="b")
    assert manager.lookup(b).num_tokens == 64


def test_a_prefix_whose_hits_end_at_the_same_place_twice_becomes_hot() -> None:
    # one full-attention group, blocks of 16, value policy. A computes a 32-token prefix P plus 2
    # tokens. B and C each add their own tokens after P: both hits end at 32. B's is the first hit
    # ending there (P stays FULL); C's is the second (HOT_HITS = 2): P's two blocks become HOT. D
    # extends C's whole prompt: its hit ends at 48, where no hit ended before: nothing new is HOT.
    from hybridkv.kvcache.checkpoints import HOT_HITS
    from hybridkv.kvcache.free_queue import EvictionPolicyName

    assert HOT_HITS == 2
    manager = KVCacheManager(make_config(num_blocks=32), max_model_len=256, eviction=EvictionPolicyName.VALUE)
    policy = manager._pool._policy  # (the classes are what is tested)
    assert isinstance(policy, ValuePolicy)
    prefix = list(range(1, 33))

    def run(name: str, tokens: list[int]) -> tuple[int, list[int]]:
        kv = request(tokens, name=name)
        manager.begin_step()
        hit = manager.lookup(kv)
        assert manager.allocate(kv, len(tokens) - hit.num_tokens, hit=hit) is not None
        kv.num_computed_tokens = len(tokens)
        blocks = list(manager.block_ids(kv.request_id)[0])
        manager.free(kv)
        return hit.num_tokens, blocks

    assert run("a", [*prefix, 7, 7])[0] == 0
    hit, blocks = run("b", [*prefix, 8, 8])
    assert hit == 32 and [policy.value_of(b) for b in blocks[:2]] == [BlockValue.FULL] * 2
    hit, blocks = run("c", [*prefix, *range(100, 120)])
    assert hit == 32 and [policy.value_of(b) for b in blocks[:2]] == [BlockValue.HOT] * 2
    hit, blocks = run("d", [*prefix, *range(100, 120), 5])
    assert hit == 48 and [policy.value_of(b) for b in blocks[:3]] == [BlockValue.HOT] * 2 + [BlockValue.FULL]
