"""DiskTier: round trip, restart and reindex, corruption, LRU capacity, directory lock, I/O errors.

Expected sizes are hand-computed from the frame layout: 28 header bytes + key + value."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from hybridkv.cache_server.tiers import DiskTier, TierError, TierStats, framing

HEADER = 28


def frame_bytes(key: bytes, value: bytes) -> int:
    return HEADER + len(key) + len(value)


def path_for(directory: Path, key: bytes) -> Path:
    """Where the layout in disk.py's docstring puts `key`'s file."""
    digest = hashlib.blake2b(key, digest_size=16).hexdigest()
    return directory / "objects" / digest[:2] / f"{digest[2:]}.kvo"


def object_files(directory: Path) -> list[Path]:
    return sorted((directory / "objects").glob("*/*.kvo"))


def test_round_trip_overwrite_delete_clear(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    values = {b"a": b"alpha", b"b": bytes(range(256)) * 4, b"empty": b""}
    for k, v in values.items():
        tier.put(k, v)
    tier.put(b"mv", memoryview(b"from a memoryview"))
    assert [tier.get(k) for k in values] == list(values.values())
    assert tier.get(b"mv") == b"from a memoryview"
    assert tier.get(b"missing") is None
    assert tier.contains([b"a", b"missing", b"empty"]) == [True, False, True]
    tier.put(b"a", b"second version")
    assert tier.get(b"a") == b"second version"
    tier.delete(b"b")
    tier.delete(b"never stored")
    assert tier.get(b"b") is None
    want_bytes = frame_bytes(b"a", b"second version") + frame_bytes(b"empty", b"") + frame_bytes(
        b"mv", b"from a memoryview")
    assert tier.stats() == TierStats(name="disk", objects=3, bytes_used=want_bytes, capacity_bytes=1 << 20,
                                     errors=0, corrupt_dropped=0, evictions=0)
    assert sum(p.stat().st_size for p in object_files(tmp_path)) == want_bytes
    tier.clear()
    assert tier.contains([b"a", b"empty", b"mv"]) == [False, False, False]
    assert object_files(tmp_path) == []
    assert tier.stats().bytes_used == 0
    tier.close()


def test_restart_rebuilds_the_index_and_keeps_lru_order(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    for k in (b"k1", b"k2", b"k3", b"k4"):
        tier.put(k, k * 100)
    assert tier.get(b"k1") == b"k1" * 100  # k1 becomes the most recently used
    before = tier.stats()
    tier.close()

    reopened = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert reopened.stats() == before
    assert [reopened.get(k) for k in (b"k1", b"k2", b"k3", b"k4")] == [k * 100 for k in (b"k1", b"k2", b"k3", b"k4")]
    reopened.close()

    # LRU order after the gets above: k1, k2, k3, k4 (k4 newest). A capacity of two objects keeps k3, k4.
    small = DiskTier(tmp_path, capacity_bytes=2 * frame_bytes(b"k1", b"k1" * 100))
    assert small.contains([b"k1", b"k2", b"k3", b"k4"]) == [False, False, True, True]
    assert small.stats().evictions == 2
    small.close()


def test_lru_eviction_at_capacity(tmp_path: Path) -> None:
    size = frame_bytes(b"a", b"x" * 100)
    tier = DiskTier(tmp_path, capacity_bytes=3 * size)
    for k in (b"a", b"b", b"c"):
        tier.put(k, b"x" * 100)
    assert tier.stats().evictions == 0
    tier.get(b"a")  # order now b, c, a
    tier.put(b"d", b"x" * 100)  # evicts b
    assert tier.contains([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    tier.put(b"c", b"y" * 100)  # replacing needs no room
    tier.put(b"e", b"x" * 100)  # order a, d, c -> evicts a
    assert tier.contains([b"a", b"c", b"d", b"e"]) == [False, True, True, True]
    stats = tier.stats()
    assert (stats.objects, stats.bytes_used, stats.evictions) == (3, 3 * size, 2)
    assert len(object_files(tmp_path)) == 3
    tier.close()


def test_an_object_larger_than_the_capacity_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=200)
    tier.put(b"small", b"s" * 10)
    with pytest.raises(TierError, match="object of 1031 bytes does not fit the disk tier's capacity of 200"):
        tier.put(b"big", b"b" * 1000)
    assert tier.get(b"small") == b"s" * 10
    tier.close()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["value byte", "key byte", "header byte", "truncated", "appended", "emptied"])
def test_a_damaged_file_is_dropped_counted_and_never_returned(tmp_path: Path, damage: str) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"victim", b"v" * 1000)
    tier.put(b"bystander", b"b" * 1000)
    path = path_for(tmp_path, b"victim")
    size = path.stat().st_size
    if damage == "value byte":
        flip_byte(path, size - 500)
    elif damage == "key byte":
        flip_byte(path, HEADER + 2)
    elif damage == "header byte":
        flip_byte(path, 13)  # inside the value length
    elif damage == "truncated":
        os.truncate(path, size - 1)
    elif damage == "appended":
        with open(path, "ab") as f:
            f.write(b"!")
    else:
        os.truncate(path, 0)
    assert tier.get(b"victim") is None
    assert not path.exists()
    assert tier.contains([b"victim"]) == [False]
    assert tier.get(b"bystander") == b"b" * 1000
    stats = tier.stats()
    assert (stats.objects, stats.corrupt_dropped, stats.bytes_used) == (1, 1, frame_bytes(b"bystander", b"b" * 1000))
    tier.close()


def test_a_truncated_file_is_dropped_when_the_index_is_rebuilt(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"victim", b"v" * 1000)
    tier.put(b"bystander", b"b" * 1000)
    path = path_for(tmp_path, b"victim")
    tier.close()
    os.truncate(path, 700)
    (tmp_path / "objects" / "zz").mkdir()
    (tmp_path / "objects" / "zz" / "junk.kvo").write_bytes(b"not a frame")

    reopened = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert reopened.contains([b"victim", b"bystander"]) == [False, True]
    assert reopened.stats().corrupt_dropped == 2
    assert not path.exists()
    reopened.close()


def test_an_object_of_another_format_version_is_ignored_not_deleted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"newer", b"payload")
    path = path_for(tmp_path, b"newer")
    tier.close()
    data = bytearray(path.read_bytes())
    data[4:6] = (framing.FORMAT_VERSION + 1).to_bytes(2, "little")
    path.write_bytes(bytes(data))

    reopened = DiskTier(tmp_path, capacity_bytes=1 << 20)
    assert reopened.contains([b"newer"]) == [False]
    assert reopened.stats().corrupt_dropped == 0
    assert path.exists()
    reopened.close()


def test_one_directory_one_tier(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    with pytest.raises(TierError, match=r"is in use by another DiskTier \(its \.lock is held\)"):
        DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.close()
    DiskTier(tmp_path, capacity_bytes=1 << 20).close()


def test_io_errors_raise_tier_error_and_are_counted(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"kept", b"k")
    shutil.rmtree(tmp_path / "tmp")  # every put now fails to create its temporary file
    with pytest.raises(TierError, match=r"disk tier put into .* failed"):
        tier.put(b"new", b"n")
    assert tier.stats().errors == 1
    assert tier.get(b"kept") == b"k"
    assert tier.contains([b"new"]) == [False]
    tier.close()
    with pytest.raises(TierError, match="is closed"):
        tier.get(b"kept")


def test_bad_capacity_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk tier capacity must be > 0 bytes, got 0"):
        DiskTier(tmp_path, capacity_bytes=0)


def test_a_writer_thread_and_a_reader_thread_at_once(tmp_path: Path) -> None:
    """The server's write-behind thread puts while its request thread gets: a get returns None or
    one of the versions put for that key (whole), never anything else; nothing is counted corrupt."""
    def version(key: bytes, v: int) -> bytes:
        return (key + b":%d:" % v).ljust(5000, b"#")

    keys = [b"k%d" % i for i in range(8)]
    tier = DiskTier(tmp_path, capacity_bytes=5 * frame_bytes(b"k0", version(b"k0", 0)))  # forces evictions
    bad: list[bytes] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            for k in keys:
                got = tier.get(k)
                if got is not None and got != version(k, int(got.split(b":")[1])):
                    bad.append(got[:20])

    thread = threading.Thread(target=reader)
    thread.start()
    for v in range(40):
        for k in keys:
            tier.put(k, version(k, v))
    done.set()
    thread.join()
    assert bad == []
    stats = tier.stats()
    assert (stats.corrupt_dropped, stats.errors, stats.objects) == (0, 0, 5)
    # Without reads every put after the first 5 evicts (round robin over 8 keys, room for 5); a read
    # can save a key from eviction, so its next put replaces instead.
    assert 0 < stats.evictions <= 40 * 8 - 5
    assert sum(p.stat().st_size for p in object_files(tmp_path)) == stats.bytes_used
    tier.close()
