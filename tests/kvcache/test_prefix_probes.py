"""`PrefixProbes`: a waiting request's probe, resumed where its last one stopped, against the full scan
(`find_hit_tokens`, which reads every key again) after every step of a pool that evicts and caches anew."""

from __future__ import annotations

import random

import pytest

from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions, MambaCacheMode
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group, make_request, run_and_free


def scan(manager: KVCacheManager, request: KVRequest) -> int:
    """The hit of `request` by the full scan (no memo): the reference."""
    full = manager.type_managers[0]
    hashes = request.block_hashes
    return full.find_hit_tokens(full.view, hashes, min(request.num_tokens - 1, manager.max_model_len))[1]


@pytest.mark.parametrize("seed", range(4))
def test_resumed_probes_equal_the_full_scan(seed: int) -> None:
    rng = random.Random(seed)
    groups = [make_group(kind="full", block_size=4)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=24), max_model_len=256, options=CacheOptions())
    roots = [[rng.randrange(50) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    waiting = [make_request(request_id=f"w{i}", token_ids=rng.choice(roots) + [rng.randrange(50)] * 9)
               for i in range(6)]
    probed = 0
    for step in range(120):
        root = rng.choice(roots)
        running = make_request(request_id=f"r{step}", token_ids=[*root[: rng.randint(4, len(root))], step])
        manager.begin_step()
        hit = manager.lookup(running)
        if manager.allocate(running, running.num_tokens - hit.num_tokens, hit=hit) is not None:
            running.num_computed_tokens = running.num_tokens
            manager.free(running)
        if rng.random() < 0.2:  # a waiting request grows (a resumed one with more tokens)
            rng.choice(waiting).token_ids.extend([rng.randrange(50)] * 4)
        for request in waiting:
            got = manager.peek(request)
            assert got == scan(manager, request), (step, request.request_id)
            probed += got > 0
    assert probed > 100  # (the waiting requests did hit: the memo was used, then invalidated)


@pytest.mark.parametrize("seed", range(4))
def test_state_probes_equal_the_full_scan(seed: int) -> None:
    """A state group's probe (the map's few checkpoints against the chain's positions) against `held`'s rfind."""
    rng = random.Random(seed)
    groups = [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=40), max_model_len=512,
                             options=CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN))
    state = manager.type_managers[1]
    roots = [[rng.randrange(50) for _ in range(rng.randint(100, 250))] for _ in range(3)]
    waiting = [make_request(request_id=f"w{i}", token_ids=[*rng.choice(roots), rng.randrange(50)]) for i in range(5)]
    found = 0
    for step in range(100):
        root = rng.choice(roots)
        running = make_request(request_id=f"r{step}", token_ids=[*root[: rng.randint(8, len(root))], step])
        run_and_free(manager, running, chunk=8)
        for request in waiting:
            manager.peek(request)  # (hashes its chain)
            keys = request.block_hashes[4]
            limit = rng.randint(0, len(keys))
            expected = state.view.held(keys[:limit])[0].rfind(1)
            assert state.hit_tokens(state.view, request.block_hashes, limit * 4) == (expected + 1) * 4
            found += expected >= 0
    assert found > 50
