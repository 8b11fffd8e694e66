"""A dict-backed L2 tier for testing what sits above a tier (the write-behind), with switches to
make puts block or fail."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hybridkv.cache_server.tiers import TierError, TierStats
from hybridkv.cache_server.tiers.base import TierWatcher


class DictTier:
    """An `L2Tier` over a dict. `gate` (set by default) blocks puts while cleared; `entered` is
    set once a put started; keys in `fail_keys` make put raise TierError."""

    name = "dict"
    private = True

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # set when a put starts (before waiting on the gate)
        self.fail_keys: set[bytes] = set()
        self.errors = 0
        self._lock = threading.Lock()

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self.entered.set()
        self.gate.wait()
        with self._lock:
            if key in self.fail_keys:
                self.errors += 1
                raise TierError(f"put of {key!r} failed (test)")
            self.objects[key] = bytes(value)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            return self.objects.get(key)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self.objects for k in keys]

    def delete(self, key: bytes) -> None:
        with self._lock:
            self.objects.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self.objects.clear()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(name=self.name, objects=len(self.objects),
                             bytes_used=sum(map(len, self.objects.values())), capacity_bytes=None,
                             errors=self.errors, corrupt_dropped=0, evictions=0)

    def watch(self, watcher: TierWatcher) -> str | None:
        return "the dict tier reports nothing"

    def close(self) -> None:
        pass
