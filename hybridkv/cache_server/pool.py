"""The L1 memory pool: objects (one per chunk and object group) in a pre-faulted arena.

Accounting is per object (capacity is never divided by the number of groups). An object can be
locked (a lookup holds it until retrieve, release or a TTL); locked objects are never evicted.
`put` either places the object, evicting unlocked objects in the policy's order, or changes
nothing and returns False (the pool is full of locked objects, the object is larger than the
pool, or `can_reuse` says memory of evicted objects may not be reused yet): the store reports
that chunk refused.

`can_reuse` exists for the write-behind: an object queued for an L2 tier is handed over as a
view of the arena, so its memory must not be overwritten before the tier has it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.cache_server.arena import Arena, aligned
from hybridkv.cache_server.l1_eviction import L1EvictionPolicy
from hybridkv.cache_server.prefix_index import IndexStats, ObjectPlace, PrefixIndex
from hybridkv.cache_server.shm import Bytes
from hybridkv.errors import IntegrityError


class PoolListener(Protocol):
    """Told of every object that enters, is used in, and leaves the pool (the sized L2 tiers)."""

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None: ...

    def used(self, key: bytes) -> None: ...

    def dropped(self, key: bytes) -> None: ...


class _Listeners:
    """Several pool listeners told in turn."""

    def __init__(self, listeners: list[PoolListener]) -> None:
        self._listeners = listeners

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        for listener in self._listeners:
            listener.placed(key, nbytes, place)

    def used(self, key: bytes) -> None:
        for listener in self._listeners:
            listener.used(key)

    def dropped(self, key: bytes) -> None:
        for listener in self._listeners:
            listener.dropped(key)


def listeners(*maybe: PoolListener | None) -> PoolListener | None:
    """One listener telling each given one (the sized L2 tiers, the KV events); None for none."""
    given = [listener for listener in maybe if listener is not None]
    return None if not given else given[0] if len(given) == 1 else _Listeners(given)


@dataclass(slots=True)
class _Entry:
    offset: int
    nbytes: int
    locks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    objects: int
    bytes_used: int  # object bytes (their extents are rounded up to 64 bytes)
    capacity_bytes: int
    locked_objects: int
    evictions: int
    prefixes: IndexStats  # resumable prefixes and dead objects (prefix_index.py)

    def describe(self) -> dict[str, Any]:
        """L1 as `/status` lists it among the tiers."""
        p = self.prefixes
        return {"name": "l1", "objects": self.objects, "bytes_used": self.bytes_used,
                "capacity_bytes": self.capacity_bytes, "evictions": self.evictions,
                "locked_objects": self.locked_objects, "resumable_prefixes": p.resumable_prefixes,
                "dead_objects": p.dead_objects, "dead_bytes": p.dead_bytes, "state_bytes": p.state_bytes,
                "attention_bytes": p.attention_bytes}


class L1Pool:
    def __init__(self, capacity_bytes: int, policy: L1EvictionPolicy, *, index: PrefixIndex | None = None,
                 on_evict: Callable[[bytes, int], None] | None = None,
                 can_reuse: Callable[[], bool] | None = None, listener: PoolListener | None = None) -> None:
        self._arena = Arena(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self._policy = policy
        self.index = index or PrefixIndex()  # where each object sits among the resumable prefixes
        self._entries: dict[bytes, _Entry] = {}
        self._used = 0  # object bytes
        self._locked_extent_bytes = 0
        self._locked_objects = 0
        self._evictions = 0
        self._on_evict = on_evict
        self._can_reuse = can_reuse
        self._listener = listener

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def _view(self, entry: _Entry) -> Bytes:
        return self._arena.view[entry.offset:entry.offset + entry.nbytes]

    def get(self, key: bytes) -> Bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._touch(key)
        return self._view(entry)

    def _touch(self, key: bytes) -> None:
        self._policy.touch(key)
        self.index.touch(key)
        if self._listener is not None:
            self._listener.used(key)

    def put(self, key: bytes, nbytes: int, fill: Callable[[Bytes], None], place: ObjectPlace | None = None) -> bool:
        """Place a new object of `nbytes` under `key`, written by `fill(view)`; False = nothing placed.
        `place`: its chunk in its prefix tree (None: outside any, evicted by the policy's fallback).

        `key` must not be in the pool. If `fill` raises, the space is given back and the error propagates."""
        if key in self._entries:
            raise IntegrityError(f"L1 pool: put of a key already present ({key.hex()})")
        need = aligned(max(nbytes, 1))
        if self._locked_extent_bytes + need > self._arena.capacity_bytes:  # even evicting every unlocked object
            return False
        offset = self._arena.alloc(need)
        if offset is None:
            if self._can_reuse is not None and not self._can_reuse():
                return False
            while offset is None:
                if not self._evict_one():
                    return False
                offset = self._arena.alloc(need)
        entry = _Entry(offset, nbytes)
        try:
            fill(self._view(entry))
        except BaseException:
            self._arena.free(offset, nbytes)
            raise
        self._entries[key] = entry
        self._policy.insert(key)
        self.index.insert(key, nbytes, place)
        self._used += nbytes
        if self._listener is not None:
            self._listener.placed(key, nbytes, place)
        return True

    def _evict_one(self) -> bool:
        for key in self._policy.order():
            if not self._entries[key].locks:
                nbytes = self._entries[key].nbytes
                self._drop(key)
                self._evictions += 1
                if self._on_evict is not None:
                    self._on_evict(key, nbytes)
                return True
        return False

    def evict_one(self) -> bytes | None:
        """Evict the policy's first unlocked object; its key, or None if every object is locked."""
        for key in self._policy.order():
            if not self._entries[key].locks:
                if self._can_reuse is not None and not self._can_reuse():
                    return None
                self._drop(key)
                self._evictions += 1
                return key
        return None

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._policy.remove(key)
        self.index.remove(key)
        self._arena.free(entry.offset, entry.nbytes)
        self._used -= entry.nbytes
        if self._listener is not None:
            self._listener.dropped(key)

    def lock(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.locks == 0:
            self._locked_extent_bytes += aligned(max(entry.nbytes, 1))
            self._locked_objects += 1
        entry.locks += 1
        self._touch(key)
        return True

    def unlock(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.locks == 0:
            raise IntegrityError(f"L1 pool: unlock of an object that is not locked ({key.hex()})")
        entry.locks -= 1
        if entry.locks == 0:
            self._locked_extent_bytes -= aligned(max(entry.nbytes, 1))
            self._locked_objects -= 1

    def clear(self) -> int:
        """Drop every unlocked object (locked ones stay until released); returns how many went."""
        doomed = [k for k, e in self._entries.items() if not e.locks]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def stats(self) -> PoolStats:
        return PoolStats(objects=len(self._entries), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
                         locked_objects=self._locked_objects, evictions=self._evictions, prefixes=self.index.stats())

    def check_integrity(self) -> None:
        used = sum(e.nbytes for e in self._entries.values())
        extents = sum(aligned(max(e.nbytes, 1)) for e in self._entries.values())
        locked = sum(aligned(max(e.nbytes, 1)) for e in self._entries.values() if e.locks)
        in_policy = set(self._policy.order())
        if used != self._used or locked != self._locked_extent_bytes or in_policy != set(self._entries):
            raise IntegrityError(f"L1 pool: used {self._used} (actual {used}), locked {self._locked_extent_bytes} "
                                 f"(actual {locked}), {len(in_policy)} keys in the policy vs "
                                 f"{len(self._entries)} objects")
        self._arena.check_integrity(extents)
        self.index.check_integrity()
