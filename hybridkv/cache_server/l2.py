"""The server's L2 tiers as one ordered set (disk before Valkey): write-behind from L1,
read-through on lookup, and fault accounting. A tier that fails (Valkey down) is counted and
treated as a miss; the server keeps serving from L1 and the other tiers, and the tier
reconnects on its next operation. Failures are logged at most once per 10 s per tier and
operation (with how many were left out), and every one is counted in `hybridkv_server_l2_errors`.

With `L2Sizing.RESUMABLE` each private tier that reports a capacity (the disk tier) gets a `TierSizer`
(l2_sizing.py): the server then decides what it deletes to fit each write, by resumable prefixes."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridkv.cache_server.l2_sizing import L2Sizing, SizerStats, TierSizer
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.prefix_index import ObjectPlace, PrefixRules
from hybridkv.cache_server.tiers.base import L2Tier, RateLimitedWarnings, TierError, TierStats
from hybridkv.cache_server.tiers.write_behind import WriteBehind

log = logging.getLogger(__name__)

WRITE_BEHIND_MAX_PENDING = 4096


class L2Listener(Protocol):
    """Told what the tiers hold (tier_events.py publishes it): a sized tier's content as the server
    decides it (`l2_stored` when queued, `l2_removed`, `l2_cleared`); a watched tier's as the tier
    reports it (`l2_queued` gives an object's place before its write, `l2_written` when the write is
    done, `l2_removed` whoever removed it, `l2_keys` what the listener holds of the tier)."""

    def l2_stored(self, tier: str, key: bytes, place: ObjectPlace | None) -> None: ...

    def l2_queued(self, tier: str, key: bytes, place: ObjectPlace | None) -> None: ...

    def l2_written(self, tier: str, key: bytes) -> None: ...

    def l2_removed(self, tier: str, key: bytes) -> None: ...

    def l2_cleared(self, tier: str) -> None: ...

    def l2_keys(self, tier: str) -> list[bytes]: ...


@dataclass(frozen=True, slots=True)
class _Watcher:
    """A `TierWatcher` for one tier, forwarding to the listener."""

    listener: L2Listener
    tier: str

    def written(self, key: bytes) -> None:
        self.listener.l2_written(self.tier, key)

    def removed(self, key: bytes) -> None:
        self.listener.l2_removed(self.tier, key)

    def keys(self) -> list[bytes]:
        return self.listener.l2_keys(self.tier)


@dataclass(slots=True)
class _Slot:
    tier: L2Tier
    writer: WriteBehind
    sizer: TierSizer | None  # None: the tier bounds itself (or is unbounded)
    watched: bool = False  # an unsized tier that reports its own writes and removals to the listener


class TierSet:
    """Not thread-safe beyond the tiers' own locks: the store calls it under its lock."""

    def __init__(self, tiers: Sequence[L2Tier], metrics: ServerMetrics,
                 sizing: L2Sizing = L2Sizing.OBJECTS, listener: L2Listener | None = None) -> None:
        self.sizing = sizing
        self._listener = listener  # (told of the sized tiers only: the others delete on their own too)
        self._slots = [_Slot(t, WriteBehind(t, WRITE_BEHIND_MAX_PENDING), self._sizer(t, sizing)) for t in tiers]
        self._metrics = metrics
        self._warnings = RateLimitedWarnings(log)
        for slot in self._slots:
            slot.watched = self._watch(slot)

    def _watch(self, slot: _Slot) -> bool:
        """Have an unsized tier report what enters and leaves it (its own evictions included), when
        there is a listener; else say why its objects go unpublished."""
        if self._listener is None or slot.sizer is not None:
            return False
        reason = slot.tier.watch(_Watcher(self._listener, slot.tier.name))
        if reason is not None:
            log.warning("%s; the %s tier's objects are not published as KV events (an index's DISK then falls "
                        "short of this server's lookup)", reason, slot.tier.name)
            return False
        return True

    @staticmethod
    def _sizer(tier: L2Tier, sizing: L2Sizing) -> TierSizer | None:
        if sizing is L2Sizing.OBJECTS or not tier.private:
            return None
        capacity = tier.stats().capacity_bytes
        if not capacity:
            return None
        return TierSizer(capacity)

    @property
    def names(self) -> list[str]:
        return [s.tier.name for s in self._slots]

    def __len__(self) -> int:
        return len(self._slots)

    def write_behind(self, key: bytes, value: memoryview, place: ObjectPlace | None = None) -> None:
        """Queue an object (just placed in L1, never written again) for every tier; a sized tier first
        gets the deletions that make room for it."""
        for slot in self._slots:
            if slot.sizer is not None:
                victims = slot.sizer.admit(key, value.nbytes, place)
                if victims is None:  # larger than the tier: the tier would refuse it
                    self._metrics.l2_write_dropped.labels(slot.tier.name).inc()
                    continue
                for victim in victims:
                    if not slot.writer.delete(victim):  # the tier's own bound stays the backstop
                        self._metrics.l2_write_dropped.labels(slot.tier.name).inc()
                    self._tell_removed(slot, victim)
            elif slot.watched and self._listener is not None:  # (published once the tier says it is written)
                self._listener.l2_queued(slot.tier.name, key, place)
            if not slot.writer.submit(key, value):
                self._metrics.l2_write_dropped.labels(slot.tier.name).inc()
                if slot.sizer is not None:
                    slot.sizer.forget(key)
            elif slot.sizer is not None and self._listener is not None:
                self._listener.l2_stored(slot.tier.name, key, place)

    def _tell_removed(self, slot: _Slot, key: bytes) -> None:
        if slot.sizer is not None and self._listener is not None:
            self._listener.l2_removed(slot.tier.name, key)

    @property
    def sized(self) -> bool:
        return any(slot.sizer is not None for slot in self._slots)

    @property
    def watched(self) -> bool:
        """Whether a tier reports its own writes and removals to the listener (tier_events.py)."""
        return any(slot.watched for slot in self._slots)

    def begin_store(self) -> None:
        """A store request starts (its objects do not make room for each other in a sized tier)."""
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.begin_store()

    # ---- what L1 tells the sized tiers (pool.PoolListener) -------------------------------------

    def placed(self, key: bytes, nbytes: int, place: ObjectPlace | None) -> None:
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.l1_placed(key, nbytes, place)

    def used(self, key: bytes) -> None:
        """The object was used (stored again, an L1 hit): it is recent in every sized tier too."""
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.touch(key)

    def dropped(self, key: bytes) -> None:
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.l1_dropped(key)

    def link_chain(self, rules: PrefixRules, first_chunk: int, parent_hash: bytes | None,
                   chunk_hashes: list[bytes]) -> None:
        """Chunks first_chunk.. of one request have these hashes (links the sized tiers' prefix trees)."""
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.link_chain(rules, first_chunk, parent_hash, chunk_hashes)

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
        if slot.sizer is not None:
            if value is None:  # gone (a failed write, the tier's own eviction, corruption)
                slot.sizer.forget(key)
                self._tell_removed(slot, key)
            else:
                slot.sizer.touch(key)
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
        if slot.sizer is not None:
            slot.sizer.forget(key)
            self._tell_removed(slot, key)
        try:
            slot.tier.delete(key)
        except TierError as e:
            self._error(slot, "delete", e)

    def clear(self) -> list[str]:
        """Clear every tier; what could not be cleared, one sentence per tier (empty: all went)."""
        problems: list[str] = []
        for slot in self._slots:
            slot.writer.flush(timeout_s=10.0)
            if slot.sizer is not None:
                slot.sizer.clear()
                if self._listener is not None:
                    self._listener.l2_cleared(slot.tier.name)
            try:
                remaining = slot.tier.clear() or 0
            except TierError as e:
                self._error(slot, "clear", e)
                problems.append(f"the {slot.tier.name} tier could not be cleared: {e}")
                continue
            if remaining:
                problems.append(f"the {slot.tier.name} tier could not delete {remaining} objects; they remain on it "
                                "(not served until a restart finds them again)")
        return problems

    def flush(self, timeout_s: float) -> bool:
        return all(slot.writer.flush(timeout_s) for slot in self._slots)

    def stats(self) -> list[TierStats]:
        return [slot.tier.stats() for slot in self._slots]

    def sizer_stats(self) -> list[SizerStats | None]:
        """Per tier: what the server placed there, by resumable prefixes (None: not sized). Call it under
        the store's lock (the sizers change with every request)."""
        return [slot.sizer.stats() if slot.sizer is not None else None for slot in self._slots]

    def describe(self, sized: list[SizerStats | None]) -> list[dict[str, object]]:
        """Each tier as `/status` shows it (`sized`: `sizer_stats()`, taken under the store's lock)."""
        pending = self.pending()
        out: list[dict[str, object]] = []
        for z, s in zip(sized, self.stats(), strict=True):
            entry: dict[str, object] = {
                "name": s.name, "objects": s.objects, "bytes_used": s.bytes_used, "capacity_bytes": s.capacity_bytes,
                "evictions": s.evictions, "errors": s.errors, "corrupt_dropped": s.corrupt_dropped,
                "write_behind_pending": pending.get(s.name, 0), "sizing": L2Sizing.OBJECTS.value}
            if z is not None:
                entry.update(sizing=L2Sizing.RESUMABLE.value, sized_bytes=z.bytes_used, sized_objects=z.objects,
                             sized_evictions=z.evictions, resumable_prefixes=z.resumable_prefixes,
                             dead_objects=z.dead_objects, dead_bytes=z.dead_bytes, state_bytes=z.state_bytes,
                             attention_bytes=z.attention_bytes)
            out.append(entry)
        return out

    def check_integrity(self) -> None:
        for slot in self._slots:
            if slot.sizer is not None:
                slot.sizer.check_integrity()

    def pending(self) -> dict[str, int]:
        return {slot.tier.name: slot.writer.stats().pending for slot in self._slots}

    def close(self, timeout_s: float = 30.0) -> None:
        for slot in self._slots:
            slot.writer.close(timeout_s)
            slot.tier.close()

    def _error(self, slot: _Slot, op: str, e: TierError) -> None:
        self._metrics.l2_errors.labels(slot.tier.name).inc()
        self._warnings.warn(f"{slot.tier.name}:{op}", f"L2 tier {slot.tier.name}: {op} failed: {e}")
