"""Prefix hits through `hybridkv simulate`'s loop equal vLLM 0.32's real manager in the same loop.

`benchmarks/bench_hits.py` runs seeded traces (chat, shared system prompts, agentic loops,
branching) on three layouts our planner makes from catalog configs (Gemma 3 27B: full + sliding
window; Qwen3.5 27B: full + Gated DeltaNet; Nemotron-Nano 9B v2: full + Mamba2), through the
engine's scheduler, once over our manager and once over vLLM's (`vllm_hits_driver.py`), with every
option at vLLM's setting (align mode, blocks released group by group; dense retention, vLLM's
`prefix_cache_retention_interval` 0 on every layout and 4096 on Gemma 3; EAGLE on Gemma 3 and on a
full-attention model). Memory is tight enough that
requests are preempted and blocks evicted. Each request's first-admission hit must be equal.

- recorded: against `vllm_fixtures/simulate_hits.json` (`bench_hits.py --record`), everywhere;
- live: `bench_hits.py` with vLLM's venv, where it exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_hits
from hybridkv.simulate.simulator import simulate

FIXTURE = Path(__file__).parent / "vllm_fixtures" / "simulate_hits.json"


def ours(job: dict[str, object]) -> list[int]:
    config, trace, options = bench_hits.materialize(job)  # type: ignore[arg-type]
    return list(simulate(trace, config, options).request_hits)


def compare(batch: list[dict[str, object]]) -> None:
    recorded = json.loads(FIXTURE.read_text())
    assert recorded["vllm_version"] == "0.32.0"
    for job in batch:
        expected = recorded["runs"][bench_hits.job_name(job)]  # type: ignore[arg-type]
        got = ours(job)
        diffs = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
        assert not diffs, f"{bench_hits.job_name(job)}: (request, vLLM, ours) {diffs[:5]}"  # type: ignore[arg-type]
        assert sum(expected) > 0


def test_quick_runs_equal_vllms_recorded_hits() -> None:
    compare(bench_hits.jobs(True))


@pytest.mark.slow
def test_full_runs_equal_vllms_recorded_hits() -> None:
    compare(bench_hits.jobs(False))


@pytest.mark.slow
@pytest.mark.skipif(not (bench_hits.VENV / "bin" / "python").exists(), reason="vLLM's venv is not built")
def test_bench_hits_live_equals_vllm() -> None:
    out = subprocess.run([sys.executable, str(Path(bench_hits.__file__)), "--quick"], capture_output=True, text=True,
                         check=True, timeout=600, env=dict(os.environ)).stdout.strip().splitlines()
    assert out[-1].startswith("hits_vs_vllm=1.000 "), out
    assert all("requests_differing=0" in line for line in out[:-1]), out
