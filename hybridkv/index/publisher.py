"""Publish a hybridkv engine's KV events exactly as vLLM 0.32 does (events.py), so every consumer of
vLLM's stream (this index, Dynamo, llm-d, Mooncake's conductor) reads `hybridkv serve` / `run` too.

    engine step -> manager.take_events() -> wire_events() -> ZmqPublisher.publish(batch)
                                                              |  thread: PUB [topic, seq, payload]
                                                              |  ROUTER: replay from a sequence number

Like vLLM: the PUB socket binds when the endpoint has `*`, `::`, `ipc://` or `inproc://`, else
connects; block hashes go out as ints (the last 8 bytes of hybridkv's digest); a request's cache
salt goes out in `extra_keys` of its chain's first block (the index hashes it on arrival).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import zmq

from hybridkv.index.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    encode_batch,
)
from hybridkv.kvcache.events import AllBlocksCleared as CacheCleared
from hybridkv.kvcache.events import BlockRemoved as CacheRemoved
from hybridkv.kvcache.events import BlockStored as CacheStored
from hybridkv.kvcache.events import KVEvent
from hybridkv.plan.planner import KVCacheGroupSpec
from hybridkv.plan.specs import SpecKind

__all__ = ["ANNOUNCE_EVERY", "MEDIUM_GPU", "ZmqPublisher", "external_hash", "layout_events", "wire_events"]

#: the layout announcement rides along every this many batches (a subscriber that joined late learns it)
ANNOUNCE_EVERY = 256

MEDIUM_GPU = "GPU"
_KIND_NAMES = {SpecKind.FULL: "full_attention", SpecKind.SLIDING_WINDOW: "sliding_window",
               SpecKind.CHUNKED_LOCAL: "chunked_local_attention", SpecKind.MAMBA: "mamba",
               SpecKind.CROSS: "cross_attention"}


def external_hash(block_hash: bytes | int) -> int:
    """vLLM's default event hash: the digest's last 8 bytes as a big-endian int."""
    if isinstance(block_hash, int):
        return block_hash & ((1 << 64) - 1)
    return int.from_bytes(block_hash[-8:], "big")


def wire_events(events: Iterable[KVEvent], salts: Mapping[int, str] | None = None,
                medium: str = MEDIUM_GPU) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The manager's events as vLLM's; `salts` maps a chain's first external hash to its cache salt."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in events:
        if isinstance(e, CacheStored):
            hashes: list[int | bytes] = [external_hash(h) for h in e.block_hashes]
            salt = salts.get(external_hash(e.block_hashes[0])) if salts and e.parent_hash is None else None
            out.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if e.parent_hash is None else external_hash(e.parent_hash),
                token_ids=list(e.token_ids), block_size=e.block_size, lora_id=None, medium=medium,
                lora_name=None,
                extra_keys=[[salt]] + [None] * (len(hashes) - 1) if salt is not None else None,
                group_idx=int(e.group_id), kv_cache_spec_kind=_KIND_NAMES[e.kind],
                kv_cache_spec_sliding_window=e.window_tokens if e.kind is SpecKind.SLIDING_WINDOW else None))
        elif isinstance(e, CacheRemoved):
            removed: list[int | bytes] = [external_hash(h) for h in e.block_hashes]
            out.append(BlockRemoved(block_hashes=removed, medium=medium,
                                    group_idx=int(e.group_id)))
        elif isinstance(e, CacheCleared):
            out.append(AllBlocksCleared())
    return out


def layout_events(groups: Sequence[KVCacheGroupSpec], medium: str = MEDIUM_GPU) -> list[BlockStored]:
    """One empty `BlockStored` per KV cache group: its index, kind, window and block size.

    A consumer must know every group before it can promise a joint hit (a state group that has not
    stored a checkpoint yet still makes the hit 0); vLLM consumers skip empty events."""
    return [BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[], block_size=g.block_size, lora_id=None,
                        medium=medium, lora_name=None, group_idx=g.group_id, kv_cache_spec_kind=_KIND_NAMES[g.kind],
                        kv_cache_spec_sliding_window=g.window_tokens if g.kind is SpecKind.SLIDING_WINDOW else None)
            for g in groups]


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
