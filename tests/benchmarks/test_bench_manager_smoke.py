"""The manager benchmark runs end to end on a tiny trace and prints its summary line last."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_manager import main
from benchmarks.traces import make_trace


def test_trace_is_seeded_and_shaped_as_documented() -> None:
    trace = make_trace(5, 3)
    assert trace == make_trace(5, 3)
    assert all(512 <= len(prompt) <= 4096 and 2 <= steps <= 8 for prompt, steps in trace)


def test_benchmark_prints_ns_per_scheduled_token_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--n", "24", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("ns_per_scheduled_token")
    match = re.fullmatch(r"ns_per_scheduled_token=(\d+) decode_allocate_us=([\d.]+) us_per_request_hash=[\d.]+ "
                         r"max_running=32 gemma3=(\d+) mamba-align=\d+ mamba-all=\d+", lines[-1])
    assert match is not None and match.group(1) == match.group(3)
    gemma3 = next(line for line in lines if line.startswith("gemma3: lookup_us="))
    assert f"decode_allocate_us={match.group(2)} " in gemma3
    rates = {line.split(":")[0]: float(line.split("hit_rate=")[1].split()[0]) for line in lines if "hit_rate=" in line}
    assert rates["mamba-all"] > rates["mamba-align"]  # ALL keeps a checkpoint at every block boundary


def test_benchmark_max_running_grows_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--n", "40", "--seed", "2", "--layout", "gemma3", "--max-running", "64"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "max_running=64 gemma3=" in lines[-1] and "preemptions=0" in lines[-2]
