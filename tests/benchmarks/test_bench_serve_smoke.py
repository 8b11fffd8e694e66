"""bench_serve's CI smoke run: every served session equals the offline one; the ratio is printed last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_serve_quick_matches_offline_and_prints_ratio_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--quick", "--repeat", "1"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "sessions_equal=4/4" in lines
    assert re.fullmatch(r"serve_vs_offline_throughput=\d+\.\d+", lines[-1])
