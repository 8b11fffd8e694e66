"""Fair slicing (issue 46): a large lookup, store or retrieve runs in bounded slices and the control
loop serves its connections in turn, so one client's huge request does not hold another's small one.

The bound stated and checked against a live server, the hog engine (fair_hog.py) and the server
each in its own process (in one process their GIL, not the server, set the wait): of 30 lookups of
3 chunks made while the hog keeps sending huge requests, 9 in 10 wait less than a fifth of one huge
request's time and the worst less than half, and the server's longest slice stays under 1 s. A
small lookup waits about one slice (~1-10 ms of work) where a huge request is 16-64 of them, so
both scale with the machine. Measured on the shared 2-core machine (wait / huge request): idle-like
(this test at nice 0, the rest at nice 15) p90 0.05-0.10, worst 0.05-0.16; loaded (nice 15 beside
two busy loops, load ~7) p90 0.02-0.10, worst 0.04-0.15; the bounds leave 2x and 3x (the worst can
meet the server preempted). Before slicing a lookup waited the rest of the huge request, up to all
of it: 173 ms behind a 16,384-chunk lookup."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cache_server import limits
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.cache_server.scheduler import FairScheduler, Task
from hybridkv.cache_server.store import KVStore, StoreConfig
from hybridkv.connector.client import KVClient, chunk_hashes
from hybridkv.connector.server_process import ServerProcess
from hybridkv.wire import AnyReply, ErrorCode, LookupRequest, OkReply, RetrieveRequest, StoreRequest
from tests.cache_server import fair_hog
from tests.cache_server.helpers import fake_engine, make_engine, server_process

REPO = Path(__file__).resolve().parents[2]

CHUNK = fair_hog.CHUNK
GROUPS = fair_hog.GROUPS  # 8 KiB per chunk
SMALL = list(range(3 * CHUNK + 1))


def _steps(name: str, slices: int, log: list[str]) -> Generator[None, None, AnyReply]:
    for i in range(slices):
        if i:
            yield
        log.append(name)
    return OkReply(req_id=slices)


def test_connections_take_turns_one_slice_each() -> None:
    log: list[str] = []
    sched = FairScheduler(4, ServerMetrics(), lambda _t, e: pytest.fail(str(e)))
    assert sched.add(Task(identity=b"A", steps=_steps("a", 5, log)))
    sched.run_slice()
    assert sched.add(Task(identity=b"B", steps=_steps("b", 1, log)))
    assert sched.add(Task(identity=b"B", steps=_steps("c", 2, log)))  # B's second request: after its first
    finished = []
    while sched.busy:
        done = sched.run_slice()
        if done is not None:
            finished.append(done[0].identity + bytes([done[1].req_id + 48]))
    assert log == ["a", "a", "b", "a", "c", "a", "c", "a"]  # A B A B A B A, then A alone
    assert finished == [b"B1", b"B2", b"A5"]


def test_a_connection_may_queue_at_most_max_queued() -> None:
    sched = FairScheduler(2, ServerMetrics(), lambda _t, e: pytest.fail(str(e)))
    log: list[str] = []
    assert sched.add(Task(identity=b"A", steps=_steps("a", 1, log)))
    assert sched.add(Task(identity=b"A", steps=_steps("a", 1, log)))
    assert not sched.add(Task(identity=b"A", steps=_steps("a", 1, log)))
    assert sched.add(Task(identity=b"B", steps=_steps("b", 1, log)))


def _waits(server: ServerProcess, victim: KVClient, mode: str) -> tuple[list[float], float, float]:
    """(waits of the victim's 3-chunk lookups, sorted; median time of the hog's request; the server's
    longest slice) while a hog process (fair_hog.py, `mode`) keeps the server busy."""
    hog = subprocess.Popen([sys.executable, "-m", "tests.cache_server.fair_hog", server.endpoint, mode],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert hog.stdin is not None and hog.stdout is not None  # PIPEs
    waits = []
    try:
        for expected in ("ready", "busy"):
            line = hog.stdout.readline().strip()
            assert line == expected, f"the hog said {line!r}, expected {expected!r}"
        for _ in range(30):
            t0 = time.perf_counter()
            hit = victim.lookup(chunk_hashes(SMALL, CHUNK), num_tokens=len(SMALL))
            waits.append(time.perf_counter() - t0)
            assert hit.hit_tokens == 3 * CHUNK
            victim.release(hit.lookup_id)
            time.sleep(0.003)
    finally:
        out, _ = hog.communicate(timeout=120)  # closes its stdin: it stops
    report = json.loads(out.strip().splitlines()[-1])
    assert not report["error"], report["error"]
    return sorted(waits), statistics.median(report["seconds"]), _metric(server, "hybridkv_server_longest_slice_seconds")


def _metric(server: ServerProcess, name: str) -> float:
    for line in server.http("/metrics").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in the server's /metrics")


def _check_bound(waits: list[float], hog_s: float, longest_slice_s: float) -> None:
    assert waits[int(0.9 * len(waits)) - 1] < hog_s / 5, (waits, hog_s)
    assert waits[-1] < hog_s / 2, (waits, hog_s)
    assert longest_slice_s < 1.0


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    """A server process (its own GIL, as in production) and the victim engine of this process, with
    3 chunks stored; each test's hog is a third process."""
    with server_process("--chunk-size", str(CHUNK), "--l1-size-gib", "0.25") as srv, \
            fake_engine(GROUPS, num_blocks=64) as eng, srv.client(timeout_s=120) as victim:
        eng.fill_random(1)
        victim.register(eng.layout)
        assert all(victim.store(first_chunk=0, chunk_hashes=chunk_hashes(SMALL, CHUNK),
                                block_ids=[list(range(1, 7))]).stored)
        yield srv, victim


def test_a_small_lookup_waits_a_slice_not_a_huge_lookup(server) -> None:  # type: ignore[no-untyped-def]
    waits, hog_s, longest = _waits(*server, "lookup")
    print(f"waits of a 3-chunk lookup behind {limits.MAX_CHUNKS_PER_REQUEST}-chunk lookups ({hog_s * 1e3:.0f} ms "
          f"each): p90 {waits[26] * 1e3:.1f} ms, worst {waits[-1] * 1e3:.1f} ms; longest slice {longest * 1e3:.1f} ms")
    _check_bound(waits, hog_s, longest)


def test_a_small_lookup_waits_a_slice_not_a_huge_store_and_retrieve(server) -> None:  # type: ignore[no-untyped-def]
    waits, hog_s, longest = _waits(*server, "store_retrieve")
    print(f"waits of a 3-chunk lookup behind stores and retrieves of {fair_hog.STORED_CHUNKS} chunks "
          f"({hog_s * 1e3:.0f} ms each): p90 {waits[26] * 1e3:.1f} ms, worst {waits[-1] * 1e3:.1f} ms; "
          f"longest slice {longest * 1e3:.1f} ms")
    _check_bound(waits, hog_s, longest)


def _store_steps_engine(store: KVStore, chunks: int):  # type: ignore[no-untyped-def]
    eng = make_engine(GROUPS, num_blocks=2 * chunks + 2)
    eng.fill_random(2)
    reg = store.register(eng.layout, eng.buffers.fds)
    hashes = chunk_hashes(list(range(chunks * CHUNK + 1)), CHUNK)
    req = StoreRequest(req_id=1, instance_id=reg.instance_id, token=reg.token, fingerprint=eng.layout.fingerprint,
                       first_chunk=0, chunk_hashes=hashes, block_ids=[list(range(1, 2 * chunks + 1))])
    return eng, reg, hashes, req


def test_an_engine_that_leaves_between_slices_ends_its_store_cleanly() -> None:
    store = KVStore(StoreConfig(chunk_tokens=CHUNK, l1_bytes=64 << 20))
    chunks = 3 * limits.SLICE_CHUNKS
    eng, reg, _, req = _store_steps_engine(store, chunks)
    steps = store.store_steps(req)
    next(steps)  # the first slice: SLICE_CHUNKS chunks (a few index steps each, far from SLICE_INDEX_STEPS)
    assert store.status()["tiers"][0]["objects"] == limits.SLICE_CHUNKS
    store.unregister(reg.instance_id, reg.token)  # its buffers are unmapped
    with pytest.raises(RequestError) as info:
        next(steps)
    assert info.value.code is ErrorCode.UNKNOWN_INSTANCE
    assert store.status()["tiers"][0]["objects"] == limits.SLICE_CHUNKS
    assert store.status()["tiers"][0]["locked_objects"] == 0  # its pins were let go
    store.check_integrity()
    eng.close()
    store.close()


def test_a_retrieve_keeps_its_objects_through_a_clear_between_slices() -> None:
    store = KVStore(StoreConfig(chunk_tokens=CHUNK, l1_bytes=64 << 20))
    chunks = 3 * limits.SLICE_CHUNKS
    eng, reg, hashes, req = _store_steps_engine(store, chunks)
    assert all(store.store(req).stored)
    kv = eng.buffers.arrays[0]
    expected = kv[4096:(2 * chunks + 1) * 4096].copy()
    hit = store.lookup(LookupRequest(req_id=2, instance_id=reg.instance_id, token=reg.token,
                                     fingerprint=eng.layout.fingerprint, chunk_hashes=hashes,
                                     num_tokens=chunks * CHUNK + 1))
    kv[:] = 0
    steps = store.retrieve_steps(RetrieveRequest(req_id=3, instance_id=reg.instance_id, token=reg.token,
                                                 fingerprint=eng.layout.fingerprint, lookup_id=hit.lookup_id,
                                                 block_ids=[list(range(1, 2 * chunks + 1))]))
    next(steps)
    assert store.clear().objects_removed == 0  # every object is the retrieve's, locked
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
    assert done.value.value.bytes_copied == chunks * 8192
    assert np.array_equal(kv[4096:(2 * chunks + 1) * 4096], expected)
    assert store.clear().objects_removed == chunks  # unlocked once the retrieve ended
    store.check_integrity()
    store.unregister(reg.instance_id, reg.token)
    eng.close()
    store.close()
