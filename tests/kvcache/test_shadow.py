"""`shadow_manager`: a ghost's manager keeps the blocks, hashes and hits of a full `KVCacheManager`, run side by
side through the same steps, while it builds no entries and no copies; `row_tuples` by hand."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from hybridkv.kvcache.group_spans import row_tuples
from hybridkv.kvcache.manager import KVCacheManager, shadow_manager
from hybridkv.kvcache.options import CacheOptions, EvictionPolicyName, MambaCacheMode, RunningState
from tests.factories import make_config, make_group, make_request

K = 4  # a state in 4 page groups (the multi-page layout)
PAGED = [make_group(kind="full", block_size=4),
         *(dataclasses.replace(make_group(kind="mamba", block_size=4), state_page=s, state_pages=K) for s in range(K))]


def prompts(seed: int, count: int) -> list[list[int]]:
    """Requests that extend a few shared prefixes by 5-30 tokens (hits on attention blocks and checkpoints)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(500) for _ in range(rng.randint(8, 24))] for _ in range(3)]
    out = []
    for _ in range(count):
        base = rng.choice(out) if out and rng.random() < 0.5 else rng.choice(roots)
        out.append(base + [rng.randrange(500) for _ in range(rng.randint(5, 30))])
    return out


def run(manager: KVCacheManager, requests: list[list[int]]) -> tuple[list[int], list[int], int]:
    """Two requests at a time, 8-token chunks then one decode token each: (each request's hit tokens,
    the free queue at the end, the copies taken)."""
    hits, copies = [], 0
    for pair in range(0, len(requests), 2):
        live = [make_request(request_id=f"r{pair + i}", token_ids=p) for i, p in enumerate(requests[pair : pair + 2])]
        manager.begin_step()
        found = [manager.lookup(r) for r in live]
        hits += [h.num_tokens for h in found]
        ends = [h.num_tokens for h in found]
        targets = [len(r.token_ids) + 1 for r in live]  # (the prompt, then one decode token)
        first = True
        while ends != targets:
            for i, request in enumerate(live):
                if ends[i] == targets[i]:
                    continue
                if ends[i] == len(request.token_ids):
                    request.token_ids.append(7)  # (the decode token)
                n = min(8 - ends[i] % 8, len(request.token_ids) - ends[i])
                assert manager.allocate(request, n, hit=found[i] if first else None) is not None
                ends[i] += n
            copies += len(manager.take_pending_copies()) + len(manager.take_checkpoint_copies())
            for i, request in enumerate(live):
                request.num_computed_tokens = ends[i]
            manager.begin_step()
            first = False
        for request in live:
            manager.free(request)
        manager.check_integrity()
    return hits, manager.policies.eviction_order(), copies


@pytest.mark.parametrize("running", [RunningState.FIXED, RunningState.ADOPT])
@pytest.mark.parametrize("seed", range(2))
def test_a_shadow_hits_and_evicts_as_the_full_manager(running: RunningState, seed: int) -> None:
    options = CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN, running_state=running,
                           eviction=EvictionPolicyName.VALUE)
    config = make_config(groups=PAGED, num_blocks=120)  # (tight: blocks are evicted and reused)
    full = KVCacheManager(config, max_model_len=256, options=options)
    shadow, _ = shadow_manager(config, 256, options)
    requests = prompts(seed, 40)
    full_hits, full_order, full_copies = run(full, [list(p) for p in requests])
    shadow_hits, shadow_order, shadow_copies = run(shadow, [list(p) for p in requests])
    assert shadow_hits == full_hits and sum(full_hits) > 0
    assert shadow_order == full_order
    assert full.stats().checkpoint_copies == shadow.stats().checkpoint_copies > 0
    assert full_copies > 0 and shadow_copies == 0  # (a shadow builds no copies)
    request = make_request(request_id="x", token_ids=list(range(20)))
    assert shadow.allocate(request, 20) == ((),) * len(PAGED)  # (and answers no entries)


def test_row_tuples_by_hand() -> None:
    grown = np.array([[0, 0, 5], [0, 0, 9]], np.int64)  # a running state's rows after a chunk: nulls, then the block
    assert row_tuples(grown) == [(0, 0, 5), (0, 0, 9)]
    mixed = np.array([[3, 0, 5], [0, 4, 0]], np.int64)
    assert row_tuples(mixed) == [(3, 0, 5), (0, 4, 0)]
    assert row_tuples(np.array([[6], [8]], np.int64)) == [(6,), (8,)]
    assert all(type(v) is int for row in row_tuples(grown) for v in row)
