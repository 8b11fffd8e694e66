"""Write-behind: a background thread that copies objects into an L2 tier off the request path.

The server hands each object it stored in L1 to `submit`, which never blocks: when the bounded
queue is full the object is not queued, `submit` returns False and the drop is counted (the
object stays in L1; only its L2 copy is missing). A failed `put` is counted and logged, and the
thread goes on with the next object.

    submit(k, v) --> [ bounded queue: max_pending ] --> writer thread --> tier.put(k, v)
       | False when full: dropped += 1                     | TierError: failed += 1
    delete(k) ------^ (same queue, so in order with the puts)   --> tier.delete(k)
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from hybridkv.cache_server.tiers.base import L2Tier, RateLimitedWarnings, TierError

log = logging.getLogger(__name__)

_Item = tuple[bytes, bytes | memoryview | None] | None  # value None: delete; None: the writer thread exits


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteBehindStats:
    """Counters since the write-behind started."""

    pending: int  # submitted, not yet written or failed (queued + the one being written)
    written: int  # put into the tier
    failed: int  # put raised (TierError or an unexpected error)
    dropped: int  # refused by submit or delete (queue full or closed) or left unwritten at close
    deleted: int = 0  # deletions done (delete)


class WriteBehind:
    """Writes submitted objects into `tier` from one background thread, at most `max_pending`
    objects waiting. A value must not change after `submit` (pass `bytes`, or a memoryview of
    memory nobody writes until `flush`)."""

    def __init__(self, tier: L2Tier, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"write-behind max_pending must be >= 1, got {max_pending}")
        self.tier = tier
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max_pending)
        self._cond = threading.Condition()
        self._pending = 0
        self._written = 0
        self._failed = 0
        self._dropped = 0
        self._deleted = 0
        self._closed = False
        self._warnings = RateLimitedWarnings(log)
        self._thread = threading.Thread(target=self._run, name=f"write-behind-{tier.name}", daemon=True)
        self._thread.start()

    def submit(self, key: bytes, value: bytes | memoryview) -> bool:
        """Queue one object for the tier; False (and counted as dropped) if the queue is full or
        the write-behind is closed. Never blocks."""
        return self._enqueue(key, value)

    def delete(self, key: bytes) -> bool:
        """Queue the deletion of `key` from the tier, after every object submitted before it; False
        (counted as dropped) if the queue is full or closed. Never blocks."""
        return self._enqueue(key, None)

    def _enqueue(self, key: bytes, value: bytes | memoryview | None) -> bool:
        with self._cond:
            if self._closed:
                self._dropped += 1
                return False
            try:
                self._queue.put_nowait((key, value))
            except queue.Full:
                self._dropped += 1
                return False
            self._pending += 1
            return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every object submitted so far is written or failed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending > 0:
                left_s = deadline - time.monotonic()
                if left_s <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left_s)
            return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting objects, write what is queued (for at most `timeout_s`), stop the thread.
        Objects still unwritten then are counted as dropped. Does not close the tier."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout_s)
        with self._cond:
            left = self._pending
            self._dropped += left
            self._pending = 0
        # Unwritten objects are abandoned: empty the queue so the sentinel fits, then stop.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout=max(timeout_s, 0.1))
        if left:
            log.warning("write-behind to %s closed with %d objects unwritten", self.tier.name, left)

    def stats(self) -> WriteBehindStats:
        with self._cond:
            return WriteBehindStats(pending=self._pending, written=self._written, failed=self._failed,
                                    dropped=self._dropped, deleted=self._deleted)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, value = item
            ok = self._write(key, value)
            with self._cond:
                if self._pending == 0:  # abandoned by close() while it was being written
                    continue
                self._pending -= 1
                if ok and value is None:
                    self._deleted += 1
                elif ok:
                    self._written += 1
                else:
                    self._failed += 1
                if self._pending == 0:
                    self._cond.notify_all()

    def _write(self, key: bytes, value: bytes | memoryview | None) -> bool:
        op = "put" if value is not None else "delete"
        try:
            if value is None:
                self.tier.delete(key)
            else:
                self.tier.put(key, value)
        except TierError as e:
            self._warnings.warn(op, f"write-behind {op} in {self.tier.name} failed: {e}")
            return False
        except Exception:  # the thread must outlive a tier bug; the object is counted as failed
            log.exception("write-behind %s in %s raised unexpectedly", op, self.tier.name)
            return False
        return True
