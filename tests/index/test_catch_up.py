"""A new subscription's catch-up replay and its SUB socket can both deliver a batch published between
the SUB's connection and the replay: the second copy is the same batch, not a restarted publisher
(which would drop the instance's blocks and, for a replay of several batches, lose the earlier ones)."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq

from hybridkv.index.subscriber import Subscriber
from hybridkv.index.table import RegKey
from hybridkv.kv_events.wire import END_SEQ, EventBatch, encode_batch
from tests.index.test_index_service import stored, wait_for

KEY: RegKey = ("default", "e0", 0)


def test_a_batch_from_both_the_replay_and_sub_is_applied_once() -> None:
    ctx: zmq.Context[Any] = zmq.Context.instance()
    xpub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # (XPUB: sees the subscriber join)
    xpub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    applied: list[int] = []
    resets: list[RegKey] = []
    sub = Subscriber(lambda key, batch: applied.append(len(batch.events)), resets.append, threading.Lock())
    try:
        sub.add(KEY, xpub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT))
        assert xpub.poll(10_000) and xpub.recv() == b"\x01"  # (the SUB is connected and subscribed)
        assert router.poll(10_000)  # (nothing heard: the catch-up asks for everything from 0)
        client, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        payloads = [encode_batch(EventBatch(ts=float(i), events=[stored([1, 2, 3, 4])] * (i + 1))) for i in range(3)]
        for seq in (1, 2):  # (published after the SUB joined: on their way over SUB too)
            xpub.send_multipart((b"", seq.to_bytes(8, "big"), payloads[seq]))
        time.sleep(0.2)
        for seq, payload in enumerate(payloads):
            router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((client, b"", END_SEQ, b""))
        wait_for(lambda: sub.counts.replayed == 3 and sub.counts.duplicates == 2, timeout_s=10)
        assert applied == [1, 2, 3] and not resets and sub.next_seq(KEY) == 3
        xpub.send_multipart((b"", (3).to_bytes(8, "big"), payloads[0]))  # (the next batch: applied)
        wait_for(lambda: len(applied) == 4, timeout_s=10)
        xpub.send_multipart((b"", (1).to_bytes(8, "big"), payloads[2]))  # (an old number, new content: a restart)
        wait_for(lambda: len(resets) == 1, timeout_s=10)
    finally:
        sub.close()
        xpub.close(linger=0)
        router.close(linger=0)
