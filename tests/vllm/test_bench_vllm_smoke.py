"""`benchmarks/bench_vllm.py --quick` runs and prints its summary figure last."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.vllm.conftest import REPO


def test_bench_vllm_quick_prints_the_ratio_last() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_vllm.py"), "--quick"],
                          capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"vllm_server_hit_vs_cold=\d+\.\d\d", lines[-1]), lines
    assert "server_hit_tokens=256" in proc.stdout  # the 512-token prompt's first chunk came from the server
