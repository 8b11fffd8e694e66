"""The engine benchmark's CI smoke run: it agrees with transformers and prints its ratio last."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gemma3", "qwen3_5"])
def test_bench_engine_quick_matches_transformers_and_prints_ratio_last(model: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py"), "--quick", "--threads", "1",
                           "--model", model], capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"greedy_match=(\d+)/(\d+)", next(line for line in lines if line.startswith("greedy_")))
    assert match is not None and match.group(1) == match.group(2)
    assert re.fullmatch(r"engine_vs_hf_throughput=\d+\.\d+", lines[-1])
