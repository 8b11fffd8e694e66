"""Partial (sub-block) prefix hits: `prefix_match_unit` below a Mamba-align state block.

The vLLM cases (`test_vllm_*`) replay scenarios of vLLM's own partial-hit tests
(`tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py`: the owner's copy on continue, a
partial hit's copy, the full-attention tail kept after its block fills) on vLLM 0.32's installed
manager; the expected hits, block ids and copies are what that manager answered (both pools hand
out blocks in the same order, so even the ids agree). The hand-computed case derives every value
from the rules in docs/prefix_caching.md.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.errors import ConfigError, StaleHitError
from hybridkv.kvcache.manager import BlockCopy, CacheHit, KVCacheManager, NewBlocks
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group, make_request


def _manager(*, full: int, state: int, unit: int, num_blocks: int = 24) -> KVCacheManager:
    groups = [make_group(kind="full", block_size=full), make_group(kind="mamba", block_size=state)]
    return KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=8192,
        options=CacheOptions(prefix_match_unit=unit))


def _step(manager: KVCacheManager, request: KVRequest, num_new: int,
          hit: CacheHit | None = None) -> tuple[NewBlocks | None, tuple[BlockCopy, ...]]:
    """One scheduling step of one request: allocate, take the copies, advance the computed tokens."""
    new = manager.allocate(request, num_new, hit=hit)
    copies = manager.take_pending_copies()
    manager.check_integrity()
    if new is not None:
        request.num_computed_tokens += num_new + (hit.num_tokens if hit else 0)
    return new, copies


def _copy(group: int, src: int, dst: int) -> BlockCopy:
    return BlockCopy(group_id=group, src_block_id=src, dst_block_id=dst)  # type: ignore[arg-type]


def _producer(manager: KVCacheManager) -> KVRequest:
    """Prompt [0,0,1,1,2,2,3] (7 tokens, unit 2): its last unit boundary is 6, inside the second
    4-token state block. Chunks as the align scheduler cuts them: [0,4), [4,6) (the tail stop), [6,7)."""
    request = make_request(request_id="0", token_ids=[0, 0, 1, 1, 2, 2, 3])
    manager.begin_step()
    hit = manager.lookup(request)
    assert hit.num_tokens == 0
    _step(manager, request, 4, hit)
    return request


def test_vllm_owner_moves_its_partial_checkpoint_to_a_copy_on_continue() -> None:
    m = _manager(full=2, state=4, unit=2)
    r0 = _producer(m)
    m.begin_step()
    new, copies = _step(m, r0, 2)  # ends at the tail: state@6 in the running block 5, cached as a partial entry
    assert new == ((4,), (5,)) and copies == ()
    assert m.block_ids(r0.request_id) == ([1, 2, 4], [3, 5])
    m.begin_step()
    new, copies = _step(m, r0, 1)  # the owner keeps block 5 (and overwrites it); the entry moves to a copy
    assert new == ((6,), ())
    assert m.block_ids(r0.request_id) == ([1, 2, 4, 6], [0, 5])
    assert copies == (_copy(1, 5, 7),)
    r1 = make_request(request_id="1", token_ids=[0, 0, 1, 1, 2, 2, 9, 9])
    same_step = m.lookup(r1)  # the copy runs in this step: its state is usable from the next
    assert (same_step.num_tokens, same_step.blocks, same_step.deferred) == (6, ((1, 2, 4), (0, 7)), True)
    assert m.allocate(r1, 2, hit=same_step) is None


def test_vllm_partial_hit_takes_a_private_copy_of_the_state_block() -> None:
    m = _manager(full=2, state=4, unit=2)
    r0 = _producer(m)
    for num_new in (2, 1):
        m.begin_step()
        _step(m, r0, num_new)
    m.begin_step()
    r1 = make_request(request_id="1", token_ids=[0, 0, 1, 1, 2, 2, 9, 9])
    hit = m.lookup(r1)
    assert (hit.num_tokens, hit.blocks, hit.deferred) == (6, ((1, 2, 4), (0, 7)), False)
    new, copies = _step(m, r1, 2, hit)
    assert new == ((8,), (9,))  # the state copy (9) replaces the hit's block 7 in the table
    assert m.block_ids(r1.request_id) == ([1, 2, 4, 8], [0, 9])
    assert copies == (_copy(1, 7, 9),)  # attention blocks equal the unit: no partial block there
    step = m.state_steps(r1.request_id, start_tokens=6, end_tokens=8)[0]
    assert (step.read.num_tokens, step.read.block_id) == (6, 9) if step.read else False
    assert [(w.num_tokens, w.block_id) for w in step.writes] == [(8, 9)]


def test_vllm_partial_hit_inside_attention_blocks_copies_both_groups() -> None:
    m = _manager(full=4, state=4, unit=2)
    r0 = _producer(m)
    m.begin_step()
    assert _step(m, r0, 2) == (((3,), (4,)), ())
    m.begin_step()
    assert _step(m, r0, 1) == (((), ()), (_copy(1, 4, 5),))
    m.begin_step()
    r1 = make_request(request_id="1", token_ids=[0, 0, 1, 1, 2, 2, 9, 9, 9])
    hit = m.lookup(r1)  # attention: full block 1, then the partial entry at 6 inside block 3
    assert (hit.num_tokens, hit.blocks) == (6, ((1, 3), (0, 5)))
    new, copies = _step(m, r1, 2, hit)
    assert new == ((6,), (7,))
    assert m.block_ids(r1.request_id) == ([1, 6], [0, 7])
    assert copies == (_copy(0, 3, 6), _copy(1, 5, 7))  # group by group
    # r0 decodes a token: its attention block 3 is full now (cached under its full hash) and its
    # partial entry at 6 stays reachable
    r0.token_ids.append(5)
    assert _step(m, r0, 1) == (((), ()), ())
    m.free(r1)
    m.begin_step()
    r2 = make_request(request_id="2", token_ids=[0, 0, 1, 1, 2, 2, 8, 8, 8])
    again = m.lookup(r2)
    assert (again.num_tokens, again.blocks) == (6, ((1, 3), (0, 5)))
    m.check_integrity()


def test_hand_computed_partial_hit_and_copies() -> None:
    """Blocks of 64 tokens, unit 16. r0 = tokens 0..99: its last unit boundary is 96 (= 99 // 16 * 16),
    inside block 1 ([64, 128)). r1 shares the first 98 tokens: the longest cached prefix every group
    serves is 96 (attention: block 0 full + the partial entry at 96 in block 1; state: the partial
    checkpoint at 96). Every block id follows from the pool handing out 1, 2, 3, ... in order."""
    m = _manager(full=64, state=64, unit=16, num_blocks=32)
    r0 = make_request(request_id="r0", token_ids=list(range(100)))
    m.begin_step()
    assert _step(m, r0, 64, m.lookup(r0)) == (((1,), (2,)), ())  # state@64 -> block 2, cached (full hash)
    m.begin_step()
    assert _step(m, r0, 32) == (((3,), (4,)), ())  # state@96 -> block 4, partial entry; attention block 3 too
    m.begin_step()
    # [96, 100): block 4 is overwritten, so its partial entry moves to a copy (block 5) first
    assert _step(m, r0, 4) == (((), ()), (_copy(1, 4, 5),))
    m.begin_step()
    r1 = make_request(request_id="r1", token_ids=[*range(98), 500, 501, 502])
    hit = m.lookup(r1)
    assert (hit.num_tokens, hit.blocks) == (96, ((1, 3), (0, 5)))
    new, copies = _step(m, r1, r1.num_tokens - 96, hit)
    assert new == ((6,), (7,))
    assert copies == (_copy(0, 3, 6), _copy(1, 5, 7))
    assert m.block_ids(r1.request_id) == ([1, 6], [0, 7])
    state = m.state_steps(r1.request_id, start_tokens=96, end_tokens=101)[0]
    assert state.read is not None and (state.read.num_tokens, state.read.block_id) == (96, 7)
    assert [(w.num_tokens, w.block_id) for w in state.writes] == [(101, 7)]
    assert m.stats().block_copies == 3
    m.free(r0)
    m.free(r1)
    m.check_integrity()


def test_copies_keep_their_blocks_until_taken() -> None:
    """A request freed in the step that asked for its copy: the copy's blocks stay allocated until
    `take_pending_copies` (the engine runs the copy before the forward), then return to the pool."""
    m = _manager(full=64, state=64, unit=16, num_blocks=32)
    r0 = make_request(request_id="r0", token_ids=list(range(100)))
    m.begin_step()
    _step(m, r0, 64, m.lookup(r0))
    m.begin_step()
    _step(m, r0, 32)
    m.begin_step()
    _step(m, r0, 4)
    m.free(r0)
    m.begin_step()
    r1 = make_request(request_id="r1", token_ids=[*range(98), 7, 7])
    hit = m.lookup(r1)
    assert m.allocate(r1, r1.num_tokens - hit.num_tokens, hit=hit) is not None
    m.free(r1)
    m.check_integrity()  # (the retained ends count as held)
    held = m.usage()
    copies = m.take_pending_copies()
    assert len(copies) == 2 and m.usage() < held
    m.check_integrity()
    assert m.usage() == 0.0


def _serve_100_tokens(m: KVCacheManager) -> None:
    """A 100-token prompt in steps of 64, 32 and 4 tokens, then freed; a new step begins."""
    r0 = make_request(request_id="r0", token_ids=list(range(100)))
    m.begin_step()
    _step(m, r0, 64, m.lookup(r0))
    for num_new in (32, 4):
        m.begin_step()
        _step(m, r0, num_new)
    m.free(r0)
    m.begin_step()


@pytest.mark.parametrize("retention", [None, 0, 128])
def test_partial_hits_with_a_retention_interval(retention: int | None) -> None:
    """A 100-token prompt (steps 64, 32, 4): its replay boundary 96 is a partial tail, kept with any
    retention (0 keeps states only there); a sibling sharing 98 tokens hits 96 either way."""
    groups = [make_group(kind="full", block_size=64), make_group(kind="mamba", block_size=64)]
    m = KVCacheManager(make_config(groups=groups, num_blocks=32), max_model_len=8192,
        options=CacheOptions(prefix_match_unit=16, prefix_cache_retention_interval=retention))
    assert m.match_unit.partial_hits
    _serve_100_tokens(m)
    assert m.lookup(make_request(request_id="r1", token_ids=[*range(98), 7, 7])).num_tokens == 96
    # the state block itself keeps hits on the block: no partial hits
    same = KVCacheManager(make_config(groups=groups), max_model_len=256,
        options=CacheOptions(prefix_match_unit=64, prefix_cache_retention_interval=retention))
    assert not same.match_unit.partial_hits


def test_a_partial_hit_gone_stale_is_refused() -> None:
    """The hit's partial blocks are verified like whole ones: after a reset the kept hit is stale."""
    m = _manager(full=64, state=64, unit=16, num_blocks=32)
    _serve_100_tokens(m)
    r1 = make_request(request_id="r1", token_ids=[*range(98), 7, 7])
    hit = m.lookup(r1)
    assert hit.num_tokens == 96
    assert m.reset_prefix_cache()
    with pytest.raises(StaleHitError, match="was evicted after lookup"):
        m.allocate(r1, 4, hit=hit)
    m.check_integrity()


def test_partial_hits_in_the_multi_page_state_layout_are_refused() -> None:
    state = [dataclasses.replace(make_group(kind="mamba", block_size=64), state_page=s, state_pages=2) for s in (0, 1)]
    config = make_config(groups=[make_group(kind="full", block_size=64), *state])
    with pytest.raises(ConfigError, match=r"prefix_match_unit=16 makes hits land inside the 64-token blocks .* "
                                          r"multi_page state layout"):
        KVCacheManager(config, max_model_len=256, options=CacheOptions(prefix_match_unit=16))
