"""The server benchmark's CI smoke run: the retrieved bytes check out and the last line has the
issue's exact format."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAST = re.compile(r"store_gbps=\d+\.\d+ retrieve_gbps=\d+\.\d+ lookup_ms=\d+\.\d+ memcpy_gbps=\d+\.\d+ "
                  r"retrieve_vs_memcpy=\d+\.\d+ worst_wait_ms=\d+\.\d+ busy_ms=\d+\.\d+")


def test_bench_server_quick_prints_its_line_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--quick"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert LAST.fullmatch(proc.stdout.strip().splitlines()[-1])
