"""`--l2-sizing resumable`: the tier sizer against a brute-force reference, and through a real server
with a disk tier (a hand case where the tier's own LRU loses a prefix the sizer keeps).

The reference knows nothing of the sizer's index: a prefix is resumable when every object group's
needed chunks along its path are in L1 or in the tier (a lookup reads each object from either), and
an object in the tier is dead when no such prefix needs it."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path as FsPath

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache_server.keys import object_key
from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.l2 import TierSet
from hybridkv.cache_server.l2_sizing import L2Sizing, TierSizer, frame_bytes
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.store import StoreConfig
from hybridkv.cache_server.tiers.base import TierStats
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.connector.client import chunk_hashes
from tests.cache_server.helpers import fake_engine, make_group, running_server
from tests.cache_server.test_prefix_index import PATHS, Path, Rules, key, naive, place
from tests.cache_server.tiers.fakes import DictTier

OPS = st.lists(st.tuples(st.sampled_from(["write", "write", "write", "l1_put", "l1_drop", "forget", "touch",
                                          "begin"]), PATHS, st.integers(0, 2)), max_size=50)


def nbytes(path: Path) -> int:
    return 10 * len(path)


def frame(path: Path, og: int) -> int:
    return frame_bytes(key(path, og), nbytes(path))


@settings(max_examples=150, deadline=None)
@given(kinds=st.sampled_from([("full", "state"), ("full", "w2"), ("full", "w2", "state")]), ops=OPS,
       budget_frames=st.integers(2, 8))
def test_sizer_matches_brute_force(kinds: tuple[str, ...], ops: list[tuple[str, Path, int]],
                                   budget_frames: int) -> None:
    rules = Rules(kinds)
    budget = budget_frames * frame((0, 0, 0), 0)
    sizer = TierSizer(budget)
    l1: set[tuple[Path, int]] = set()
    tier: set[tuple[Path, int]] = set()
    batch: set[tuple[Path, int]] = set()
    for op, path, og in ops:
        og %= len(kinds)
        po = (path, og)
        if op == "write":
            dead_before = naive(rules, l1 | tier | {po})[1] & (tier - batch - {po})
            victims = sizer.admit(key(*po), nbytes(path), place(rules, path, og))
            assert victims is not None  # every frame here fits the budget
            by_key = {key(*t): t for t in tier}
            assert all(v in by_key and v != key(*po) for v in victims)
            if victims and dead_before:
                assert by_key[victims[0]] in dead_before  # dead objects go first
            tier -= {by_key[v] for v in victims}
            tier.add(po)
            batch -= {by_key[v] for v in victims}
            batch.add(po)
        elif op == "l1_put" and po not in l1:
            l1.add(po)
            sizer.l1_placed(key(*po), nbytes(path), place(rules, path, og))
        elif op == "l1_drop" and po in l1:
            l1.discard(po)
            sizer.l1_dropped(key(*po))
        elif op == "forget":
            tier.discard(po)
            batch.discard(po)
            sizer.forget(key(*po))
        elif op == "touch":
            sizer.touch(key(*po))
        elif op == "begin":
            batch.clear()
            sizer.begin_store()
        sizer.check_integrity()
        resumable, dead = naive(rules, l1 | tier)
        stats = sizer.stats()
        assert stats.bytes_used == sum(frame(*t) for t in tier) <= budget
        assert stats.objects == len(tier)
        assert stats.resumable_prefixes == len(resumable)
        assert (stats.dead_objects, stats.dead_bytes) == (len(dead & tier), sum(frame(*t) for t in dead & tier))
        state = {t for t in tier if kinds[t[1]] == "state"}
        assert (stats.state_bytes, stats.attention_bytes) == (sum(frame(*t) for t in state),
                                                              sum(frame(*t) for t in tier - state))
        assert all((key(*t) in sizer) == (t in tier) for t in l1 | tier)


def test_an_object_larger_than_the_budget_is_not_admitted() -> None:
    rules = Rules(("full",))
    sizer = TierSizer(100)
    assert sizer.admit(b"k", 100, place(rules, (0,), 0)) is None
    assert sizer.stats().objects == 0 and b"k" not in sizer
    sizer.check_integrity()


# ---- through a server: full + state chunks, an L1 of four objects, a disk tier of five ------------------


def _hand_case(sizing: L2Sizing, tmp: FsPath) -> tuple[int, dict[str, object], int, float]:
    """A (2 chunks, a state at its end) is stored, then B and C (2 chunks each, no state: prefills that
    stopped mid-chunk) whose four objects no lookup can use. L1 keeps the last four objects, so A is
    then only in the disk tier (room for five frames): its own LRU drops A's first chunks (the oldest
    writes), the sizer drops B's dead chunks. Returns A's hit, the disk's /status entry, the disk's own
    evictions and the resumable-prefixes metric."""
    chunk, page = 8, 64
    groups = [make_group(block=chunk, page=page), make_group(kind="state", block=chunk, page=page)]
    seqs = {name: [base + t for t in range(2 * chunk + 1)] for name, base in (("a", 0), ("b", 1000), ("c", 2000))}
    hashes = {name: chunk_hashes(s, chunk) for name, s in seqs.items()}
    disk = DiskTier(tmp, 5 * frame_bytes(object_key(bytes(16), 0, hashes["a"][0]), page))
    config = StoreConfig(chunk_tokens=chunk, l1_bytes=4 * page, eviction_policy=L1EvictionPolicyName.LRU,
                         l2_sizing=sizing)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_server(config, [disk]))
        engine = stack.enter_context(fake_engine(groups))
        c = stack.enter_context(server.client())
        c.register(engine.layout)
        assert c.store(first_chunk=0, chunk_hashes=hashes["a"], block_ids=[[1, 2], [0, 3]]).stored == [True, True]
        for name, blocks in (("b", [4, 5]), ("c", [6, 7])):
            assert c.store(first_chunk=0, chunk_hashes=hashes[name], block_ids=[blocks, [0, 0]]).stored == [True] * 2
        assert server.store.tiers.flush(timeout_s=10)
        found = c.lookup(hashes["a"], num_tokens=len(seqs["a"]))
        if found.lookup_id:
            c.release(found.lookup_id)
        server.store.check_integrity()
        status = server.store.status()
        (entry,) = [t for t in status["tiers"] if t["name"] == "disk"]
        assert status["l2_sizing"] == sizing.value
        metrics = server.http("/metrics")
        line = next((ln for ln in metrics.splitlines()
                     if ln.startswith('hybridkv_server_tier_resumable_prefixes{tier="disk"}')), "")
        return found.hit_tokens, entry, disk.stats().evictions, float(line.split()[-1]) if line else -1.0


def test_disk_tier_loses_the_prefix_by_itself_and_keeps_it_sized(tmp_path: FsPath) -> None:
    hit, entry, own_evictions, _ = _hand_case(L2Sizing.OBJECTS, tmp_path / "objects")
    assert hit == 0 and own_evictions == 2 and entry["sizing"] == "objects" and "resumable_prefixes" not in entry

    hit, entry, own_evictions, metric = _hand_case(L2Sizing.RESUMABLE, tmp_path / "resumable")
    assert hit == 16 and own_evictions == 0  # the sizer made room: B's dead chunks 0 and 1
    frame = int(entry["sized_bytes"]) // 5  # type: ignore[call-overload]
    assert entry["sizing"] == "resumable" and entry["sized_objects"] == 5 and entry["sized_evictions"] == 2
    # A is resumable (in the tier and, read back, in L1); C's two chunks have no state: dead
    assert entry["resumable_prefixes"] == 1 and metric == 1.0
    assert (entry["dead_objects"], entry["dead_bytes"]) == (2, 2 * frame)
    assert (entry["state_bytes"], entry["attention_bytes"]) == (frame, 4 * frame)


class _BoundedDict(DictTier):
    def stats(self) -> TierStats:
        return dataclasses.replace(super().stats(), capacity_bytes=1 << 20)


class _SharedBoundedDict(_BoundedDict):
    name = "shared"
    private = False


def test_only_private_bounded_tiers_are_sized() -> None:
    """A tier other servers write too (Valkey) or one with no bound is left to itself."""
    tiers = TierSet([_BoundedDict(), _SharedBoundedDict(), DictTier()], ServerMetrics(), L2Sizing.RESUMABLE)
    try:
        sized = tiers.sizer_stats()
        assert [z is not None for z in sized] == [True, False, False]
        assert [t["sizing"] for t in tiers.describe(sized)] == ["resumable", "objects", "objects"]
    finally:
        tiers.close()
    unsized = TierSet([_BoundedDict()], ServerMetrics(), L2Sizing.OBJECTS)
    try:
        assert unsized.sizer_stats() == [None] and not unsized.sized
    finally:
        unsized.close()
