"""The server's L2 tiers as one ordered set (disk before Valkey): write-behind from L1,
read-through on lookup, and fault accounting. A tier that fails (Valkey down) is counted and
treated as a miss; the server keeps serving from L1 and the other tiers, and the tier
reconnects on its next operation. Failures are logged at most once per 10 s per tier and
operation (with how many were left out), and every one is counted in `hybridkv_server_l2_errors`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.tiers.base import L2Tier, RateLimitedWarnings, TierError, TierStats
from hybridkv.cache_server.tiers.write_behind import WriteBehind

log = logging.getLogger(__name__)

WRITE_BEHIND_MAX_PENDING = 4096


@dataclass(slots=True)
class _Slot:
    tier: L2Tier
    writer: WriteBehind


class TierSet:
    def __init__(self, tiers: Sequence[L2Tier], metrics: ServerMetrics) -> None:
        self._slots = [_Slot(t, WriteBehind(t, WRITE_BEHIND_MAX_PENDING)) for t in tiers]
        self._metrics = metrics
        self._warnings = RateLimitedWarnings(log)

    @property
    def names(self) -> list[str]:
        return [s.tier.name for s in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    def write_behind(self, key: bytes, value: memoryview) -> None:
        """Queue an object (just placed in L1, never written again) for every tier."""
        for slot in self._slots:
            if not slot.writer.submit(key, value):
                self._metrics.l2_write_dropped.labels(slot.tier.name).inc()

    def where(self, keys: Sequence[bytes]) -> list[int | None]:
        """For each key, the index of the first tier holding it (None: no tier)."""
        found: list[int | None] = [None] * len(keys)
        for i, slot in enumerate(self._slots):
            todo = [n for n, f in enumerate(found) if f is None]
            if not todo:
                break
            try:
                held = slot.tier.contains([keys[n] for n in todo])
            except TierError as e:
                self._error(slot, "contains", e)
                continue
            for n, h in zip(todo, held, strict=True):
                if h:
                    found[n] = i
        return found

    def get(self, tier: int, key: bytes, expected_bytes: int) -> bytes | None:
        """The object from tier `tier`, or None (absent, corrupt, wrong size, tier down)."""
        slot = self._slots[tier]
        try:
            value = slot.tier.get(key)
        except TierError as e:
            self._error(slot, "get", e)
            return None
        if value is not None and len(value) != expected_bytes:
            log.warning("%s: object of %d bytes where %d were expected; dropped", slot.tier.name, len(value),
                        expected_bytes)
            self._metrics.l2_errors.labels(slot.tier.name).inc()
            self._delete(slot, key)
            return None
        if value is not None:
            self._metrics.l2_promotions.labels(slot.tier.name).inc()
        return value

    def _delete(self, slot: _Slot, key: bytes) -> None:
        try:
            slot.tier.delete(key)
        except TierError as e:
            self._error(slot, "delete", e)

    def clear(self) -> None:
        for slot in self._slots:
            slot.writer.flush(timeout_s=10.0)
            try:
                slot.tier.clear()
            except TierError as e:
                self._error(slot, "clear", e)

    def flush(self, timeout_s: float) -> bool:
        return all(slot.writer.flush(timeout_s) for slot in self._slots)

    def stats(self) -> list[TierStats]:
        return [slot.tier.stats() for slot in self._slots]

    def describe(self) -> list[dict[str, object]]:
        """Each tier as `/status` shows it."""
        pending = self.pending()
        return [{"name": s.name, "objects": s.objects, "bytes_used": s.bytes_used, "capacity_bytes": s.capacity_bytes,
                 "evictions": s.evictions, "errors": s.errors, "corrupt_dropped": s.corrupt_dropped,
                 "write_behind_pending": pending.get(s.name, 0)} for s in self.stats()]

    def pending(self) -> dict[str, int]:
        return {slot.tier.name: slot.writer.stats().pending for slot in self._slots}

    def close(self, timeout_s: float = 30.0) -> None:
        for slot in self._slots:
            slot.writer.close(timeout_s)
            slot.tier.close()

    def _error(self, slot: _Slot, op: str, e: TierError) -> None:
        self._metrics.l2_errors.labels(slot.tier.name).inc()
        self._warnings.warn(f"{slot.tier.name}:{op}", f"L2 tier {slot.tier.name}: {op} failed: {e}")
