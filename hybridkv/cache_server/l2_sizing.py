"""Sizing the L2 tiers by resumable prefixes (`--l2-sizing`).

A hit needs, for each object group, its rule's objects (prefix_index.py): an attention chunk whose
state is gone, or a state whose attention chain lost its first chunk, is dead bytes in a tier as
much as in L1. A bounded tier left to itself (`objects`) evicts object by object, least recently
written or read *there* first: a chain's first chunks were written first and are read from L2 only
when L1 lost them, so the tier drops the heads of the prefixes L1 serves most and keeps their
tails, states and window objects, which no lookup can use any more.

With `resumable` the server keeps each bounded tier that only it writes (the disk tier: one server
per directory) within its capacity itself, counting what the tier stores (the object's frame), so the
tier's own eviction never has to run. It holds a prefix index (prefix_index.py, as L1's) of the
objects in L1 *or* in the tier, since a lookup reads each object from either, and, to fit a new
object, deletes from the tier (never the objects of the store in progress while others are left: a
prefill's chunks are dead until its state, its last object, arrives):

    1. dead objects (no prefix L1 and the tier can serve needs them), least recently used first;
    2. in a state layout, the least recently used resumable prefix as a unit: the objects only it
       needs, tail first (its state, then its own attention chain back to where another prefix
       shares it), so a state leaves with the attention chunks it makes usable;
    3. then any object, least recently used first.

An object's recency is its last use anywhere in the server (a store, an L1 hit, a read from the
tier) or the moment L1 let it go (the tier's copy then became the only one), so the tier keeps the
prefixes that are used and the ones L1 just lost, not whatever was written last. The budget
the state objects get is not fixed: it follows the observed bytes of the resumable prefixes (a
state layout's prefix costs its state plus its chain), which `/status` reports per tier as
`state_bytes` and `attention_bytes` beside `resumable_prefixes`.

The sizer's view is the server's: objects a tier holds from an earlier run (the disk tier after a
restart) are not in it and are left to the tier's own eviction, which the tier still runs as its
bound; a write that failed is forgotten when a read misses it. Valkey is not sized: servers on
many machines share it, and one server's deletions would be the others' misses (Valkey bounds
itself with its `maxmemory-policy`). Deletions travel through the tier's write-behind queue, in
order with the writes: ahead of the write they make room for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hybridkv.cache_server.l1_eviction import L1ResumablePolicy
from hybridkv.cache_server.prefix_index import ObjectPlace, PrefixIndex, PrefixRules
from hybridkv.cache_server.tiers import framing
from hybridkv.errors import IntegrityError


class L2Sizing(Enum):
    OBJECTS = "objects"  # each tier bounds itself, object by object (its own LRU)
    RESUMABLE = "resumable"  # the server bounds each bounded tier by resumable prefixes


def frame_bytes(key: bytes, value_bytes: int) -> int:
    """What a tier stores for one object: its frame (header, key, value)."""
    return framing.HEADER_BYTES + len(key) + value_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SizerStats:
    budget_bytes: int
    bytes_used: int  # frames of the objects the sizer placed in the tier
    objects: int
    evictions: int  # objects the sizer deleted to make room
    resumable_prefixes: int  # prefixes L1 and this tier together serve as a hit
    dead_objects: int  # objects in the tier that no such prefix needs
    dead_bytes: int
    state_bytes: int  # frames in the tier of state objects
    attention_bytes: int  # frames in the tier of every other object


@dataclass(slots=True)
class _Object:
    nbytes: int  # its frame
    state: bool
    in_tier: bool = False
    in_l1: bool = False


class TierSizer:
    """The server's view of one bounded tier and which objects to delete so a new one fits.

    A lookup reads each object from L1 or from a tier, so the prefix tree holds the objects in L1 *or* in
    this tier: an attention chunk in the tier whose state is in L1 is live, and one whose chain lost its
    first chunk in both is dead. Not thread-safe: the store calls it under its lock."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"L2 sizing budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._index = PrefixIndex()
        self._policy = L1ResumablePolicy(self._index)
        self._objects: dict[bytes, _Object] = {}  # in L1 or in the tier
        self._used = 0
        self._state_bytes = 0
        self._tier_objects = 0
        self._evictions = 0
        self._batch: set[bytes] = set()  # admitted by the store request in progress

    def __contains__(self, key: bytes) -> bool:
        """Whether the sizer placed `key` in the tier (and has not deleted it)."""
        obj = self._objects.get(key)
        return obj is not None and obj.in_tier

    # ---- L1's side ----------------------------------------------------------------------------

    def l1_placed(self, key: bytes, value_bytes: int, place: ObjectPlace | None) -> None:
        obj = self._track(key, value_bytes, place)
        obj.in_l1 = True

    def l1_dropped(self, key: bytes) -> None:
        """L1 let the object go: the tier's copy, if any, is now the only one, so it counts as just used
        (measured: +31% hits on branching traces, where old prefixes come back, and +3-8% elsewhere)."""
        obj = self._objects.get(key)
        if obj is not None:
            obj.in_l1 = False
            if obj.in_tier:
                self.touch(key)
            self._untrack(key, obj)

    def touch(self, key: bytes) -> None:
        """The object was used somewhere in the server (stored again, an L1 hit, read from the tier)."""
        if key in self._objects:
            self._policy.touch(key)
            self._index.touch(key)

    # ---- the tier's side ----------------------------------------------------------------------

    def begin_store(self) -> None:
        """A store request starts: what it admits is not chosen to make room for the rest of it (a
        prefill's attention chunks are dead until its state, the last object, arrives)."""
        self._batch.clear()

    def admit(self, key: bytes, value_bytes: int, place: ObjectPlace | None) -> list[bytes] | None:
        """Record `key` as written to the tier next; returns the keys to delete from the tier before
        writing it, or None when it cannot fit (its frame is larger than the budget)."""
        obj = self._track(key, value_bytes, place)
        if obj.nbytes > self.budget_bytes:
            self._untrack(key, obj)
            return None
        self._leave_tier(obj)
        victims: list[bytes] = []
        while self._used + obj.nbytes > self.budget_bytes:
            victim = self._victim(key)
            self.forget(victim)
            self._evictions += 1
            victims.append(victim)
        obj.in_tier = True
        self._batch.add(key)
        self._used += obj.nbytes
        self._state_bytes += obj.nbytes if obj.state else 0
        self._tier_objects += 1
        return victims

    def _victim(self, key: bytes) -> bytes:
        """The first object in the tier in the policy's order, outside the store in progress if it can."""
        fallback: bytes | None = None
        for k in self._policy.order():
            if k == key or not self._objects[k].in_tier:
                continue
            if k not in self._batch:
                return k
            fallback = fallback or k
        assert fallback is not None  # _used > 0 with `key` out of the tier: another object is in it
        return fallback

    def forget(self, key: bytes) -> None:
        """The tier no longer holds `key` (deleted, found missing or corrupt)."""
        obj = self._objects.get(key)
        if obj is not None:
            self._leave_tier(obj)
            self._batch.discard(key)
            self._untrack(key, obj)

    def clear(self) -> None:
        for key in list(self._objects):
            self.forget(key)

    # ---- bookkeeping --------------------------------------------------------------------------

    def _track(self, key: bytes, value_bytes: int, place: ObjectPlace | None) -> _Object:
        obj = self._objects.get(key)
        if obj is None:
            state = place is not None and place.object_group in place.rules.state_object_groups
            obj = self._objects[key] = _Object(nbytes=frame_bytes(key, value_bytes), state=state)
            self._policy.insert(key)
            self._index.insert(key, obj.nbytes, place)
        return obj

    def _untrack(self, key: bytes, obj: _Object) -> None:
        if not obj.in_tier and not obj.in_l1:
            del self._objects[key]
            self._policy.remove(key)
            self._index.remove(key)

    def _leave_tier(self, obj: _Object) -> None:
        if obj.in_tier:
            obj.in_tier = False
            self._used -= obj.nbytes
            self._state_bytes -= obj.nbytes if obj.state else 0
            self._tier_objects -= 1

    def link_chain(self, rules: PrefixRules, first_chunk: int, parent_hash: bytes | None,
                   chunk_hashes: list[bytes]) -> None:
        self._index.link_chain(rules, first_chunk, parent_hash, chunk_hashes)

    def stats(self) -> SizerStats:
        dead = [self._objects[k] for k in self._index.dead_keys() if self._objects[k].in_tier]
        return SizerStats(budget_bytes=self.budget_bytes, bytes_used=self._used, objects=self._tier_objects,
                          evictions=self._evictions, resumable_prefixes=self._index.stats().resumable_prefixes,
                          dead_objects=len(dead), dead_bytes=sum(o.nbytes for o in dead),
                          state_bytes=self._state_bytes, attention_bytes=self._used - self._state_bytes)

    def check_integrity(self) -> None:
        self._index.check_integrity()
        tier = [o for o in self._objects.values() if o.in_tier]
        used, state = sum(o.nbytes for o in tier), sum(o.nbytes for o in tier if o.state)
        if (used, state, len(tier)) != (self._used, self._state_bytes, self._tier_objects) or used > self.budget_bytes \
                or any(not o.in_tier and not o.in_l1 for o in self._objects.values()):
            raise IntegrityError(f"L2 sizer: {self._used} bytes ({self._state_bytes} state) in {self._tier_objects} "
                                 f"objects counted, recounted {used} ({state}) in {len(tier)}; budget "
                                 f"{self.budget_bytes}")
