"""The L1 arena's extents by hand: first fit, 64-byte rounding, coalescing, overlap detection;
and the pool evicting until a fragmented arena has a large enough hole."""

from __future__ import annotations

import pytest

from hybridkv.cache_server.arena import Arena
from hybridkv.cache_server.l1_eviction import L1LRUPolicy
from hybridkv.cache_server.pool import L1Pool
from hybridkv.errors import IntegrityError


def test_first_fit_rounding_and_coalescing() -> None:
    arena = Arena(640)
    assert [arena.alloc(n) for n in (1, 64, 65, 100)] == [0, 64, 128, 256]  # 65 and 100 take 128 each
    assert arena.free_bytes == 640 - 384 and arena.alloc(257) is None  # 256 left
    arena.free(64, 64)
    arena.free(256, 100)
    assert arena.alloc(128) == 256  # the 64-byte hole at 64 is too small: first fit goes on
    arena.free(0, 1)
    arena.free(128, 65)  # 0..64, 64..128 and 128..256 coalesce into one 256-byte extent
    assert arena.alloc(256) == 0
    arena.check_integrity(used_bytes=256 + 128)
    with pytest.raises(IntegrityError):
        arena.free(384, 64)  # already free


def test_pool_evicts_until_a_hole_fits() -> None:
    pool = L1Pool(4 * 64, L1LRUPolicy())
    for k in (b"a", b"b", b"c", b"d"):
        assert pool.put(k, 64, lambda v, k=k: v.fill(k[0]))
    pool.lock(b"b")
    # LRU order a, c, d (b was touched by its lock): evicting a leaves a 64-byte hole before the
    # locked b, evicting c a 64-byte hole after it; only with d gone do c+d make 128 bytes
    assert pool.put(b"e", 128, lambda v: v.fill(ord("e")))
    assert b"b" in pool and b"e" in pool
    e, b = pool.get(b"e"), pool.get(b"b")
    assert e is not None and b is not None and bytes(e) == b"e" * 128 and bytes(b) == b"b" * 64
    assert pool.stats().evictions == 3  # a, c, d
    pool.check_integrity()
    assert not pool.put(b"f", 256, lambda v: None)  # would need the locked b's space
    pool.check_integrity()
