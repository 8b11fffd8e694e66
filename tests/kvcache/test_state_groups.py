"""State groups (Mamba, Gated DeltaNet) by hand: the same-step rule, ALIGN and ALL mode
checkpoints, `state_steps`, and the planner's per-request need against what the manager holds."""

from __future__ import annotations

import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import (
    AllocationError,
    KVCacheManager,
    MambaCacheMode,
    PrefixCaching,
    StateCheckpoint,
    StateStep,
    UnknownRequestError,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheGroupSpec
from tests.factories import make_config, make_group, make_request

FULL4 = make_group(kind="full", block_size=4)
MAMBA4 = make_group(kind="mamba", block_size=4)
ALIGN, ALL = MambaCacheMode.ALIGN, MambaCacheMode.ALL


def manager(mode: MambaCacheMode, groups: list[KVCacheGroupSpec] | None = None, *, num_blocks: int = 64,
            caching: PrefixCaching = PrefixCaching.ON) -> KVCacheManager:
    return KVCacheManager(make_config(groups=groups or [FULL4, MAMBA4], num_blocks=num_blocks), max_model_len=1024,
        options=CacheOptions(prefix_caching=caching, mamba_cache_mode=mode))


def run_step(m: KVCacheManager, request: KVRequest, num_new: int) -> None:
    """Allocate one step of `num_new` tokens (no hit) and advance the request."""
    assert m.allocate(request, num_new) is not None
    request.num_computed_tokens += num_new
    m.check_integrity()


def cp(num_tokens: int, block_id: int) -> StateCheckpoint:
    return StateCheckpoint(num_tokens=num_tokens, block_id=block_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [ALIGN, ALL])
def test_a_checkpoint_cached_in_this_step_is_hit_only_from_the_next_step(mode: MambaCacheMode) -> None:
    m = manager(mode)
    m.begin_step()
    run_step(m, make_request(request_id="a", token_ids=range(8)), 8)  # checkpoint after 8 tokens, not run yet
    b = make_request(request_id="b", token_ids=range(10))
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and hit.deferred
    usage = m.group_usage()
    assert m.allocate(b, 2, hit=hit) is None  # refused: nothing changed
    assert m.group_usage() == usage
    m.check_integrity()
    m.begin_step()  # the step that wrote the checkpoint has run
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and not hit.deferred
    assert m.allocate(b, 2, hit=hit) is not None
    m.check_integrity()


def test_attention_groups_hit_blocks_cached_in_the_same_step() -> None:
    m = manager(ALIGN, [FULL4, make_group(kind="sliding", block_size=4, window_tokens=5)])
    m.begin_step()
    run_step(m, make_request(request_id="a", token_ids=range(8)), 8)
    b = make_request(request_id="b", token_ids=range(10))
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and not hit.deferred
    assert m.allocate(b, 2, hit=hit) is not None


def test_the_rule_is_by_content_hash_as_in_vllm() -> None:
    """A copy of a checkpoint cached in this step defers a hit on an older copy too (vLLM keeps
    the hashes cached in the step, not the blocks)."""
    m = manager(ALIGN)
    m.begin_step()
    run_step(m, make_request(request_id="a", token_ids=range(8)), 8)
    m.begin_step()
    run_step(m, make_request(request_id="c", token_ids=range(8)), 8)  # same 8 tokens again, no lookup
    hit = m.lookup(make_request(request_id="b", token_ids=range(10)))
    assert hit.num_tokens == 8 and hit.blocks[1] == (0, 3) and hit.deferred  # a's copy, from the last step


def test_align_keeps_a_checkpoint_only_where_a_step_ends_on_a_boundary() -> None:
    m = manager(ALIGN)
    a = make_request(request_id="a", token_ids=range(10))
    run_step(m, a, 10)
    m.begin_step()
    assert m.lookup(make_request(request_id="b", token_ids=range(10))).num_tokens == 0
    assert m.block_ids(a.request_id)[1] == [0, 0, 4]  # one block: the state after 10 tokens


def test_all_keeps_a_checkpoint_at_every_boundary_a_step_crosses() -> None:
    m = manager(ALL)
    a = make_request(request_id="a", token_ids=range(10))
    run_step(m, a, 10)
    assert m.block_ids(a.request_id) == ([1, 2, 3], [4, 5, 6])  # states after 4, 8 and 10 tokens
    m.begin_step()
    assert m.lookup(make_request(request_id="b", token_ids=range(10))).num_tokens == 8
    hit = m.lookup(make_request(request_id="c", token_ids=[*range(6), 99, 99]))
    assert hit.num_tokens == 4 and hit.blocks == ((1,), (4,))
    a.token_ids.append(7)
    run_step(m, a, 1)  # the next step releases the states it no longer reads (they stay cached)
    assert m.block_ids(a.request_id)[1] == [0, 0, 6]
    assert m.lookup(make_request(request_id="b", token_ids=range(10))).num_tokens == 8


def test_state_steps_align() -> None:
    m = manager(ALIGN)
    a = make_request(request_id="a", token_ids=range(10))
    assert m.allocate(a, 8) is not None
    assert m.state_steps(a.request_id, start_tokens=0, end_tokens=8) == (
        StateStep(group_id=1, read=None, writes=(cp(8, 3),)),)  # type: ignore[arg-type]
    a.num_computed_tokens = 8
    assert m.allocate(a, 2) is not None
    assert m.block_ids(a.request_id)[1] == [0, 3, 5]  # full took block 4 first
    assert m.state_steps(a.request_id, start_tokens=8, end_tokens=10) == (
        StateStep(group_id=1, read=cp(8, 3), writes=(cp(10, 5),)),)  # type: ignore[arg-type]
    a.num_computed_tokens = 10
    a.token_ids.append(5)
    assert m.allocate(a, 1) is not None  # decode inside the block: in place
    assert m.state_steps(a.request_id, start_tokens=10, end_tokens=11) == (
        StateStep(group_id=1, read=cp(10, 5), writes=(cp(11, 5),)),)  # type: ignore[arg-type]


def test_state_steps_name_each_of_two_state_groups_that_share_one_rule() -> None:
    """Two Mamba groups (1 and 2) after a full group: one manager serves both, each keeps its own
    block. Prefill 8 (B=4): the pop hands full 1, 2, then group 1 block 3, group 2 block 4."""
    m = manager(ALIGN, [FULL4, MAMBA4, MAMBA4])
    a = make_request(request_id="a", token_ids=range(8))
    assert m.allocate(a, 8) is not None
    assert m.block_ids(a.request_id) == ([1, 2], [0, 3], [0, 4])
    assert m.state_steps(a.request_id, start_tokens=0, end_tokens=8) == (
        StateStep(group_id=1, read=None, writes=(cp(8, 3),)),  # type: ignore[arg-type]
        StateStep(group_id=2, read=None, writes=(cp(8, 4),)))  # type: ignore[arg-type]
    m.check_integrity()


def test_state_steps_all_and_restore_from_a_hit() -> None:
    m = manager(ALL)
    a = make_request(request_id="a", token_ids=range(10))
    assert m.allocate(a, 10) is not None
    assert m.state_steps(a.request_id, start_tokens=0, end_tokens=10) == (
        StateStep(group_id=1, read=None, writes=(cp(4, 4), cp(8, 5), cp(10, 6))),)  # type: ignore[arg-type]
    a.num_computed_tokens = 10
    m.begin_step()
    b = make_request(request_id="b", token_ids=[*range(8), 50, 51, 52, 53, 54])
    hit = m.lookup(b)
    assert hit.num_tokens == 8 and hit.blocks[1] == (0, 5)
    assert m.allocate(b, 5, hit=hit) is not None
    assert m.block_ids(b.request_id)[1] == [0, 5, 9, 10]
    assert m.state_steps(b.request_id, start_tokens=8, end_tokens=13) == (  # restore from a's block 5
        StateStep(group_id=1, read=cp(8, 5), writes=(cp(12, 9), cp(13, 10))),)  # type: ignore[arg-type]


def test_state_steps_without_prefix_caching_use_one_block() -> None:
    m = manager(ALL, caching=PrefixCaching.OFF)
    a = make_request(request_id="a", token_ids=range(10))
    run_step(m, a, 10)
    a.token_ids.append(1)
    assert m.allocate(a, 1) is not None
    assert m.state_steps(a.request_id, start_tokens=10, end_tokens=11) == (
        StateStep(group_id=1, read=cp(10, 4), writes=(cp(11, 4),)),)  # type: ignore[arg-type]


def test_state_steps_errors_and_attention_only_models() -> None:
    m = manager(ALL)
    with pytest.raises(UnknownRequestError, match="holds no blocks"):
        m.state_steps(RequestId("x"), start_tokens=0, end_tokens=1)
    a = make_request(request_id="a", token_ids=range(10))
    run_step(m, a, 10)
    with pytest.raises(AllocationError, match=r"expected 0 <= start < end <= 10"):
        m.state_steps(a.request_id, start_tokens=4, end_tokens=12)
    a.token_ids += [1, 2, 3]
    run_step(m, a, 3)  # entries 0 and 1 are released
    with pytest.raises(AllocationError, match="no longer holds its state after 4 tokens"):
        m.state_steps(a.request_id, start_tokens=4, end_tokens=13)
    attention = manager(ALIGN, [FULL4])
    run_step(attention, b := make_request(request_id="b", token_ids=range(5)), 5)
    assert attention.state_steps(b.request_id, start_tokens=0, end_tokens=5) == ()


def test_mamba_cache_mode_must_be_the_enum() -> None:
    with pytest.raises(ConfigError, match="mamba_cache_mode must be one of"):
        KVCacheManager(make_config(groups=[FULL4, MAMBA4]), max_model_len=64,
            options=CacheOptions(mamba_cache_mode="all"))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [ALIGN, ALL])
@pytest.mark.parametrize("budget", [4, 8, 10, 16, 64])
def test_planner_need_is_what_the_manager_holds(mode: MambaCacheMode, budget: int) -> None:
    """A 64-token request prefilled in chunks of at most `budget` tokens (ALIGN: cut to block
    boundaries, as the engine does), then decoded to the end: the most state blocks it holds
    at once is the planner's `blocks_needed`."""
    max_len = 64
    need = MAMBA4.spec.blocks_needed(block_size=4, max_model_len=max_len, max_num_batched_tokens=budget,
                                     mamba_cache_mode=mode)
    m = KVCacheManager(make_config(groups=[FULL4, MAMBA4], num_blocks=64), max_model_len=max_len,
        options=CacheOptions(mamba_cache_mode=mode))
    for offset in (0, 1, 3):  # a decode step first shifts where the chunks start
        request = make_request(request_id=f"r{offset}", token_ids=range(max_len - 1))
        peak = 0
        if offset:
            run_step(m, request, offset)
        while request.num_computed_tokens < max_len:
            start = request.num_computed_tokens
            if start >= request.num_tokens:
                request.token_ids.append(1)
            chunk = min(budget, request.num_tokens - start)
            if mode is ALIGN and start + chunk < request.num_tokens:
                chunk = max(1, (start + chunk) // 4 * 4 - start)
            run_step(m, request, chunk)
            peak = max(peak, m.group_usage()[1])
        m.free(request)
        assert peak <= need, (offset, peak, need)
        if offset == 0 and (budget < max_len or mode is ALL):  # a one-step prompt never holds 2 in ALIGN
            assert peak == need, (offset, peak, need)


def test_plan_sizes_state_groups_by_mode() -> None:
    from hybridkv.plan.planner import GIB, PlannerOptions, plan
    from tests.plan.test_planner import make_model, pattern

    model = make_model(layers=pattern("MMMF"))
    align = plan(model, PlannerOptions(memory_bytes=GIB, max_model_len=4096, max_num_batched_tokens=2048))
    every = plan(model, PlannerOptions(memory_bytes=GIB, max_model_len=4096, max_num_batched_tokens=2048,
                                       mamba_cache_mode=ALL))
    block = align.config.attention_block_size
    state_groups = [i for i, g in enumerate(align.config.groups) if g.kind.value == "mamba"]
    assert state_groups and all(align.blocks_per_request[i] == 2 for i in state_groups)
    assert all(every.blocks_per_request[i] == -(-2048 // block) + 1 for i in state_groups)
    assert every.max_concurrency < align.max_concurrency
    with pytest.raises(ConfigError, match="mamba_cache_mode must be one of"):
        PlannerOptions(memory_bytes=GIB, max_model_len=4096, mamba_cache_mode="all")  # type: ignore[arg-type]
