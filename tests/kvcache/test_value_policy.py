"""The value-aware eviction policy against a brute-force scorer over a small pool, hand-computed
orders, and through the manager (anchored window tails outlive unanchored ones)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.policies.value import BlockValue, ValuePolicy, ValueWeights
from hybridkv.plan.specs import SpecKind

INF = float("inf")


class BruteForce:
    """Every free block with its release clock and class; `pop` sorts them all by score."""

    def __init__(self, num_blocks: int, bonus: tuple[float, ...]) -> None:
        self.bonus = bonus
        self.clock = 0
        self.empty = list(range(num_blocks - 1, 0, -1))  # stack: the last released on top
        self.queued: dict[int, tuple[int, int]] = {}  # block -> (clock, class)
        self.share: dict[int, float] = {}  # block -> its share of the ANCHOR bonus (absent: 1)

    def score(self, block: int) -> float:
        clock, value = self.queued[block]
        return clock + self.bonus[value] * (self.share.get(block, 1.0) if value == BlockValue.ANCHOR else 1.0)

    def pop(self, n: int) -> list[int]:
        out = []
        while self.empty and len(out) < n:
            out.append(self.empty.pop())
        ranked = sorted(self.queued, key=lambda b: (self.score(b), self.queued[b][1], self.queued[b][0]))
        for block in ranked[: n - len(out)]:
            del self.queued[block]
            out.append(block)
        return out

    def release(self, block: int, value: int) -> None:
        if value == 0:
            self.empty.append(block)
        else:
            self.queued[block] = (self.clock, value)
            self.clock += 1

    def remove(self, block: int) -> None:
        if block in self.queued:
            del self.queued[block]
        else:
            self.empty.remove(block)

    def protect(self, block: int) -> None:
        if block in self.queued and self.queued[block][1] != BlockValue.PROTECTED:
            self.queued[block] = (self.clock, int(BlockValue.PROTECTED))
            self.clock += 1


@pytest.mark.parametrize("seed", range(8))
def test_value_policy_matches_a_brute_force_scorer(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = 24
    kinds = [SpecKind.FULL, SpecKind.SLIDING_WINDOW, SpecKind.MAMBA]
    content = np.zeros(num_blocks, np.bool_)
    group_of = np.zeros(num_blocks, np.int64)
    weights = ValueWeights(low=0.0, full=0.5, anchor=1.0, hot=1.5, protected=2.0)
    policy = ValuePolicy(num_blocks, content, weights)
    policy.bind(group_of, kinds)
    model = BruteForce(num_blocks, weights.bonuses(num_blocks))
    held: set[int] = set()
    marks: dict[int, int] = {}
    for _ in range(400):
        op = rng.random()
        free = policy.num_free
        if op < 0.35 and free:
            got = policy.pop_few(rng.randint(1, min(4, free))) if rng.random() < 0.5 else \
                policy.pop(rng.randint(1, min(6, free))).tolist()
            assert got == model.pop(len(got))
            for block in got:
                held.add(block)
                marks.pop(block, None)
                model.share.pop(block, None)
                content[block] = rng.random() < 0.8
                group_of[block] = rng.randrange(len(kinds))
        elif op < 0.45 and held:
            block = rng.choice(sorted(held))
            value = rng.choice([BlockValue.HOT, BlockValue.ANCHOR, BlockValue.FULL, BlockValue.LOW])
            policy.mark([block], value)
            marks[block] = max(marks.get(block, 0), int(value))
            if value == BlockValue.ANCHOR and rng.random() < 0.7:  # a share: the first set, then the highest
                share = rng.choice([0.0, 0.25, 0.5, 1.0])
                policy.weigh([block], share)
                model.share[block] = max(model.share.get(block, 0.0), share)
        elif op < 0.8 and held:
            out = rng.sample(sorted(held), rng.randint(1, min(5, len(held))))
            for block in out:
                held.discard(block)
                base = int(BlockValue.FULL) if kinds[group_of[block]] is SpecKind.FULL else int(BlockValue.LOW)
                model.release(block, max(base, marks.get(block, 0)) if content[block] else 0)
            if rng.random() < 0.5:
                policy.release_few(out)
            else:
                policy.release(np.array(out, np.int64))
        elif op < 0.92:
            cached = [b for b in model.queued if content[b]]
            if cached:
                block = rng.choice(sorted(cached))
                policy.remove_few([block])
                model.remove(block)
                held.add(block)
        else:
            cached = sorted(model.queued)
            if cached:
                block = rng.choice(cached)
                policy.protect([block])
                model.protect(block)
        assert policy.num_free == len(model.empty) + len(model.queued)
        order = policy.ordered()
        assert sorted(order) == sorted([*model.empty, *model.queued])


def test_hand_computed_order() -> None:
    """Pool of 7: a full block (group 0) and five window blocks (group 1) released in order
    1..6; block 3 is anchored. Bonus: full 1 pool (7 ticks), anchor 2 pools (14 ticks).
    Scores: 1 -> 0+7, 2 -> 1, 3 -> 2+14, 4 -> 3, 5 -> 4, 6 -> 5: order 2 4 5 6 1 3."""
    content = np.ones(7, np.bool_)
    group_of = np.array([0, 0, 1, 1, 1, 1, 1], np.int64)
    policy = ValuePolicy(7, content, ValueWeights(full=1.0, anchor=2.0, hot=2.5, protected=3.0))
    policy.bind(group_of, [SpecKind.FULL, SpecKind.SLIDING_WINDOW])
    assert policy.pop_few(6) == [1, 2, 3, 4, 5, 6]  # all start empty, reused in id order
    policy.mark([3], BlockValue.ANCHOR)
    policy.release_few([1, 2, 3, 4, 5, 6])
    assert policy.ordered() == [2, 4, 5, 6, 1, 3]
    assert policy.pop_few(2) == [2, 4]
    content[5] = False  # a block without content is reused first, whatever its age
    policy.remove_few([5])
    policy.release_few([5])
    assert policy.pop_few(1) == [5]


def test_an_anchor_with_a_share_of_its_bonus_by_hand() -> None:
    """test_hand_computed_order's pool and bonuses. Blocks 1 2 3 released first (clocks 0 1 2), block 3
    an anchor with a quarter of its bonus: 1 -> 0 + 7, 2 -> 1, 3 -> 2 + 14/4 = 5.5: order 2 3 1 (with
    its whole bonus, 3 would go last). Then 4 5 6 (clocks 3 4 5), block 4 an anchor weighed 0 and then
    0.5 (the highest kept): 4 -> 3 + 7 = 10, 5 -> 4, 6 -> 5: order 2 5 6 3 1 4."""
    content = np.ones(7, np.bool_)
    group_of = np.array([0, 0, 1, 1, 1, 1, 1], np.int64)
    policy = ValuePolicy(7, content, ValueWeights(full=1.0, anchor=2.0, hot=2.5, protected=3.0))
    policy.bind(group_of, [SpecKind.FULL, SpecKind.SLIDING_WINDOW])
    assert policy.pop_few(6) == [1, 2, 3, 4, 5, 6]
    policy.mark([3], BlockValue.ANCHOR)
    policy.weigh([3], 0.25)
    policy.release_few([1, 2, 3])
    assert policy.ordered() == [2, 3, 1]
    policy.mark([4], BlockValue.ANCHOR)
    policy.weigh([4], 0.0)
    policy.weigh([4], 0.5)
    policy.release_few([4, 5, 6])
    assert policy.ordered() == [2, 5, 6, 3, 1, 4]
    assert policy.pop_few(6) == [2, 5, 6, 3, 1, 4]
    with pytest.raises(ConfigError, match=r"in \[0, 1\], got 1.5"):
        policy.weigh([4], 1.5)


def test_a_pool_that_never_fills_keeps_a_bounded_queue() -> None:
    """Hits that take blocks back and release them again leave stale entries that eviction would
    drop as it reaches them; with no eviction they are dropped once there are more than
    STALE_ENTRIES_PER_BLOCK per block, and the order is unchanged."""
    from hybridkv.kvcache.policies.value import STALE_ENTRIES_PER_BLOCK

    content = np.ones(8, np.bool_)
    policy = ValuePolicy(8, content)
    policy.bind(np.zeros(8, np.int64), [SpecKind.FULL])
    assert policy.pop_few(4) == [1, 2, 3, 4]
    policy.mark([2], BlockValue.ANCHOR)
    policy.weigh([2], 0.5)
    policy.release_few([1, 2, 3, 4])
    for _ in range(2000):  # a hit on blocks 1 and 2, freed again
        policy.remove_few([1, 2])
        policy.mark([2], BlockValue.ANCHOR)
        policy.release_few([1, 2])
        policy.protect([3])
    assert policy.num_entries() <= STALE_ENTRIES_PER_BLOCK * 8 + 64
    # by hand (bonus: full 8, anchor 8 x 0.5, protected 64 ticks): the never-used blocks 5 6 7 first, then
    # 4 (clock 3 + 8), 3 (protected at clock 6: 70), 2 (its last release at clock 4004, ANCHOR: + 4) and
    # 1 (clock 4003, FULL: + 8)
    assert policy.ordered() == [5, 6, 7, 4, 3, 2, 1]
    assert policy.pop_few(7) == [5, 6, 7, 4, 3, 2, 1]


def test_weights_must_be_ordered() -> None:
    with pytest.raises(ConfigError, match="ordered"):
        ValueWeights(full=2.0, anchor=1.0)


@pytest.mark.parametrize("seed", range(6))
def test_value_policy_in_runs_matches_a_brute_force_scorer(seed: int) -> None:
    """As the test above with what a multi-page state layout does: releases, protections and pops of
    dozens of blocks at once (the policy queues and evicts runs of blocks), classes and shares mixed
    within a release, so one pop interleaves several runs of several classes."""
    rng = random.Random(100 + seed)
    num_blocks = 160
    kinds = [SpecKind.FULL, SpecKind.MAMBA]
    content = np.zeros(num_blocks, np.bool_)
    group_of = np.zeros(num_blocks, np.int64)
    weights = ValueWeights(low=0.0, full=0.05, anchor=0.1, hot=0.2, protected=0.4)  # scores interleave
    policy = ValuePolicy(num_blocks, content, weights)
    policy.bind(group_of, kinds)
    model = BruteForce(num_blocks, weights.bonuses(num_blocks))
    held: list[int] = []
    marks: dict[int, int] = {}
    for _ in range(300):
        op = rng.random()
        if op < 0.35 and policy.num_free:
            got = policy.pop(rng.randint(1, min(40, policy.num_free))).tolist()
            assert got == model.pop(len(got))
            for block in got:
                held.append(block)
                marks.pop(block, None)
                model.share.pop(block, None)
                content[block] = rng.random() < 0.9
                group_of[block] = rng.randrange(len(kinds))
        elif op < 0.5 and held:
            chosen = rng.sample(held, rng.randint(1, min(30, len(held))))
            value = rng.choice([BlockValue.HOT, BlockValue.ANCHOR, BlockValue.LOW])
            share = rng.choice([None, 0.0, 0.3, 1.0]) if value == BlockValue.ANCHOR else None
            policy.mark(chosen, value, share)
            for block in chosen:
                marks[block] = max(marks.get(block, 0), int(value))
                if share is not None:
                    model.share[block] = max(model.share.get(block, 0.0), share) if block in model.share else share
        elif op < 0.8 and held:
            out = rng.sample(held, rng.randint(1, min(50, len(held))))
            for block in out:
                held.remove(block)
                base = int(BlockValue.FULL) if kinds[group_of[block]] is SpecKind.FULL else int(BlockValue.LOW)
                model.release(block, max(base, marks.get(block, 0)) if content[block] else 0)
            policy.release(np.array(out, np.int64))
        elif op < 0.9:
            cached = sorted(b for b in model.queued if content[b])
            if cached:
                taken = rng.sample(cached, rng.randint(1, min(20, len(cached))))
                policy.remove(np.array(taken, np.int64))
                for block in taken:
                    model.remove(block)
                    held.append(block)
        else:
            cached = sorted(model.queued)
            if cached:
                chosen = rng.sample(cached, rng.randint(1, min(25, len(cached))))
                policy.protect(chosen + chosen[:3])  # (a block named twice is protected once)
                for block in chosen:
                    model.protect(block)
        assert policy.ordered() == [*model.empty[::-1], *sorted(model.queued, key=lambda b: (
            model.score(b), model.queued[b][1], model.queued[b][0]))]
