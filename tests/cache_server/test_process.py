"""`hybridkv server` as a process: startup line, graceful SIGINT/SIGTERM, a second SIGINT forces,
loopback unless asked, the disk tier across restarts and kill -9, four clients with different
salts at once."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hybridkv.connector.client import KVClient, chunk_hashes
from hybridkv.connector.server_process import ServerProcess
from tests.cache_server.helpers import FakeEngine, fake_engine, make_group, server_process, start_server_process

CHUNK = 16
GROUPS = [make_group(block=16, layers=2, page=256), make_group(kind="sliding", block=16, window=33, page=256),
          make_group(kind="state", block=16, page=200)]


def tokens(i: int, chunks: int = 4) -> list[int]:
    return [i * 100_000 + t for t in range(chunks * CHUNK + 1)]


def ids(base: int, chunks: int = 4) -> list[list[int]]:
    return [[base + g * 8 + c for c in range(chunks)] for g in range(len(GROUPS))]


def store(client: KVClient, i: int, base: int, salt: str = "") -> list[bool]:
    return list(client.store(first_chunk=0, chunk_hashes=chunk_hashes(tokens(i), CHUNK), block_ids=ids(base),
                             cache_salt=salt).stored)


def retrieve_matches(client: KVClient, eng: FakeEngine, i: int, src_base: int, dst_base: int, salt: str = "") -> int:
    """Look up sequence i, retrieve it to dst_base; checks the bytes against src_base; the hit in tokens."""
    hit = client.lookup(chunk_hashes(tokens(i), CHUNK), num_tokens=4 * CHUNK + 1, cache_salt=salt)
    if not hit.hit_tokens:
        return 0
    chunks = hit.hit_tokens // CHUNK
    client.retrieve(hit.lookup_id, block_ids=ids(dst_base, chunks))
    for layer in range(2):  # full group: every chunk
        for c in range(chunks):
            assert np.array_equal(eng.page(0, layer, dst_base + c), eng.page(0, layer, src_base + c))
    last = chunks - 1
    assert np.array_equal(eng.page(2, 0, dst_base + 16 + last), eng.page(2, 0, src_base + 16 + last))
    return hit.hit_tokens


def test_startup_line_round_trip_and_graceful_sigint() -> None:
    with server_process("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01") as server, fake_engine(GROUPS) as eng:
        assert "(control)" in server.line and "chunk 16 tokens" in server.line and "L2: none" in server.line
        with server.client() as c:
            c.register(eng.layout)
            assert store(c, 1, 1) == [True] * 4
            assert retrieve_matches(c, eng, 1, 1, 40) == 4 * CHUNK
        assert server.http("/healthz") == "ok"
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        assert "shutting down" in (server.proc.stderr.read() if server.proc.stderr else "")


@pytest.mark.slow
def test_second_sigint_forces() -> None:
    server = start_server_process("--chunk-size", str(CHUNK))
    try:
        server.proc.send_signal(signal.SIGINT)
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) in (0, 130)  # forced (130) unless the first one already finished
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_non_loopback_host_needs_allow_remote() -> None:
    r = subprocess.run([sys.executable, "-m", "hybridkv", "server", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--allow-remote" in r.stderr


@pytest.mark.slow
def test_disk_tier_survives_restart(tmp_path: Path) -> None:
    args = ("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01", "--l2-disk", str(tmp_path / "l2"))
    with fake_engine(GROUPS) as eng, KVClient("tcp://127.0.0.1:1", timeout_s=5) as c:
        with server_process(*args) as server:
            c.endpoint = server.endpoint
            c.register(eng.layout)
            assert store(c, 1, 1) == [True] * 4
        port = server.endpoint.rsplit(":", 1)[1]
        # restarted on the same port: L1 empty, the disk index rebuilt; the same client notices the
        # restart (unknown instance), registers again by itself and gets the hit from disk
        with server_process(*args, "--port", port) as server:
            assert "L2: disk" in server.line
            assert retrieve_matches(c, eng, 1, 1, 40) == 4 * CHUNK
            # only what the hit needs comes off disk: 4 full chunks + the window's last 2 + the last state
            assert 'hybridkv_server_l2_promotions_total{tier="disk"} 7.0' in server.http("/metrics")


@pytest.mark.slow
def test_kill_9_mid_store_leaves_no_partial_chunk(tmp_path: Path) -> None:
    args = ("--chunk-size", str(CHUNK), "--l1-size-gib", "0.01", "--l2-disk", str(tmp_path / "l2"))
    with fake_engine(GROUPS) as eng:
        server = start_server_process(*args)
        with server.client(timeout_s=1.0) as c:
            c.register(eng.layout)
            for i in range(30):
                try:
                    store(c, i, 1)
                except Exception:
                    break
                if i == 10:  # the first 11 prompts reach the disk before the kill: some must survive whole
                    _wait_for_write_behind(server)
                if i == 20:
                    server.proc.kill()  # SIGKILL while write-behind is still writing
        server.proc.wait()
        with server_process(*args) as again, again.client() as c:
            c.register(eng.layout)
            # every hit is whole and byte-exact (full, window and state agree), and some survived
            hits = [retrieve_matches(c, eng, i, 1, 40) for i in range(30)]
            assert all(h % CHUNK == 0 for h in hits) and max(hits) == 4 * CHUNK


def _wait_for_write_behind(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """Until the server's write-behind queues are empty (its /status)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = json.loads(server.http("/status"))["tiers"]
        if all(t.get("write_behind_pending", 0) == 0 for t in tiers):
            return
        time.sleep(0.01)
    raise AssertionError(f"the write-behind did not drain in {timeout_s} s")


def _client_process(endpoint: str, salt: str, rounds: int, out: mp.Queue[object]) -> None:
    try:  # each process registers segments of its own (a process can pass only memory it holds)
        with fake_engine(GROUPS) as eng, KVClient(endpoint, timeout_s=20) as c:
            c.register(eng.layout)
            for r in range(rounds):
                toks = [t + r for t in tokens(0)]  # the same tokens in every process: only the salt differs
                hashes = chunk_hashes(toks, CHUNK)
                reply = c.store(first_chunk=0, chunk_hashes=hashes, block_ids=ids(1), cache_salt=salt)
                assert reply.stored == [True] * 4
                hit = c.lookup(hashes, num_tokens=len(toks), cache_salt=salt)
                assert hit.hit_tokens == 4 * CHUNK, hit
                c.release(hit.lookup_id)
                assert c.lookup(hashes, num_tokens=len(toks), cache_salt=salt + "-other").hit_tokens == 0
        out.put("ok")
    except BaseException as e:  # report to the parent
        out.put(repr(e))


@pytest.mark.slow
def test_four_client_processes_with_different_salts() -> None:
    with server_process("--chunk-size", str(CHUNK), "--l1-size-gib", "0.05") as server:
        ctx = mp.get_context("spawn")
        out: mp.Queue[object] = ctx.Queue()
        procs = [ctx.Process(target=_client_process, args=(server.endpoint, f"tenant-{k}", 10, out))
                 for k in range(4)]
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        assert results == ["ok"] * 4
        with server.client() as c:
            status = c.status()
            # 4 salts x 10 rounds x 4 chunks x 3 object groups, none lost (L1 holds them all)
            assert status["tiers"][0]["objects"] == 4 * 10 * 4 * 3
