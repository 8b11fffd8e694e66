"""`running_state`: the blocks a request holds in align mode, and the copies FIXED asks for, by hand.

Block size 4, full attention + one state group, 64 blocks. Request a: prompt range(10) in chunks of
8 + 2 (the first ends on the boundary at 8: a checkpoint there). MOVING (vLLM's) then holds the state
it reads (entry 1, after 8 tokens) and the one it writes (entry 2); FIXED one running block in its
last entry. A sibling b = range(10) + [99] hits 8 tokens in both; FIXED copies the checkpoint into
b's running block before b's forward.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.manager import (
    BlockCopy,
    DecodeCheckpoints,
    EvictionPolicyName,
    KVCacheManager,
    MambaCacheMode,
    PrefixCaching,
    RunningState,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group, make_request

GROUPS = [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)]
K = 3  # the multi-page layout below: a state spans 3 page groups
PAGED = [make_group(kind="full", block_size=4),
         *(dataclasses.replace(make_group(kind="mamba", block_size=4), state_page=s, state_pages=K) for s in range(K))]


def manager(running: RunningState, *, groups: list = GROUPS, num_blocks: int = 64,  # type: ignore[type-arg]
            **options: object) -> KVCacheManager:
    return KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=64,
                          options=CacheOptions(running_state=running, **options))  # type: ignore[arg-type]


def step(m: KVCacheManager, request: KVRequest, num_new: int) -> tuple[tuple[BlockCopy, ...], tuple[BlockCopy, ...]]:
    """One scheduled step of a running request: (copies before, copies after the forward)."""
    m.begin_step()
    assert m.allocate(request, num_new) is not None
    copies = m.take_pending_copies(), m.take_checkpoint_copies()
    request.num_computed_tokens += num_new
    m.check_integrity()
    return copies


def held(m: KVCacheManager, request_id: str) -> list[int]:
    """Real blocks the request holds, per group."""
    return [sum(1 for b in table if b) for table in m.block_ids(request_id)]  # type: ignore[arg-type]


def test_moving_holds_two_states_after_a_boundary_fixed_one() -> None:
    for running, state_blocks in ((RunningState.MOVING, 2), (RunningState.FIXED, 1)):
        m = manager(running)
        a = make_request(request_id="a", token_ids=range(10))
        m.begin_step()
        assert m.lookup(a).num_tokens == 0
        before, after = step(m, a, 8)
        assert before == () and held(m, "a") == [2, 1]
        # FIXED: the checkpoint at 8 is copied out of the running block into a block a does not hold
        running_block = m.block_ids("a")[1][1]
        if running is RunningState.FIXED:
            assert len(after) == 1 and (after[0].group_id, after[0].src_block_id) == (1, running_block)
            assert after[0].dst_block_id not in m.block_ids("a")[1]
        else:
            assert after == ()
        step(m, a, 2)
        assert held(m, "a") == [3, state_blocks], running
        table = m.block_ids("a")[1]
        if running is RunningState.FIXED:  # the running block moved (its id) to the last entry; not copied
            assert table == [0, 0, running_block]
            (state,) = m.state_steps("a", start_tokens=8, end_tokens=10)
            assert state.read is not None and state.read.block_id == running_block
            assert [w.block_id for w in state.writes] == [running_block]
        assert m.group_usage() == (3, state_blocks)


def test_a_hit_is_copied_into_the_running_block_before_the_forward() -> None:
    for running in RunningState:
        m = manager(running)
        a = make_request(request_id="a", token_ids=range(10))
        m.begin_step()
        m.lookup(a)
        _, after = step(m, a, 8)
        step(m, a, 2)
        b = make_request(request_id="b", token_ids=[*range(10), 99])
        m.begin_step()
        hit = m.lookup(b)
        assert hit.num_tokens == 8
        checkpoint = hit.blocks[1][1]
        assert m.allocate(b, 3, hit=hit) is not None
        copies = m.take_pending_copies()
        b_state = m.block_ids("b")[1]
        if running.one_state:  # (ADOPT copies too: it moves only with a value-aware eviction, below)
            assert checkpoint == after[0].dst_block_id
            assert b_state == [0, 0, b_state[2]] and b_state[2] != checkpoint
            assert copies == (BlockCopy(group_id=1, src_block_id=checkpoint, dst_block_id=b_state[2]),)  # type: ignore[arg-type]
            assert held(m, "b") == [3, 1] and m.group_usage() == (4, 2)  # a's running block and b's
        else:  # b reads the checkpoint in place and writes its own entry: 2 state blocks
            assert copies == () and b_state == [0, checkpoint, b_state[2]] and held(m, "b") == [3, 2]
        m.check_integrity()
        assert m.stats().block_copies == len(copies)


def test_multi_page_fixed_copies_every_page() -> None:
    """A state of K pages: K copies in, K out, and a request holds K pages (MOVING: 2K after a boundary)."""
    for running, pages in ((RunningState.MOVING, 2 * K), (RunningState.FIXED, K)):
        m = manager(running, groups=PAGED)
        a = make_request(request_id="a", token_ids=range(10))
        m.begin_step()
        m.lookup(a)
        _, after = step(m, a, 8)
        assert len(after) == (K if running is RunningState.FIXED else 0)
        assert sorted(c.group_id for c in after) == ([1, 2, 3] if after else [])
        step(m, a, 2)
        assert sum(held(m, "a")[1:]) == pages
        b = make_request(request_id="b", token_ids=[*range(10), 99])
        m.begin_step()
        hit = m.lookup(b)
        assert hit.num_tokens == 8 and m.allocate(b, 3, hit=hit) is not None
        copies = m.take_pending_copies()
        assert len(copies) == (K if running is RunningState.FIXED else 0)
        assert {c.src_block_id for c in copies} == ({c.dst_block_id for c in after} if copies else set())
        m.check_integrity()


def test_a_checkpoint_is_skipped_when_no_block_is_free() -> None:
    """3 usable blocks: an 8-token step takes 2 attention blocks and the running state, none is left for
    the checkpoint: skipped and counted, nothing preempted, no hit later."""
    m = manager(RunningState.FIXED, num_blocks=4)
    a = make_request(request_id="a", token_ids=range(9))
    m.begin_step()
    m.lookup(a)
    _, after = step(m, a, 8)
    assert after == () and m.stats().checkpoints_skipped == 1 and m.stats().checkpoint_copies == 0
    m.free(a)
    m.begin_step()
    assert m.lookup(make_request(request_id="b", token_ids=range(9))).num_tokens == 0
    m.check_integrity()


def test_freed_before_its_step_ran_leaves_no_checkpoint() -> None:
    """Allocated, then preempted in the same schedule: its asked-for checkpoint is dropped."""
    m = manager(RunningState.FIXED)
    a = make_request(request_id="a", token_ids=range(9))
    m.begin_step()
    m.lookup(a)
    assert m.allocate(a, 8) is not None
    m.free(a)
    assert m.take_pending_copies() == () and m.take_checkpoint_copies() == ()
    m.begin_step()
    assert m.lookup(make_request(request_id="b", token_ids=range(9))).num_tokens == 0
    m.check_integrity()


def test_decode_checkpoints_last_keeps_the_newest_copy_only() -> None:
    m = manager(RunningState.FIXED, decode_checkpoints=DecodeCheckpoints.LAST)
    a = make_request(request_id="a", token_ids=range(6))
    m.begin_step()
    m.lookup(a)
    step(m, a, 4)
    step(m, a, 2)
    for token in range(6, 14):  # decode to 14 computed tokens: checkpoints at 8 and 12
        a.token_ids.append(token)
        step(m, a, 1)
    m.free(a)
    hits = {}
    for length in (5, 10, 14):
        m.begin_step()
        hits[length] = m.lookup(make_request(request_id=f"p{length}", token_ids=[*range(length), 1000])).num_tokens
    assert hits == {5: 4, 10: 4, 14: 12}  # the prompt's checkpoint and the newest decode one (8 dropped)


def test_fixed_is_refused_with_all_mode_and_partial_hits_and_ignored_without_caching() -> None:
    with pytest.raises(ConfigError, match="mamba_cache_mode=all"):
        manager(RunningState.FIXED, mamba_cache_mode=MambaCacheMode.ALL)
    with pytest.raises(ConfigError, match="prefix_match_unit=2"):
        manager(RunningState.FIXED, prefix_match_unit=2,
                groups=[make_group(kind="full", block_size=2), make_group(kind="mamba", block_size=4)])
    m = manager(RunningState.FIXED, prefix_caching=PrefixCaching.OFF)  # one running state anyway
    a = make_request(request_id="a", token_ids=range(10))
    step(m, a, 8)
    step(m, a, 2)
    assert held(m, "a") == [3, 1]


def test_a_new_request_waits_for_room_for_its_first_checkpoint_while_others_run() -> None:
    """6 usable blocks, block size 4. a (prompt range(5)): step [0, 4) takes 1 attention block and its
    running state (its checkpoint at 4 is released, free and cached, at the end of the schedule). Next
    schedule a's step [4, 5) takes a second attention block: 3 held, 3 free. b (9 tokens) would take 2
    attention blocks and a running state (3, exactly what is free) plus 1 for its checkpoint at 8: it
    waits while a runs. Alone (a finished), b is admitted with room for it."""
    m = manager(RunningState.FIXED, num_blocks=7)
    a = make_request(request_id="a", token_ids=range(5))
    b = make_request(request_id="b", token_ids=[9, *range(8)])
    m.begin_step()
    m.lookup(a)
    _, after = step(m, a, 4)
    assert len(after) == 1 and m.usage() == pytest.approx(2 / 6)
    m.begin_step()
    assert m.allocate(a, 1) is not None and m.usage() == pytest.approx(3 / 6)
    hit = m.lookup(b)
    assert hit.num_tokens == 0 and m.allocate(b, 8, hit=hit) is None
    assert m.allocate(b, 7, hit=hit) is not None  # a chunk that ends inside a block takes no checkpoint
    m.free(b)
    m.free(a)
    m.begin_step()
    assert m.allocate(b, 8, hit=m.lookup(b)) is not None  # alone: 3 + 1 of 6
    assert len(m.take_checkpoint_copies()) == 1  # b's checkpoint at 8
    m.check_integrity()


def test_a_running_step_takes_back_a_checkpoint_instead_of_preempting() -> None:
    """5 usable blocks. a and c each hold 1 attention block and a running state (4 held). a's step [3, 4)
    ends on a boundary and takes the last free block for its checkpoint; c's step [3, 5) then needs a
    second attention block: the checkpoint is given back (uncached, counted as skipped), c is not refused."""
    m = manager(RunningState.FIXED, num_blocks=6)
    a = make_request(request_id="a", token_ids=range(6))
    c = make_request(request_id="c", token_ids=range(50, 56))
    m.begin_step()
    for request in (a, c):
        assert m.allocate(request, 3, hit=m.lookup(request)) is not None
        request.num_computed_tokens = 3
    assert m.take_checkpoint_copies() == ()
    m.begin_step()
    assert m.allocate(a, 1) is not None and m.usage() == 1.0  # a's checkpoint at 4 took the last block
    assert m.allocate(c, 2) is not None
    assert m.take_checkpoint_copies() == () and m.stats().checkpoints_skipped == 1
    m.check_integrity()
    m.begin_step()
    assert m.lookup(make_request(request_id="p", token_ids=[*range(4), 99])).num_tokens == 0


def test_a_step_whose_forward_failed_leaves_no_checkpoint() -> None:
    """The schedule handed out a's checkpoint copy at 8, then the forward failed and the engine freed
    a (its computed tokens not advanced): the checkpoint holds nothing and is dropped, like align
    mode's write block. b, the same prompt, then computes 8 tokens and caches its own checkpoint
    (FIXED: copied out; a stale one still cached would make b skip it and a later hit read garbage)."""
    for running in RunningState:
        m = manager(running)
        a = make_request(request_id="a", token_ids=range(9))
        m.begin_step()
        m.lookup(a)
        assert m.allocate(a, 8) is not None
        m.take_pending_copies()
        assert len(m.take_checkpoint_copies()) == (1 if running.one_state else 0)
        m.free(a)  # num_computed_tokens still 0
        b = make_request(request_id="b", token_ids=range(9))
        m.begin_step()
        assert m.lookup(b).num_tokens == 0
        assert m.allocate(b, 8) is not None
        m.take_pending_copies()
        assert len(m.take_checkpoint_copies()) == (1 if running.one_state else 0), running
        b.num_computed_tokens = 8
        m.free(b)
        m.begin_step()
        assert m.lookup(make_request(request_id="p", token_ids=[*range(8), 99])).num_tokens == 8
        m.check_integrity()


def test_value_eviction_keeps_copied_checkpoints_at_hit_points() -> None:
    """Value eviction, 9 usable blocks, all held by a (16 tokens, steps of 4, a hint at 4): 4 attention
    blocks, its running state, checkpoints copied out at 4, 8, 12, 16. Anchors (the hint at 4, the
    prompt's end at 12, the sequence's end at 16 when a is freed) are ANCHOR; 8 is at no hit point: LOW,
    evicted first though released after 4 (unmarked, 4 would go first). By hand, the order after a's
    running block (empty): 8 (LOW), then by release time 4, 12, 16 (marked when a is freed, released
    again then: unmarked it stays LOW and goes second), then the attention blocks."""
    from hybridkv.kvcache.options import EvictionPolicyName

    m = manager(RunningState.FIXED, num_blocks=10, eviction=EvictionPolicyName.VALUE)
    a = dataclasses.replace(make_request(request_id="a", token_ids=range(16)), cache_checkpoints=(4,))
    m.begin_step()
    m.lookup(a)
    for _ in range(4):
        step(m, a, 4)
    assert m.stats().checkpoint_copies == 4 and m.stats().checkpoints_skipped == 0
    m.free(a)

    def hits() -> list[int]:
        m.begin_step()
        return [m.lookup(make_request(request_id=f"p{n}", token_ids=[*range(n), 99, 99])).num_tokens
                for n in (4, 8, 12, 16)]

    assert hits() == [4, 8, 12, 16]
    for name in ("x", "y"):  # 3 new tokens each: an attention block and a running state, no checkpoint
        m.begin_step()
        assert m.allocate(make_request(request_id=name, token_ids=[1000, 1001, 1002]), 3) is not None
        m.check_integrity()
        if name == "x":  # a's running block and checkpoint 8
            assert hits() == [4, 4, 12, 16]
    assert hits() == [0, 0, 0, 16]  # then 4 and 12


def test_value_eviction_keeps_a_hit_checkpoint_copied_in() -> None:
    """Value eviction, 9 usable blocks. a (16 tokens, steps of 4, freed): checkpoints at 4, 8 (LOW: at no
    hit point of a), 12, 16 (ANCHOR). b (8 tokens + 3) hits 8: its hit point marks checkpoint 8, held
    until the copy in, ANCHOR when released after it (align mode's b holds it and marks it the same).
    b takes a's empty running block and evicts checkpoint 4 (LOW). c (7 new tokens) takes 3 blocks: by
    hand 12 and 16 (ANCHOR, released before a's attention blocks), then a's last attention block; 8
    stays (unmarked it is LOW and goes third)."""
    from hybridkv.kvcache.options import EvictionPolicyName

    m = manager(RunningState.FIXED, num_blocks=10, eviction=EvictionPolicyName.VALUE)
    a = make_request(request_id="a", token_ids=range(16))
    m.begin_step()
    m.lookup(a)
    for _ in range(4):
        step(m, a, 4)
    m.free(a)
    b = make_request(request_id="b", token_ids=[*range(8), 99, 99, 99])
    m.begin_step()
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and m.allocate(b, 3, hit=hit) is not None
    assert len(m.take_pending_copies()) == 1 and m.take_checkpoint_copies() == ()
    m.begin_step()
    assert m.allocate(make_request(request_id="c", token_ids=range(1000, 1007)), 7) is not None
    m.check_integrity()
    m.begin_step()
    assert [m.lookup(make_request(request_id=f"p{n}", token_ids=[*range(n), 99, 99])).num_tokens
            for n in (4, 8, 12, 16)] == [0, 8, 8, 8]


def finished_session(m: KVCacheManager) -> list[int]:
    """a: prompt range(6) in steps of 4 + 2 (a checkpoint at 4), then decodes to 8 computed tokens (a
    checkpoint at 8, where its next turn resumes) and finishes. Its tokens, for the next turn."""
    a = make_request(request_id="a", token_ids=range(6))
    m.begin_step()
    m.lookup(a)
    step(m, a, 4)
    step(m, a, 2)
    for token in (6, 7, 8):
        a.token_ids.append(token)
        step(m, a, 1)
    m.free(a)  # 8 computed (the last sampled token never is)
    return list(a.token_ids)


def test_adopt_moves_a_finished_requests_end_into_the_next_turns_running_state() -> None:
    """FIXED copies b's hit at a's end (8) into a fresh running block and keeps the checkpoint (c hits 8
    too); ADOPT (value eviction) makes the checkpoint b's running block: no copy, no fresh state block,
    and the checkpoint left the cache (c resumes at 4, a's prompt checkpoint)."""
    for running, copies, c_hit in ((RunningState.FIXED, 1, 8), (RunningState.ADOPT, 0, 4)):
        m = manager(running, eviction=EvictionPolicyName.VALUE)
        tokens = finished_session(m)
        b = make_request(request_id="b", token_ids=[*tokens, 99])
        m.begin_step()
        hit = m.lookup(b)
        assert hit.num_tokens == 8
        checkpoint = hit.blocks[1][-1]
        assert m.allocate(b, 2, hit=hit) is not None
        assert len(m.take_pending_copies()) == copies, running
        assert (m.block_ids("b")[1][-1] == checkpoint) is (running is RunningState.ADOPT)
        m.take_checkpoint_copies()
        m.begin_step()
        assert m.lookup(make_request(request_id="c", token_ids=[*tokens, 77])).num_tokens == c_hit, running
        assert m.stats().state_adoptions == (1 if running is RunningState.ADOPT else 0)
        m.check_integrity()


def test_adopt_copies_a_point_hit_before_or_one_another_waiting_request_hits() -> None:
    """ADOPT moves only a finished request's end that no hit used yet and no other waiting request will
    hit: a prompt checkpoint (4, not a sequence end) is copied; an end that b and c both wait on is
    copied into b (c then hits it); an end whose first hit already happened is copied."""
    m = manager(RunningState.ADOPT, eviction=EvictionPolicyName.VALUE)
    tokens = finished_session(m)
    m.begin_step()
    p = make_request(request_id="p", token_ids=[*range(4), 50, 51])
    hit = m.lookup(p)
    assert hit.num_tokens == 4 and m.allocate(p, 2, hit=hit) is not None
    assert len(m.take_pending_copies()) == 1  # a's prompt checkpoint: not where a request ended
    b = make_request(request_id="b", token_ids=[*tokens, 99])
    c = make_request(request_id="c", token_ids=[*tokens, 98])
    m.begin_step()
    m.protect_waiting(b, 8)
    m.protect_waiting(c, 8)
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and m.allocate(b, 2, hit=hit) is not None
    assert len(m.take_pending_copies()) == 1  # c waits on the same end: copied
    m.begin_step()
    hit = m.lookup(c)
    assert hit.num_tokens == 8 and m.allocate(c, 2, hit=hit) is not None
    assert len(m.take_pending_copies()) == 1  # b's hit ended there before: a recurring point
    assert m.stats().state_adoptions == 0
    m.check_integrity()


def test_adopt_with_lru_copies_as_fixed() -> None:
    """Without a value-aware eviction (no record of where requests ended) ADOPT is FIXED."""
    m = manager(RunningState.ADOPT)
    tokens = finished_session(m)
    b = make_request(request_id="b", token_ids=[*tokens, 99])
    m.begin_step()
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and m.allocate(b, 2, hit=hit) is not None
    assert len(m.take_pending_copies()) == 1
