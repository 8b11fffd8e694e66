"""The server-hits benchmark's CI smoke run: a line per layout and generator (L1 policies, then L2 sizing),
the two ratios last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
L1_LINE = re.compile(r"server_hits_resumable_vs_lru=\d+\.\d+ worst=\d+\.\d+")
LAST = re.compile(r"server_hits_l2_sized_vs_unsized=\d+\.\d+ worst=\d+\.\d+")


@pytest.mark.slow
def test_bench_server_hits_quick_prints_its_line_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server_hits.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert LAST.fullmatch(lines[-1]) and L1_LINE.fullmatch(lines[-2]), lines
    assert len(lines) == 18 and all(" hit tokens lru=" in line for line in lines[:8])
    assert all(line.startswith("l2 ") and " unsized=" in line and " sized=" in line for line in lines[8:16])
