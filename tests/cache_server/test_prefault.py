"""The server prefaults an engine's segments for writing on a helper thread (shm.py): it never writes a
byte of the engine's KV, never allocates a segment's holes, and an unregistration in the middle of it
stops it within a slice."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from hybridkv.cache_server import shm
from hybridkv.cache_server.shm import MappedBuffers
from hybridkv.connector.client import SharedKVBuffers, make_layout
from hybridkv.connector.segments import create_segment
from hybridkv.wire import BufferLayout, GroupKind, GroupLayout, Layout

pytestmark = pytest.mark.skipif(not shm.POPULATE_WRITE, reason="MADV_POPULATE_WRITE needs Linux 5.14+")

PAGE = 1 << 20


def _layout(buffers: SharedKVBuffers | list[BufferLayout], num_blocks: int) -> Layout:
    group = GroupLayout(kind=GroupKind.FULL, num_layers=1, block_tokens=16, page_bytes=PAGE)
    return make_layout(model="m", groups=[group], buffers=buffers, num_blocks=num_blocks, page_stride_bytes=PAGE)


def test_prefaulting_writes_no_byte_while_the_engine_writes() -> None:
    blocks = 192
    buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=blocks * PAGE)
    kv = buffers.arrays[0]
    kv[:] = 7
    stop = threading.Event()
    rounds = []

    def engine() -> None:  # rewrites every block with the round's value, over and over
        value = 0
        while not stop.is_set():
            value = value % 250 + 1
            for b in range(blocks):
                kv[b * PAGE:(b + 1) * PAGE] = value
            rounds.append(value)

    writer = threading.Thread(target=engine)
    writer.start()
    try:
        mapped = MappedBuffers(_layout(buffers, blocks), buffers.fds)
        assert mapped.prefaulter is not None
        assert mapped.prefaulter.done.wait(60)
        assert not mapped.prefaulting
    finally:
        stop.set()
        writer.join()
    # the engine's last round is what both views hold: no write of it was lost to the prefault
    assert rounds and np.all(kv == rounds[-1])
    assert np.all(mapped.page(0, blocks - 1, PAGE) == rounds[-1])
    mapped.close()
    buffers.close()


def test_a_segment_with_holes_is_not_prefaulted() -> None:
    size = 64 * PAGE
    fd = create_segment("holes", size)  # never written: no page allocated
    try:
        mapped = MappedBuffers(_layout([BufferLayout(shm_name="holes", size_bytes=size)], 64), [fd])
        assert mapped.prefaulter is None and not mapped.prefaulting
        assert os.fstat(fd).st_blocks == 0  # prefaulting would have allocated all 64 MiB for the client
        mapped.close()
    finally:
        os.close(fd)


def test_closing_during_the_prefault_stops_it_within_a_slice() -> None:
    blocks = 1024  # 1 GiB: hundreds of milliseconds of prefaulting
    buffers = SharedKVBuffers.create(num_buffers=1, size_bytes=blocks * PAGE)
    mapped = MappedBuffers(_layout(buffers, blocks), buffers.fds)
    t0 = time.perf_counter()
    mapped.close()
    waited = time.perf_counter() - t0
    assert mapped.prefaulter is not None and mapped.prefaulter.done.is_set()
    print(f"close waited {waited * 1e3:.1f} ms for the prefault to stop")
    assert waited < 2.0  # one 32 MiB slice takes ~10 ms; a generous bound on a loaded machine
    buffers.arrays[0][:PAGE] = 1  # the engine's own mapping is untouched by the server's unmap
    buffers.close()
