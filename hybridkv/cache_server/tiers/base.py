"""The L2 tier contract: a byte store keyed by opaque object keys, below the server's L1 pool.

A tier stores whole objects or nothing (a reader never sees part of an object), returns `None`
for an object it does not have or that failed its checksum (a corrupt object is dropped and
counted, never returned), and raises `TierError` when the medium itself fails (an I/O error, a
lost connection). Every tier may be called from several threads at once (the server's
write-behind thread and its request thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.errors import HybridKVError

WARN_INTERVAL_S = 10.0


class RateLimitedWarnings:
    """At most one warning per `interval_s` for each key (a tier and what failed), so an L2 outage
    logs a line every few seconds instead of one per operation (hundreds a second); the next line
    says how many were left out."""

    def __init__(self, logger: logging.Logger, interval_s: float = WARN_INTERVAL_S) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last logged, suppressed since)
        self._lock = threading.Lock()

    def warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (-float("inf"), 0))
            if now - last < self._interval_s:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        more = f" ({suppressed} more like it in the last {now - last:.0f} s)" if suppressed else ""
        self._log.warning("%s%s", message, more)


class TierError(HybridKVError, RuntimeError):
    """A tier operation failed: an I/O error, a lost connection, an object the tier cannot hold."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """A snapshot of one tier's usage and fault counters (counters count since the tier opened)."""

    name: str
    objects: int
    bytes_used: int
    capacity_bytes: int | None  # None: the tier does not bound itself (e.g. Valkey's own maxmemory)
    errors: int  # operations that raised TierError
    corrupt_dropped: int  # objects that failed their checksum, framing or length check and were dropped
    evictions: int  # objects removed to make room

    def __post_init__(self) -> None:
        for field in ("objects", "bytes_used", "errors", "corrupt_dropped", "evictions"):
            if getattr(self, field) < 0:
                raise ValueError(f"TierStats.{field} must be >= 0, got {getattr(self, field)}")


class TierWatcher(Protocol):
    """Told what a watched tier holds (`L2Tier.watch`): called from the tier's threads (the writer's,
    a notification thread), never under a lock of the caller's."""

    def written(self, key: bytes) -> None:
        """An object is in the tier now (a put completed)."""
        ...

    def removed(self, key: bytes) -> None:
        """An object left the tier (deleted, evicted, expired, dropped as corrupt, cleared)."""
        ...

    def keys(self) -> list[bytes]:
        """The keys the watcher believes the tier holds (a tier that may have missed removals checks
        them and reports the ones gone)."""
        ...


class L2Tier(Protocol):
    """What the server needs from an L2 tier. Implementations: `DiskTier`, `ValkeyTier`."""

    name: str
    private: bool  # only this server writes it (a disk directory it locks), so the server may size it

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        """Store `value` under `key`, replacing any older object; atomic (the whole object or
        nothing is visible afterwards). Raises `TierError`."""
        ...

    def get(self, key: bytes) -> bytes | None:
        """The value stored under `key`; `None` if absent or corrupt (then dropped and counted).
        Raises `TierError` on an I/O or connection failure."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether the tier holds an object for it (without reading or checking
        it: a later `get` may still find it corrupt). Raises `TierError`."""
        ...

    def delete(self, key: bytes) -> None:
        """Remove the object under `key` if present. Raises `TierError`."""
        ...

    def clear(self) -> int:
        """Remove every object of this tier (only its own namespace on a shared server); how many it
        could not remove (0 when all went)."""
        ...

    def stats(self) -> TierStats:
        """Usage and counters; never raises (a tier that cannot ask its medium reports what it
        last knew and counts the error)."""
        ...

    def watch(self, watcher: TierWatcher) -> str | None:
        """From now on tell `watcher` of every object that enters or leaves the tier, whoever removes it;
        None once it does, else why it cannot (then it tells nothing)."""
        ...

    def close(self) -> None:
        """Release files and connections; the tier is unusable afterwards."""
        ...
