"""The L1 memory pool: objects (one per chunk and object group) within a byte capacity.

Accounting is per object (capacity is never divided by the number of groups). An object can be
locked (a lookup holds it until retrieve, release or a TTL); locked objects are never evicted.
`put` either places the object, evicting unlocked objects in the policy's order, or changes
nothing and returns False (the pool is full of locked objects, or the object is larger than the
pool): the store reports that chunk refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.core.errors import IntegrityError
from hybridkv.server.eviction import EvictionPolicy
from hybridkv.server.shm import Bytes


@dataclass(slots=True)
class _Entry:
    value: Bytes
    locks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolStats:
    objects: int
    bytes_used: int
    capacity_bytes: int
    locked_objects: int
    evictions: int


class L1Pool:
    def __init__(self, capacity_bytes: int, policy: EvictionPolicy,
                 on_evict: Callable[[bytes, int], None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self._policy = policy
        self._entries: dict[bytes, _Entry] = {}
        self._used = 0
        self._locked_bytes = 0
        self._locked_objects = 0
        self._evictions = 0
        self._on_evict = on_evict

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._policy.touch(key)
        return entry.value

    def put(self, key: bytes, value: Bytes) -> bool:
        """Place `value` under `key` (replacing an unlocked older one); False = nothing changed."""
        old = self._entries.get(key)
        if old is not None and old.locks:
            self._policy.touch(key)
            return old.value.nbytes == value.nbytes
        size = value.nbytes
        if self._locked_bytes + size > self.capacity_bytes:  # even evicting every unlocked object
            return False
        if old is not None:
            self._drop(key)
        while self._used + size > self.capacity_bytes:
            self._evict_one()
        self._entries[key] = _Entry(value)
        self._policy.insert(key)
        self._used += size
        return True

    def _evict_one(self) -> bytes:
        for key in self._policy.order():
            if not self._entries[key].locks:
                nbytes = self._entries[key].value.nbytes
                self._drop(key)
                self._evictions += 1
                if self._on_evict is not None:
                    self._on_evict(key, nbytes)
                return key
        raise IntegrityError(f"L1 pool: no unlocked object to evict ({self._used} bytes used, "
                             f"{self._locked_bytes} locked)")

    def evict_one(self) -> bytes | None:
        """Evict the policy's first unlocked object; its key, or None if every object is locked."""
        if self._used == self._locked_bytes:
            return None
        return self._evict_one()

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._policy.remove(key)
        self._used -= entry.value.nbytes

    def lock(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        if entry.locks == 0:
            self._locked_bytes += entry.value.nbytes
            self._locked_objects += 1
        entry.locks += 1
        self._policy.touch(key)
        return True

    def unlock(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.locks == 0:
            raise IntegrityError(f"L1 pool: unlock of an object that is not locked ({key.hex()})")
        entry.locks -= 1
        if entry.locks == 0:
            self._locked_bytes -= entry.value.nbytes
            self._locked_objects -= 1

    def clear(self) -> int:
        """Drop every unlocked object (locked ones stay until released); returns how many went."""
        doomed = [k for k, e in self._entries.items() if not e.locks]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def stats(self) -> PoolStats:
        return PoolStats(objects=len(self._entries), bytes_used=self._used, capacity_bytes=self.capacity_bytes,
                         locked_objects=self._locked_objects, evictions=self._evictions)

    def check_integrity(self) -> None:
        used = sum(e.value.nbytes for e in self._entries.values())
        locked = sum(e.value.nbytes for e in self._entries.values() if e.locks)
        in_policy = set(self._policy.order())
        if used != self._used or locked != self._locked_bytes or in_policy != set(self._entries):
            raise IntegrityError(f"L1 pool: used {self._used} (actual {used}), locked {self._locked_bytes} "
                                 f"(actual {locked}), {len(in_policy)} keys in the policy vs "
                                 f"{len(self._entries)} objects")
        if used > self.capacity_bytes:
            raise IntegrityError(f"L1 pool: {used} bytes used exceeds capacity {self.capacity_bytes}")
