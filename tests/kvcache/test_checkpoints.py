"""Checkpoint placement: stops computed by hand, a hint that turns into a state hit, and the anchors
a value-aware policy keeps (a finished sequence's window tail outlives the unanchored ones)."""

from __future__ import annotations

from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions, CheckpointPlacement
from hybridkv.kvcache.policies.placement import CheckpointPlanner
from hybridkv.kvcache.policies.value import BlockValue
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.scheduler import RequestStatus, Scheduler
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
    from hybridkv.kvcache.options import EvictionPolicyName

    groups = [make_group(kind="full"), make_group(kind="sliding_window", window_tokens=17)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=9), max_model_len=256,
        options=CacheOptions(eviction=EvictionPolicyName.VALUE))
    a = request(list(range(1, 66)))
    manager.begin_step()
    for start in range(0, 64, 16):
        assert manager.allocate(a, 16, hit=manager.lookup(a) if start == 0 else None) is not None
        a.num_computed_tokens = start + 16
    full = manager.block_ids(a.request_id)[0]
    tail = manager.block_ids(a.request_id)[1][3]
    manager.free(a)
    policy = manager.policies  # (the eviction order is what is tested)
    assert policy.value_of(tail) is BlockValue.ANCHOR
    order = policy.eviction_order()
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
    from hybridkv.kvcache.options import EvictionPolicyName
    from hybridkv.kvcache.policies.anchors import HOT_HITS

    assert HOT_HITS == 2
    manager = KVCacheManager(make_config(num_blocks=32), max_model_len=256,
        options=CacheOptions(eviction=EvictionPolicyName.VALUE))
    policy = manager.policies  # (the classes are what is tested)
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


def test_reuse_rates_by_hand() -> None:
    from hybridkv.kvcache.policies.anchors import AnchorKind, ReuseRates

    rates = ReuseRates()
    end, hint = AnchorKind.SEQUENCE_END, AnchorKind.HINT
    assert rates.share({end}) == 1.0  # nothing seen: every anchor keeps its whole bonus
    rates.made_at(BlockHash(b"k1"), {end})
    rates.made_at(BlockHash(b"k2"), {end})
    rates.made_at(BlockHash(b"k1"), {end})  # the same position again: not a new anchor
    rates.made_at(BlockHash(b"k3"), {hint})
    rates.hit_at(BlockHash(b"k3"))
    rates.hit_at(BlockHash(b"k3"))  # a position counts one hit
    rates.hit_at(BlockHash(b"nowhere"))
    assert (rates.made[end], rates.hit[end], rates.made[hint], rates.hit[hint]) == (2, 0, 1, 1)
    assert rates.rate(end) == 1 / 4 and rates.rate(hint) == 2 / 3  # (hit + 1) / (made + 2)
    # share: rate / (FULL_SHARE_RATE x the best rate), at most 1
    assert rates.share({end}) == (1 / 4) / (0.5 * 2 / 3)
    assert rates.share({end, hint}) == 1.0  # the best of its kinds
    for key in (BlockHash(b"k4"), BlockHash(b"k5"), BlockHash(b"k6")):
        rates.made_at(key, {end})
    assert rates.share({end}) == (1 / 7) / (0.5 * 2 / 3)
    rates.made_at(BlockHash(b"k1"), {hint})  # a second kind at a known position counts for that kind
    assert rates.made[hint] == 2 and rates.made[end] == 5


def test_sequence_ends_no_request_extends_leave_before_the_system_prompt() -> None:
    # full + Mamba (FIXED running state), blocks of 4, value policy. Three unrelated requests x y z, then
    # two that share a hinted 8-token system prompt, each with its own question; no request extends
    # another's answer. a and b anchor the hint (2 made) and b hits it (1 hit): HINT rate (1 + 1) /
    # (2 + 2) = 1/2, the best. No sequence end is hit: rate 1/7 when b's (the fifth) is marked, so b's
    # end gets (1/7) / (FULL_SHARE_RATE 0.5 x 1/2) = 4/7 of the ANCHOR bonus and is evicted before the
    # system prompt's checkpoint, though released after it (with the whole bonus each, the two would
    # leave in release order: the system prompt first).
    from hybridkv.kvcache.manager import RunningState
    from hybridkv.kvcache.options import EvictionPolicyName
    from hybridkv.kvcache.policies.anchors import AnchorKind
    from hybridkv.kvcache.running_state import FixedStateManager

    groups = [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=64), max_model_len=256,
        options=CacheOptions(eviction=EvictionPolicyName.VALUE, running_state=RunningState.FIXED))
    scheduler: Scheduler[SimRequest] = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4, align_tokens=4)
    for n, name in enumerate("xyz"):
        kv = request(list(range(500 + 20 * n, 514 + 20 * n)), name=name)
        run_alone(scheduler, SimRequest(kv=kv, arrival_seq=n, prompt_len=14, output_tokens=3))
    system = list(range(1, 9))
    kvs = []
    for n, name in enumerate("ab"):
        kv = request([*system, *range(100 + 10 * n, 106 + 10 * n)], hints=(8,), name=name)
        run_alone(scheduler, SimRequest(kv=kv, arrival_seq=3 + n, prompt_len=14, output_tokens=3))
        kvs.append(kv)
    assert manager.policies.anchors is not None
    rates = manager.policies.anchors.rates  # (the learned rates and the eviction order are what is tested)
    assert (rates.made[AnchorKind.HINT], rates.hit[AnchorKind.HINT]) == (2, 1)
    assert (rates.made[AnchorKind.SEQUENCE_END], rates.hit[AnchorKind.SEQUENCE_END]) == (5, 0)
    # and what the stats report: b's hit point (8) and the five prompt ends (13, floored to 12) are
    # anchors no hit ended at (rates 1/3 and 1/7, below the hint's)
    assert manager.stats().anchor_reuse == {"hit": (1, 0), "hint": (2, 1), "prompt_end": (5, 0),
                                            "sequence_end": (5, 0)}
    state = next(m for m in manager.type_managers if isinstance(m, FixedStateManager))
    policy = manager.policies

    def checkpoint(kv: KVRequest, tokens: int) -> int:
        found = state.view.blocks_if_held([kv.block_hashes[4][tokens // 4 - 1]])
        assert found is not None, f"no checkpoint at {tokens}"
        return found[0][0]

    prompt_checkpoint = checkpoint(kvs[0], 8)
    end_b = checkpoint(kvs[1], kvs[1].num_computed_tokens // 4 * 4)
    assert policy.value_of(prompt_checkpoint) is BlockValue.ANCHOR and policy.value_of(end_b) is BlockValue.ANCHOR
    assert policy.anchor_share(end_b) == (1 / 7) / (0.5 * 1 / 2) and policy.anchor_share(prompt_checkpoint) == 1
    order = policy.eviction_order()
    assert order.index(end_b) < order.index(prompt_checkpoint)
