"""L2 tier throughput: put then get of N objects of V MiB, on the disk tier and the Valkey tier.

    python benchmarks/bench_tiers.py [--objects 32] [--value-mib 4] [--seed 0] [--valkey-url URL] [--quick]

Values are random bytes (seeded). The disk tier writes into a fresh temporary directory (the gets
read back through the page cache, as a server re-reading recent objects does); without
`--valkey-url` a private redis-server is started on 127.0.0.1 with a free port (and the Valkey
figures are skipped when none is installed). MB/s = 10^6 bytes of values per second, one thread.
The last line is

    disk_put_mbps=<x> disk_get_mbps=<y> valkey_put_mbps=<z> valkey_get_mbps=<w>
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hybridkv.cache_server.tiers import DiskTier, L2Tier, ValkeyTier


def measure(tier: L2Tier, values: list[bytes]) -> tuple[float, float]:
    """(put MB/s, get MB/s) over every value; checks each get returns what was put."""
    total = sum(map(len, values))
    start = time.perf_counter()
    for i, v in enumerate(values):
        tier.put(b"bench%d" % i, v)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for i, v in enumerate(values):
        if tier.get(b"bench%d" % i) != v:
            raise RuntimeError(f"{tier.name}: object {i} came back different")
    get_s = time.perf_counter() - start
    return total / put_s / 1e6, total / get_s / 1e6


@contextlib.contextmanager
def private_redis() -> Iterator[str | None]:
    """A throwaway redis-server's URL, or None when redis-server is not installed."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        yield None
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def wait_for(tier: ValkeyTier, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not tier.ping():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Valkey at {tier.where} did not answer in {timeout_s} s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=32)
    parser.add_argument("--value-mib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--valkey-url", default=None, help="an existing server (its namespace 'bench' is cleared)")
    parser.add_argument("--quick", action="store_true", help="8 objects of 1 MiB")
    args = parser.parse_args()
    objects, value_bytes = (8, 1 << 20) if args.quick else (args.objects, int(args.value_mib * (1 << 20)))
    rng = random.Random(args.seed)
    values = [rng.randbytes(value_bytes) for _ in range(objects)]
    print(f"{objects} objects of {value_bytes / (1 << 20):.1f} MiB, seed {args.seed}")

    with tempfile.TemporaryDirectory() as d:
        disk = DiskTier(Path(d), capacity_bytes=2 * objects * value_bytes)
        disk_put, disk_get = measure(disk, values)
        disk.close()
    print(f"disk:   put {disk_put:8.1f} MB/s   get {disk_get:8.1f} MB/s")

    summary = f"disk_put_mbps={disk_put:.0f} disk_get_mbps={disk_get:.0f}"
    with contextlib.ExitStack() as stack:
        url = args.valkey_url or stack.enter_context(private_redis())
        if url is None:
            print("valkey: skipped (no --valkey-url and no redis-server installed)")
            summary += " valkey_put_mbps=skipped valkey_get_mbps=skipped"
        else:
            valkey = ValkeyTier(url, namespace="bench", timeout_s=30.0)
            wait_for(valkey)
            valkey_put, valkey_get = measure(valkey, values)
            valkey.clear()
            valkey.close()
            print(f"valkey: put {valkey_put:8.1f} MB/s   get {valkey_get:8.1f} MB/s")
            summary += f" valkey_put_mbps={valkey_put:.0f} valkey_get_mbps={valkey_get:.0f}"
    print(summary)


if __name__ == "__main__":
    main()
