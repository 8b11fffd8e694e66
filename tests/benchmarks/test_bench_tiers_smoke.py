"""The tier benchmark's smoke run: it round-trips every object and prints its figures last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tiers_quick_prints_its_summary_last(redis_url: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tiers.py"), "--quick",
                           "--valkey-url", redis_url], capture_output=True, text=True, timeout=120, check=False,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"disk_put_mbps=\d+ disk_get_mbps=\d+ valkey_put_mbps=\d+ valkey_get_mbps=\d+", last), last
