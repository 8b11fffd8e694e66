"""The connector benchmark's CI smoke run: every measurement hit (local and server) with the same
token, and the last line has the issue's exact format."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
LAST = re.compile(r"server_hit_vs_cold=\d+\.\d+ server_hit_vs_local=\d+\.\d+")


@pytest.mark.slow
def test_bench_connector_quick_prints_its_line_last() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_connector.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert LAST.fullmatch(lines[-1]), lines
    assert [line.split(":")[0] for line in lines[:-1]] == ["gemma3", "qwen3_5"]
