"""The LRU free queue against a plain-list model of vLLM's queue, through holes and compactions,
with the array and the block-by-block (`_few`) variants of each operation mixed (and
`release_cached`, for blocks that all hold content)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.errors import IntegrityError
from hybridkv.kvcache.eviction import LRUPolicy


class ListModel:
    """vLLM's free queue as one Python list: content-free releases go to the front (the last
    released first), cached ones to the back; a hit removes a block wherever it is."""

    def __init__(self, num_blocks: int) -> None:
        self.order = list(range(1, num_blocks))

    def pop(self, n: int) -> list[int]:
        out, self.order = self.order[:n], self.order[n:]
        return out

    def release(self, ids: list[int], content: list[bool]) -> None:
        for block, cached in zip(ids, content, strict=True):
            if cached:
                self.order.append(block)
            else:
                self.order.insert(0, block)

    def remove(self, ids: list[int]) -> None:
        for block in ids:
            self.order.remove(block)


@pytest.mark.parametrize("seed", range(6))
def test_lru_policy_matches_the_list_model(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = 24
    content = np.zeros(num_blocks, np.bool_)
    policy = LRUPolicy(num_blocks, content)
    model = ListModel(num_blocks)
    held: list[int] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and policy.num_free:
            n = rng.randint(1, policy.num_free)
            got = policy.pop_few(n) if rng.random() < 0.5 else policy.pop(n).tolist()
            assert got == model.pop(n)
            held += got
        elif op < 0.8 and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            ids, held = held[:k], held[k:]
            all_cached = rng.random() < 0.25
            flags = [all_cached or rng.random() < 0.7 for _ in ids]
            content[ids] = flags
            if all_cached:
                policy.release_cached(np.array(ids, np.int64))
            elif rng.random() < 0.5:
                policy.release_few(ids)
            else:
                policy.release(np.array(ids, np.int64))
            model.release(ids, flags)
        else:
            cached = [b for b in model.order if content[b]]
            if cached:
                taken = rng.sample(cached, rng.randint(1, min(4, len(cached))))
                if rng.random() < 0.5:
                    policy.remove_few(taken)
                else:
                    policy.remove(np.array(taken, np.int64))
                model.remove(taken)
                held += taken
        assert policy.ordered() == model.order
        assert policy.num_free == len(model.order)


def test_ordered_reports_a_broken_count() -> None:
    policy = LRUPolicy(4, np.zeros(4, np.bool_))
    policy.num_free = 2
    with pytest.raises(IntegrityError, match="holds 3 blocks and 0 holes but num_free=2"):
        policy.ordered()
