"""Random put / get / contains / delete / clear / restart sequences on the L2 tiers, against plain
models that share no code with them: an LRU OrderedDict with the frame size formula (28 header
bytes + key + value) for the disk tier, a dict for the Valkey tier. The disk tier's capacity is a
few objects, so eviction and refused oversized objects happen often; `restart` closes the disk
tier and opens it again on the same directory (the index is rebuilt from the files)."""

from __future__ import annotations

import tempfile
import uuid
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.cache_server.tiers import DiskTier, TierError, ValkeyTier

KEYS = st.sampled_from([b"a", b"b", b"c", b"d", b"e", b"\x00\xff"])
VALUES = st.binary(min_size=40, max_size=120)  # 69-149 byte frames: 2-5 fit
# Each op: (kind, key, value, keys); puts and gets weighted up so LRU order and eviction matter.
KINDS = st.sampled_from(["put"] * 6 + ["get"] * 4 + ["contains", "delete", "clear", "restart"])
OPS = st.lists(st.tuples(KINDS, KEYS, VALUES, st.lists(KEYS, max_size=4)), min_size=10, max_size=60)
Op = tuple[str, bytes, bytes, list[bytes]]
CAPACITY = 400  # about three objects of 100 bytes


class LRUModel:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.items, self.evictions = capacity, OrderedDict[bytes, bytes](), 0

    @staticmethod
    def size(key: bytes, value: bytes) -> int:
        return 28 + len(key) + len(value)

    def used(self) -> int:
        return sum(self.size(k, v) for k, v in self.items.items())

    def put(self, key: bytes, value: bytes) -> bool:
        if self.size(key, value) > self.capacity:
            return False
        old = self.items.pop(key, None)
        while self.used() + self.size(key, value) > self.capacity:
            self.items.popitem(last=False)
            self.evictions += 1
        del old
        self.items[key] = value
        return True

    def get(self, key: bytes) -> bytes | None:
        if key in self.items:
            self.items.move_to_end(key)
        return self.items.get(key)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_disk_tier_matches_an_lru_model(ops: list[Op]) -> None:
    with tempfile.TemporaryDirectory() as d:
        tier, model = DiskTier(Path(d), capacity_bytes=CAPACITY), LRUModel(CAPACITY)
        for kind, key, value, keys in ops:
            if kind == "put":
                if model.put(key, value):
                    tier.put(key, value)
                else:
                    with pytest.raises(TierError, match="does not fit"):
                        tier.put(key, value)
            elif kind == "get":
                assert tier.get(key) == model.get(key)
            elif kind == "contains":
                assert tier.contains(keys) == [k in model.items for k in keys]
            elif kind == "delete":
                tier.delete(key)
                model.items.pop(key, None)
            elif kind == "clear":
                tier.clear()
                model.items.clear()
            else:
                evictions = tier.stats().evictions
                tier.close()
                tier = DiskTier(Path(d), capacity_bytes=CAPACITY)
                model.evictions -= evictions  # counters restart with the process
            stats = tier.stats()
            assert (stats.objects, stats.bytes_used, stats.evictions) == (len(model.items), model.used(),
                                                                         model.evictions)
            assert stats.corrupt_dropped == 0
        tier.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_valkey_tier_matches_a_dict(redis_url: str, ops: list[Op]) -> None:
    tier = ValkeyTier(redis_url, namespace=f"p{uuid.uuid4().hex[:12]}", stats_refresh_s=0)
    model: dict[bytes, bytes] = {}
    for kind, key, value, keys in ops:  # "restart" is the disk tier's; here it is a no-op
        if kind == "put":
            tier.put(key, value)
            model[key] = value
        elif kind == "get":
            assert tier.get(key) == model.get(key)
        elif kind == "contains":
            assert tier.contains(keys) == [k in model for k in keys]
        elif kind == "delete":
            tier.delete(key)
            model.pop(key, None)
        elif kind == "clear":
            tier.clear()
            model.clear()
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used) == (len(model), sum(28 + len(k) + len(v) for k, v in model.items()))
    tier.clear()
    tier.close()
