"""The disk tier as a hostile local user would meet it (issue 46, items 9-13), against a live server
(control loop and HTTP on free 127.0.0.1 ports) whose L2 is a DiskTier: a sparse giant or a FIFO
where an object was, files other users could read, stray entries at start-up, a clear that cannot
delete. Each is answered in bounded time with the object dropped or the entry skipped, and said so."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
import time
import urllib.error
from pathlib import Path

import pytest

from hybridkv.cache_server.store import StoreConfig
from hybridkv.cache_server.tiers.disk import DiskTier
from hybridkv.connector.client import KVClient, chunk_hashes
from tests.cache_server.helpers import RunningServer, fake_engine, make_group, running_server

CHUNK = 8
GROUPS = [make_group(block=4, page=64)]
TOKENS = list(range(3 * CHUNK + 1))
HASHES = chunk_hashes(TOKENS, CHUNK)
L1_ONE_OBJECT = StoreConfig(chunk_tokens=CHUNK, l1_bytes=512)  # objects of 2 pages; emptied after a store


def object_files(directory: Path) -> list[Path]:
    return sorted((directory / "objects").glob("*/*.kvo"))


def fill(server: RunningServer, client: KVClient) -> None:
    assert client.store(first_chunk=0, chunk_hashes=HASHES, block_ids=[list(range(1, 7))]).stored == [True] * 3
    assert server.store.tiers.flush(timeout_s=10)
    while server.store.evict_one() is not None:  # from now on, every object comes off the disk
        pass


def lookup_within(client: KVClient, seconds: float) -> int:
    t0 = time.monotonic()
    hit = client.lookup(HASHES, num_tokens=len(TOKENS)).hit_tokens
    assert time.monotonic() - t0 < seconds
    return hit


def test_item9_a_sparse_giant_where_an_object_was_is_never_read(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with running_server(L1_ONE_OBJECT, [tier]) as server, fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        fill(server, c)
        for path in object_files(tmp_path):
            header = path.read_bytes()[:28]
            path.unlink()
            with open(path, "wb") as f:  # the same header (its sizes say the frame is what was written) ...
                f.write(header)
                f.truncate(1 << 30)  # ... then a hole of a GiB: the header's claim no longer checks
        assert lookup_within(c, 2.0) == 0  # what was only on disk is gone, and nothing read 1 GiB
        assert server.metric("hybridkv_server_internal_errors_total") == 0
        assert tier.stats().corrupt_dropped == 3  # each dropped on sight, by its size alone


def test_item10_a_fifo_where_an_object_was_does_not_hang_the_server(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with running_server(L1_ONE_OBJECT, [tier]) as server, fake_engine(GROUPS) as eng, \
            server.client(timeout_s=5) as c:
        c.register(eng.layout)
        fill(server, c)
        for path in object_files(tmp_path):
            path.unlink()
            os.mkfifo(path)
        assert lookup_within(c, 2.0) == 0
        assert json.loads(server.http("/status"))["tiers"][1]["name"] == "disk"  # /status answers too


def test_item11_objects_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        tier = DiskTier(tmp_path / "l2", capacity_bytes=1 << 20)
        tier.put(b"k1", b"v" * 100)
    finally:
        os.umask(old)
    l2 = tmp_path / "l2"
    for d in (l2, l2 / "objects", l2 / "tmp", object_files(l2)[0].parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(object_files(tmp_path / "l2")[0].stat().st_mode) == 0o600
    tier.close()


def test_item11_an_existing_open_directory_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "objects").mkdir(mode=0o755)
    os.chmod(tmp_path / "objects", 0o755)
    DiskTier(tmp_path, capacity_bytes=1 << 20).close()
    assert stat.S_IMODE((tmp_path / "objects").stat().st_mode) == 0o700


@pytest.mark.parametrize("stray", ["directory", "symlink_loop", "fifo", "dangling_symlink"])
def test_item12_stray_entries_at_start_up_are_skipped_and_reported(tmp_path: Path, stray: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for i in range(3):
        tier.put(f"k{i}".encode(), b"v" * 100)
    tier.close()
    victim = object_files(tmp_path)[0]
    victim.unlink()
    if stray == "directory":
        victim.mkdir()
    elif stray == "symlink_loop":
        victim.symlink_to(victim)
    elif stray == "fifo":
        os.mkfifo(victim)
    else:
        victim.symlink_to(tmp_path / "nowhere")
    opened: list[DiskTier] = []
    thread = threading.Thread(target=lambda: opened.append(DiskTier(tmp_path, capacity_bytes=1 << 20)), daemon=True)
    thread.start()
    thread.join(10)
    assert opened, "start-up hung"
    reopened = opened[0]
    assert reopened.stats().objects == 2  # the two real objects, served
    assert reopened.stray_entries == 1
    assert "1 entries in" in caplog.text and "skipped" in caplog.text
    reopened.close()


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_item13_a_clear_that_cannot_delete_says_how_many_remain(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with running_server(L1_ONE_OBJECT, [tier]) as server, fake_engine(GROUPS) as eng, server.client() as c:
        c.register(eng.layout)
        fill(server, c)
        dirs = sorted({p.parent for p in object_files(tmp_path)})
        if not all(_chattr("+i", d) for d in dirs):
            for d in dirs:
                _chattr("-i", d)
            pytest.skip("this file system cannot make a directory immutable (chattr +i)")
        try:
            with pytest.raises(urllib.error.HTTPError) as e:
                server.http("/cache/clear", method="POST")
            assert e.value.code == 500
            body = json.loads(e.value.read())
            assert "the disk tier could not delete 3 objects; they remain" in body["error"]
            assert "removed" not in body["error"]
        finally:
            for d in dirs:
                _chattr("-i", d)
