"""Held lookups: a lookup's hit stays locked in L1 until its client retrieves or releases it, or its
time to live ends. Each lease is named by a random 63-bit id that only the client it was returned
to knows; any registration of the same layout may use it (the scheduler and the workers of one
vLLM engine register separately)."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.cache_server.limits import MAX_HELD_LOOKUPS, MAX_HELD_LOOKUPS_PER_REGISTRATION
from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.wire import ErrorCode


@dataclass(slots=True, kw_only=True)
class Lease:
    instance_id: int
    fingerprint: str  # any registration of this layout that holds the lookup id may retrieve it
    cache_salt: str
    hashes: list[bytes]  # of the hit's chunks
    locked: list[bytes]
    expires_at: float


class Leases:
    """The held lookups of a store; `unlock` frees one locked object, `on_expire` counts an expiry."""

    def __init__(self, unlock: Callable[[bytes], None], on_expire: Callable[[], None]) -> None:
        self._leases: dict[int, Lease] = {}
        self._held_by: Counter[int] = Counter()  # instance id -> its leases
        self._unlock = unlock
        self._on_expire = on_expire

    def __len__(self) -> int:
        return len(self._leases)

    def check_room(self, instance_id: int) -> None:
        """LIMIT when the server, or registration `instance_id`, holds as many lookups as it may."""
        if len(self._leases) >= MAX_HELD_LOOKUPS:
            raise RequestError(ErrorCode.LIMIT, f"the server holds {len(self._leases)} lookups, its limit; retrieve "
                               "or release held lookups (or wait for their time to live)")
        mine = self._held_by[instance_id]
        if mine >= MAX_HELD_LOOKUPS_PER_REGISTRATION:
            raise RequestError(ErrorCode.LIMIT, f"instance {instance_id} holds {mine} lookups, the limit per "
                               "registration; retrieve or release them first")

    def add(self, lease: Lease) -> int:
        """Hold `lease`; its new random id (never 0, never one held)."""
        while True:
            lookup_id = secrets.randbits(63)
            if lookup_id and lookup_id not in self._leases:
                self._leases[lookup_id] = lease
                self._held_by[lease.instance_id] += 1
                return lookup_id

    def held(self, lookup_id: int, *, fingerprint: str, instance_id: int) -> Lease:
        """The lease of `lookup_id` if a registration of the layout `fingerprint` made it; else
        UNKNOWN_LOOKUP (the same answer whether it never existed or belongs to another layout)."""
        lease = self._leases.get(lookup_id)
        if lease is None or lease.fingerprint != fingerprint:
            raise RequestError(ErrorCode.UNKNOWN_LOOKUP, f"lookup {lookup_id} is not held for instance "
                               f"{instance_id}'s layout (retrieved, released, expired, or never made)")
        return lease

    def take(self, lookup_id: int) -> Lease:
        """Stop holding `lookup_id` and hand its locked objects to the caller (who unlocks them)."""
        lease = self._leases.pop(lookup_id)
        self._held_by[lease.instance_id] -= 1
        if not self._held_by[lease.instance_id]:
            del self._held_by[lease.instance_id]
        return lease

    def release(self, lookup_id: int) -> None:
        for key in self.take(lookup_id).locked:
            self._unlock(key)

    def release_instance(self, instance_id: int) -> None:
        """Release every lookup made by `instance_id` (it unregistered or its owner went away)."""
        for lookup_id in [i for i, lease in self._leases.items() if lease.instance_id == instance_id]:
            self.release(lookup_id)

    def release_all(self) -> None:
        for lookup_id in list(self._leases):
            self.release(lookup_id)

    def expire(self) -> None:
        """Release the leases whose time to live has ended."""
        now = time.monotonic()
        for lookup_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self.release(lookup_id)
            self._on_expire()
