"""kill -9 of a process in the middle of DiskTier puts: afterwards every object is whole (an older
or a newer version, never part of one) and the writer's temporary file is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybridkv.cache_server.tiers import DiskTier

VALUE_BYTES = 8 << 20
KEYS = 3

WRITER = f"""
import sys
from pathlib import Path
from hybridkv.cache_server.tiers import DiskTier
tier = DiskTier(Path(sys.argv[1]), capacity_bytes=1 << 30)
version = 0
while True:
    for k in range({KEYS}):
        tier.put(b"key%d" % k, (b"key%d:v%d:" % (k, version)).ljust({VALUE_BYTES}, b"."))
    version += 1
"""


def expected_value(key: bytes, value: bytes) -> bytes:
    """The value the writer put for the version named in `value`'s prefix."""
    version = value.split(b":")[1]
    return (key + b":" + version + b":").ljust(VALUE_BYTES, b".")


def kill_mid_write(directory: Path) -> bool:
    """Run the writer until a temporary file is partly written, kill -9 it; True if the kill
    left a partial temporary file behind (it landed inside a write)."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], cwd=Path(__file__).parents[3])
    tmp_dir = directory / "tmp"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            assert writer.poll() is None, "the writer process died on its own"
            tmp_files = list(tmp_dir.glob("*.tmp")) if tmp_dir.exists() else []
            sizes = [p.stat().st_size for p in tmp_files if p.exists()]
            if any(directory.glob("objects/*/*.kvo")) and any(0 < s < VALUE_BYTES for s in sizes):
                break
            time.sleep(0.0005)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    return any(p.stat().st_size < VALUE_BYTES + 40 for p in tmp_dir.glob("*.tmp"))


def test_kill_9_mid_put_leaves_only_whole_objects(tmp_path: Path) -> None:
    partial_seen = 0
    for attempt in range(4):
        partial_seen += kill_mid_write(tmp_path)
        tier = DiskTier(tmp_path, capacity_bytes=1 << 30)
        assert list((tmp_path / "tmp").iterdir()) == []  # the leftover was removed on open
        keys = [b"key%d" % k for k in range(KEYS)]
        present = [k for k, has in zip(keys, tier.contains(keys), strict=True) if has]
        assert present, f"attempt {attempt}: no object was complete before the kill"
        for key in present:
            value = tier.get(key)
            assert value is not None and value == expected_value(key, value)
        assert tier.stats().corrupt_dropped == 0
        tier.close()
        if partial_seen >= 1 and attempt >= 1:
            break
    assert partial_seen >= 1, "no kill landed inside a write in 4 attempts"
