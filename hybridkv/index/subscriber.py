"""One ingest thread for every registered publisher: ZMQ SUB sockets, sequence numbers, recovery.

Per stream the next expected sequence number decides what a batch means:

    seq == expected        apply it
    seq >  expected        a gap (dropped messages, a late subscription): ask the replay endpoint for
                           [expected, seq); applied when it returns every missing batch, else the
                           registration's blocks are dropped (never a stale hit) and the stream resumes
    seq <  expected        a batch the new subscription's replay already applied, arriving over SUB
                           too (published between the SUB's connection and the replay): the same
                           payload, skipped; else the publisher restarted (its cache is new; PUB/SUB
                           never repeats a message): drop its blocks, then as a new stream (replay
                           from 0 when seq > 0)

A disconnection from the publisher (a ZMQ socket monitor) drops its blocks too and starts the
stream over: a restarted publisher's first batch that reaches us may carry exactly the number the
old stream expected next, which the numbers alone cannot tell from a continuation.

A new subscription first replays the publisher's buffer (what was published before it joined).
An idle stream is probed through its replay endpoint (a live publisher answers at once); a
publisher that answers no probe for `dead_after_s`, or, without a replay endpoint, sends nothing for
`dead_after_s`, is aged out: its blocks are dropped until it publishes again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zmq

from hybridkv.index.table import RegKey
from hybridkv.kv_events.wire import END_SEQ, EventBatch, WireError, decode_batch

__all__ = ["StreamCounts", "Subscriber"]

MAX_MESSAGE_BYTES = 16 << 20  # a batch is one engine step's events (a 32k-token prompt: ~150 KB)
RCV_HWM = 256  # messages queued per subscription: with the size cap, what a publisher can make the index hold
REPLAY_TIMEOUT_S = 0.5
MAX_REPLAY_BATCHES = 100_000
CATCH_UP_AFTER_S = 0.1  # (a new SUB socket takes a moment to receive: then ask for what it missed)
PROBE_SEQ = (1 << 63) - 1  # a replay request past every batch: the publisher answers the end marker alone


@dataclass(slots=True)
class StreamCounts:
    batches: int = 0
    gaps: int = 0
    replayed: int = 0
    resets: int = 0  # blocks dropped: unrecoverable gap, restart or ageing
    bad_messages: int = 0
    duplicates: int = 0  # batches the catch-up replay applied that arrived over SUB too (skipped)


@dataclass(slots=True)
class _Stream:
    key: RegKey
    sub: zmq.Socket[Any]
    replay_endpoint: str | None
    expected: int | None = None
    last_heard: float = field(default_factory=time.monotonic)
    last_probe: float = 0.0
    dead: bool = False
    monitor: zmq.Socket[Any] | None = None
    caught_up: bool = False
    replayed: dict[int, int] = field(default_factory=dict)  # catch-up: seq -> digest of its payload


Apply = Callable[[RegKey, EventBatch], None]
Reset = Callable[[RegKey], None]


class Subscriber:
    """Runs the ingest thread; `apply` and `reset` are called on it, under the caller's lock."""

    def __init__(self, apply: Apply, reset: Reset, lock: threading.Lock, *, probe_every_s: float = 2.0,
                 dead_after_s: float = 10.0) -> None:
        self._apply = apply
        self._reset = reset
        self._lock = lock
        self.probe_every_s = probe_every_s
        self.dead_after_s = dead_after_s
        self.counts = StreamCounts()
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._streams: dict[RegKey, _Stream] = {}
        self._by_socket: dict[Any, _Stream] = {}
        self._by_monitor: dict[Any, _Stream] = {}
        self._pending: list[tuple[str, RegKey, str, str | None]] = []
        self._pending_lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-index-ingest", daemon=True)
        self._thread.start()

    def add(self, key: RegKey, endpoint: str, replay_endpoint: str | None) -> None:
        with self._pending_lock:
            self._pending.append(("add", key, endpoint, replay_endpoint))

    def remove(self, key: RegKey) -> None:
        with self._pending_lock:
            self._pending.append(("remove", key, "", None))

    def next_seq(self, key: RegKey) -> int:
        """The sequence number of the next batch expected from `key`'s publisher (0: none heard yet)."""
        stream = self._streams.get(key)
        return (stream.expected or 0) if stream is not None else 0

    def alive(self, key: RegKey) -> bool:
        stream = self._streams.get(key)
        return stream is not None and not stream.dead

    def close(self) -> None:
        self._running = False
        self._thread.join(2.0)

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        while self._running:
            self._take_pending(poller)
            events = dict(poller.poll(50))
            for sock in events:
                stream = self._by_socket.get(sock)
                if stream is not None:
                    self._drain(stream)
                elif sock in self._by_monitor:
                    self._disconnected(self._by_monitor[sock])
            self._check_liveness()
        for stream in list(self._streams.values()):
            stream.sub.close(linger=0)

    def _take_pending(self, poller: zmq.Poller) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for op, key, endpoint, replay in pending:
            old = self._streams.pop(key, None)
            if old is not None:
                poller.unregister(old.sub)
                del self._by_socket[old.sub]
                if old.monitor is not None:
                    poller.unregister(old.monitor)
                    del self._by_monitor[old.monitor]
                    old.sub.disable_monitor()
                    old.monitor.close(linger=0)
                old.sub.close(linger=0)
            if op == "add":
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                sub.setsockopt(zmq.RCVHWM, RCV_HWM)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                stream = _Stream(key=key, sub=sub, replay_endpoint=replay,
                                 monitor=sub.get_monitor_socket(zmq.EVENT_DISCONNECTED))
                self._streams[key] = stream
                self._by_socket[sub] = stream
                self._by_monitor[stream.monitor] = stream
                poller.register(sub, zmq.POLLIN)
                poller.register(stream.monitor, zmq.POLLIN)

    def _drain(self, stream: _Stream) -> None:
        for _ in range(1000):  # (then let the other streams in)
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            stream.last_heard = time.monotonic()
            if stream.dead:
                stream.dead = False
            if len(frames) != 3 or len(frames[1]) != 8:
                self.counts.bad_messages += 1
                continue
            self._receive(stream, int.from_bytes(frames[1], "big"), frames[2])

    def _receive(self, stream: _Stream, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except WireError:
            self.counts.bad_messages += 1
            return
        expected = stream.expected
        if expected is not None and seq < expected and stream.replayed.get(seq) == xxhash.xxh3_64_intdigest(payload):
            self.counts.duplicates += 1
            return
        stream.replayed.clear()  # (SUB delivers in order: no replayed batch comes after a newer one)
        if expected is not None and seq < expected:  # (PUB/SUB never repeats a message: a restart)
            self._drop(stream)
            expected = None
        if seq > (expected or 0):
            self.counts.gaps += 1
            if not self._recover(stream, expected or 0, seq):
                self._drop(stream)
        with self._lock:
            self._apply(stream.key, batch)
            stream.expected = seq + 1  # (under the lock: a query sees the batch and its number together)
        self.counts.batches += 1

    def _disconnected(self, stream: _Stream) -> None:
        """The publisher went away (module docstring): its blocks go, its numbers start over."""
        assert stream.monitor is not None
        while True:
            try:
                stream.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        if stream.expected is not None:
            stream.expected = None
            self._drop(stream)

    def _drop(self, stream: _Stream) -> None:
        self.counts.resets += 1
        with self._lock:
            self._reset(stream.key)

    def _recover(self, stream: _Stream, start: int, until: int) -> bool:
        """Apply batches [start, until) from the replay endpoint; False when any is missing."""
        got = self._replay(stream, start, until)
        if got is None or [s for s, _, _ in got] != list(range(start, until)):
            return False
        with self._lock:
            for _, batch, _ in got:
                self._apply(stream.key, batch)
        self.counts.replayed += len(got)
        return True

    def _replay(self, stream: _Stream, start: int, until: int | None) -> list[tuple[int, EventBatch, int]] | None:
        """Batches [start, until) from the replay endpoint: (seq, batch, digest of its payload)."""
        if stream.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, EventBatch, int]] = []
        try:
            dealer.connect(stream.replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while len(got) <= MAX_REPLAY_BATCHES:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms):
                    return None
                frames = dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    return None
                if frames[1] == END_SEQ:
                    return got
                seq = int.from_bytes(frames[1], "big")
                if until is None or start <= seq < until:
                    got.append((seq, decode_batch(frames[2]), xxhash.xxh3_64_intdigest(frames[2])))
            return None
        except (zmq.ZMQError, WireError):
            return None
        finally:
            dealer.close(linger=0)

    def _catch_up(self, stream: _Stream) -> None:
        """A new subscription: what the publisher sent before it (its replay buffer), applied once."""
        stream.caught_up = True
        got = self._replay(stream, 0, None)
        if not got or stream.expected is not None:
            return
        with self._lock:
            for _, batch, _ in got:
                self._apply(stream.key, batch)
            stream.expected = got[-1][0] + 1
        self.counts.replayed += len(got)
        stream.replayed = {seq: digest for seq, _, digest in got}

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for stream in self._streams.values():
            if not stream.caught_up and stream.expected is None and now - stream.last_heard >= CATCH_UP_AFTER_S:
                self._catch_up(stream)
            if stream.dead or now - stream.last_heard < self.probe_every_s:
                continue
            if stream.replay_endpoint is not None and now - stream.last_probe >= self.probe_every_s:
                stream.last_probe = now
                if self._replay(stream, PROBE_SEQ, None) is not None:
                    stream.last_heard = now
                    continue
            if now - stream.last_heard >= self.dead_after_s:
                stream.dead = True
                stream.expected = None  # (its next batch starts a new stream: replay from 0 if it can)
                self._drop(stream)
