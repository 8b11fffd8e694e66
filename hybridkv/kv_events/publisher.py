"""vLLM's KV event publisher: a PUB socket for the batches and a ROUTER socket that replays them
(wire.py has the format). Used by every hybridkv publisher: `hybridkv serve` / `run` (through
index/publisher.py's conversion of the manager's events) and `hybridkv server`'s tiers.

Like vLLM: the PUB socket binds when the endpoint has `*`, `::`, `ipc://` or `inproc://`, else
connects; sequence numbers run from 0; the last `buffer_steps` batches can be replayed.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from hybridkv.kv_events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    encode_batch,
)

__all__ = ["ANNOUNCE_EVERY", "ZmqPublisher"]

#: the layout announcement rides along every this many batches (a subscriber that joined late learns it)
ANNOUNCE_EVERY = 256


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """vLLM's PUB/ROUTER publisher: sequence numbers from 0, the last `buffer_steps` batches replayable."""

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 announce: Sequence[BlockStored] = ()) -> None:
        self.config = config
        self._announce = list(announce)
        self._rank = data_parallel_rank
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"cannot open the KV event endpoint {config.endpoint!r}: {e}") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.queued_batches = 0  # batches accepted for publishing: each gets the next sequence number
        if self._announce:
            self._queue.put_nowait(EventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank))
            self.queued_batches = 1
        self.dropped_batches = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The PUB endpoint actually bound (port 0 resolved)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        return None if self._replay is None else str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Queue one step's events (nothing when empty); a full queue drops the batch and counts it
        (the subscriber sees the sequence gap and recovers)."""
        if not events or not self._running:
            return
        try:
            self._queue.put_nowait(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
            self.queued_batches += 1
        except queue.Full:
            self.dropped_batches += 1

    def shutdown(self, timeout_s: float = 1.0) -> None:
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            if self._announce and self._seq % ANNOUNCE_EVERY == 0:
                batch.events[:0] = self._announce
            payload = encode_batch(batch)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                self.dropped_batches += 1
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
