"""Valkey's own deletions, told to a `TierWatcher` through keyspace notifications.

Valkey drops objects without the server knowing: `maxmemory-policy` eviction, expiry, another
server's or an operator's DEL / UNLINK. With keyevent notifications on (`notify-keyspace-events`
holding E, and g for del, x for expired, e for evicted), a thread subscribes to

    __keyevent@DB__:del    __keyevent@DB__:expired    __keyevent@DB__:evicted

and tells the watcher each key of the tier's namespace (the namespace prefix taken off).
`ensure_notifications` turns the flags on with CONFIG SET when they are off; a server that refuses
CONFIG (a managed service, an ACL) gets a reason back, and the tier is then not watched at all.

Pub/sub delivers at most once: removals made while the subscription is down (a Valkey restart, a
subscriber that fell behind and was disconnected) are lost, and FLUSHDB / FLUSHALL send none. So
after every (re)subscription, and every `audit_every_s`, the keys the watcher believes the tier holds
are checked with EXISTS and the missing ones reported: a stale entry lives at most that long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from valkey.exceptions import ValkeyError

from hybridkv.cache_server.tiers.base import RateLimitedWarnings, TierError, TierWatcher

__all__ = ["KeyspaceWatch", "ensure_notifications"]

log = logging.getLogger(__name__)

EVENTS = ("del", "expired", "evicted")
FLAGS = "Egxe"  # keyevent channels; generic commands (del, unlink); expired; evicted
_ALL = "g$lshzxetd"  # what the flag A stands for
_AUDIT_BATCH = 1000


def ensure_notifications(client: Any) -> str | None:
    """Turn on the keyevent notifications `KeyspaceWatch` needs (added to what is set); None when
    they are on, else why they cannot be."""
    name = "notify-keyspace-events"
    try:
        reply = client.config_get(name)
        current = reply.get(name, reply.get(name.encode(), b""))
        current = current.decode() if isinstance(current, bytes) else str(current)
    except ValkeyError as e:
        return f"CONFIG GET {name} failed ({type(e).__name__}: {e})"
    have = set(current) | (set(_ALL) if "A" in current else set())
    missing = "".join(f for f in FLAGS if f not in have)
    if not missing:
        return None
    try:
        client.config_set(name, current + missing)
    except ValkeyError as e:
        return (f"{name} is {current!r}, without {missing!r}, and CONFIG SET failed ({type(e).__name__}: {e}); "
                f"set it to include {FLAGS!r} on the server")
    log.info("valkey tier: %s set to %r (was %r) to see the server's own deletions", name, current + missing,
             current)
    return None


class KeyspaceWatch:
    """A thread telling `watcher` of the deletions in namespace `prefix` of database `db`."""

    def __init__(self, client: Any, *, prefix: bytes, db: int, watcher: TierWatcher,
                 contains: Callable[[Sequence[bytes]], list[bool]], where: str, audit_every_s: float = 30.0,
                 retry_after_s: float = 1.0) -> None:
        self._client = client
        self._prefix = prefix
        self._channels = [f"__keyevent@{db}__:{event}" for event in EVENTS]
        self._watcher = watcher
        self._contains = contains
        self._where = where
        self._audit_every_s = audit_every_s
        self._retry_after_s = retry_after_s
        self._warnings = RateLimitedWarnings(log)
        self._stop = threading.Event()
        self.audits = 0  # (completed audits: tests wait on it)
        self._thread = threading.Thread(target=self._run, name="valkey-keyspace-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def audit(self) -> None:
        """Report the watcher's keys that the tier no longer holds. Raises TierError."""
        keys = self._watcher.keys()
        for start in range(0, len(keys), _AUDIT_BATCH):
            batch = keys[start : start + _AUDIT_BATCH]
            for key, held in zip(batch, self._contains(batch), strict=True):
                if not held:
                    self._watcher.removed(key)
        self.audits += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(*self._channels)
                self._listen(pubsub)
            except (ValkeyError, TierError, OSError) as e:
                self._warnings.warn("watch", f"valkey tier at {self._where}: keyspace notifications lost "
                                             f"({type(e).__name__}: {e}); resubscribing, then checking the published "
                                             "objects")
            finally:
                pubsub.close()
            self._stop.wait(self._retry_after_s)

    def _listen(self, pubsub: Any) -> None:
        self.audit()  # (what was removed before this subscription)
        next_audit = time.monotonic() + self._audit_every_s
        prefix, cut = self._prefix, len(self._prefix)
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=0.2)
            if message is not None and message.get("type") == "message":
                key = message.get("data")
                if isinstance(key, bytes) and key.startswith(prefix):
                    self._watcher.removed(key[cut:])
            if time.monotonic() >= next_audit:
                self.audit()
                next_audit = time.monotonic() + self._audit_every_s
