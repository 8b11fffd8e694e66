"""The Valkey/Redis L2 tier: the cache many engines on many machines share.

Each object is one string value, framed like every tier's objects (framing.py: magic, format
version, key, length, xxh3 checksum), under `hybridkv:<namespace>:` + the object key, so several
caches (or other programs) can share one server. A value that fails its check is deleted (unless
rewritten meanwhile) and counted; one of another format version is left alone.

Every command failure (connection refused, timeout, an error reply) is counted and raised as
`TierError`. Connections come from the client's pool, which drops a connection on error and checks
a pooled one before use, so the tier works again as soon as the server is back. After a connection
failure or timeout the tier does not touch the network for `retry_after_s`: commands fail at once
(counted), so a server that vanished without closing its sockets costs one `timeout_s`, not one
per request.

`stats()` counts the namespace with SCAN (cached for `stats_refresh_s`, since that is O(keys));
Valkey evicts on its own (maxmemory-policy), so `evictions` stays 0 and `capacity_bytes` is the
server's `maxmemory` (None when unset). `watch` (the server's KV events) sees those deletions through
keyspace notifications (valkey_watch.py).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import valkey
from valkey.exceptions import ConnectionError as ValkeyConnectionError
from valkey.exceptions import TimeoutError as ValkeyTimeoutError
from valkey.exceptions import ValkeyError

from hybridkv.cache_server.tiers import framing
from hybridkv.cache_server.tiers.base import RateLimitedWarnings, TierError, TierStats, TierWatcher
from hybridkv.cache_server.tiers.valkey_watch import KeyspaceWatch, ensure_notifications
from hybridkv.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "valkey", "valkeys")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SCAN_BATCH = 1000
# Delete a value found corrupt only if it still starts with the header that was read.
_DROP_IF_UNCHANGED = (
    f"if redis.call('GETRANGE', KEYS[1], 0, {framing.HEADER_BYTES - 1}) == ARGV[1] then "
    "return redis.call('DEL', KEYS[1]) end return 0"
)

T = TypeVar("T")


def _execute(pipe: Any) -> list[int]:
    """Run a pipeline of integer replies (the client's pipeline is untyped)."""
    return cast(list[int], pipe.execute())


class ValkeyTier:
    """An `L2Tier` on a Valkey or Redis server at `url` (redis://, rediss://, valkey://, valkeys://)."""

    name = "valkey"
    private = False  # shared by servers on many machines: each one's deletions would be the others' misses

    def __init__(self, url: str, *, namespace: str = "kv", timeout_s: float = 2.0, retry_after_s: float = 1.0,
                 stats_refresh_s: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ConfigError(f"Valkey URL {url!r} must look like redis://HOST:PORT[/DB] "
                              f"(schemes: {', '.join(SCHEMES)})")
        if not _NAMESPACE.fullmatch(namespace):
            raise ConfigError(f"Valkey namespace {namespace!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if timeout_s <= 0 or retry_after_s < 0:
            raise ConfigError(f"Valkey timeout must be > 0 s and retry-after >= 0 s, got {timeout_s} and "
                              f"{retry_after_s}")
        self.url = url
        self.where = f"{parts.hostname}:{parts.port or 6379}"  # for messages: never the password
        self._prefix = f"hybridkv:{namespace}:".encode()
        self._client = valkey.Valkey.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._retry_after_s = retry_after_s
        self._down_until = -float("inf")  # monotonic time before which commands fail without trying
        self._drop_script = self._client.register_script(_DROP_IF_UNCHANGED)
        self._stats_refresh_s = stats_refresh_s
        self._lock = threading.Lock()  # counters
        self._warnings = RateLimitedWarnings(log)
        self._stats_lock = threading.Lock()  # one namespace scan at a time
        self._errors = 0
        self._corrupt_dropped = 0
        self._counted_at = -float("inf")
        self._objects = 0
        self._bytes_used = 0
        self._capacity_bytes: int | None = None
        self._watcher: TierWatcher | None = None
        self._watch: KeyspaceWatch | None = None

    # --- the L2Tier protocol -------------------------------------------------------------------

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        frame = framing.encode(key, value)
        self._call("SET", lambda: self._client.set(self._prefix + key, frame))
        if self._watcher is not None:
            self._watcher.written(key)

    def get(self, key: bytes) -> bytes | None:
        frame = self._call("GET", lambda: self._client.get(self._prefix + key))
        if frame is None:
            return None
        assert isinstance(frame, bytes)  # decode_responses is off
        try:
            return framing.decode(frame, expected_key=key)
        except framing.FrameVersionError:
            return None
        except framing.FrameError as e:
            log.warning("valkey tier: dropping corrupt object %r at %s: %s", key[:32], self.where, e)
            header = frame[: framing.HEADER_BYTES]
            self._call("EVAL", lambda: self._drop_script(keys=[self._prefix + key], args=[header]))
            with self._lock:
                self._corrupt_dropped += 1
            return None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def exists() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._prefix + k)
            return _execute(pipe)

        return [bool(n) for n in self._call("EXISTS", exists)]

    def delete(self, key: bytes) -> None:
        self._call("DEL", lambda: self._client.delete(self._prefix + key))

    def clear(self) -> int:
        """Unlink every key of this server's namespace (never another's); 0, or TierError."""

        def unlink_namespace() -> None:
            batch: list[bytes] = []
            for k in self._client.scan_iter(match=self._prefix + b"*", count=_SCAN_BATCH):
                batch.append(k)
                if len(batch) == _SCAN_BATCH:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)

        self._call("SCAN/UNLINK", unlink_namespace)
        self._counted_at = -float("inf")
        return 0

    def stats(self) -> TierStats:
        with self._stats_lock:
            if time.monotonic() - self._counted_at >= self._stats_refresh_s:
                try:
                    self._count_namespace()
                except TierError as e:
                    self._warnings.warn("stats", f"valkey tier stats: {e}")
        with self._lock:
            return TierStats(name=self.name, objects=self._objects, bytes_used=self._bytes_used,
                             capacity_bytes=self._capacity_bytes, errors=self._errors,
                             corrupt_dropped=self._corrupt_dropped, evictions=0)

    def watch(self, watcher: TierWatcher) -> str | None:
        """Tell `watcher` of this server's completed writes, and of every deletion in the namespace (Valkey's
        eviction and expiry, anyone's DEL) through keyspace notifications (valkey_watch.py); why not
        when the notifications cannot be turned on."""
        reason = ensure_notifications(self._client)
        if reason is not None:
            return f"valkey tier at {self.where}: {reason}"
        db = int(self._client.connection_pool.connection_kwargs.get("db", 0) or 0)
        self._watcher = watcher
        self._watch = KeyspaceWatch(self._client, prefix=self._prefix, db=db, watcher=watcher, contains=self.contains,
                                    where=self.where, retry_after_s=max(0.1, self._retry_after_s))
        return None

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._client.close()  # type: ignore[no-untyped-call]

    def ping(self) -> bool:
        """Whether the server answers now (counts nothing: for start-up and health reports); an
        answer ends the retry-after pause."""
        try:
            alive = bool(self._client.ping())
        except ValkeyError:
            return False
        with self._lock:
            self._down_until = -float("inf")  # back: the next command tries at once
        return alive

    # --- internals ------------------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        with self._lock:
            wait_s = self._down_until - time.monotonic()
            if wait_s > 0:
                self._errors += 1
                raise TierError(f"valkey {op} at {self.where} skipped: the server was unreachable, next try "
                                f"in {wait_s:.2f} s")
        try:
            return fn()
        except ValkeyError as e:
            with self._lock:
                self._errors += 1
                if isinstance(e, ValkeyConnectionError | ValkeyTimeoutError):
                    self._down_until = time.monotonic() + self._retry_after_s
            raise TierError(f"valkey {op} at {self.where} failed: {type(e).__name__}: {e}") from e

    def _count_namespace(self) -> None:
        def count() -> tuple[int, int, int | None]:
            objects = bytes_used = 0
            pipe = self._client.pipeline(transaction=False)
            for k in self._client.scan_iter(match=self._prefix + b"*", count=_SCAN_BATCH):
                pipe.strlen(k)
                objects += 1
                if len(pipe) == _SCAN_BATCH:
                    bytes_used += sum(_execute(pipe))
            bytes_used += sum(_execute(pipe))
            memory = cast(dict[str, object], self._client.info("memory"))
            maxmemory = int(cast(int, memory.get("maxmemory", 0)))
            return objects, bytes_used, maxmemory or None

        objects, bytes_used, capacity = self._call("SCAN/STRLEN", count)
        with self._lock:
            self._objects, self._bytes_used, self._capacity_bytes = objects, bytes_used, capacity
        self._counted_at = time.monotonic()
