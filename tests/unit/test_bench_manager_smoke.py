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
    match = re.fullmatch(r"ns_per_scheduled_token=(\d+) gemma3=(\d+) mamba=\d+ us_per_request_hash=[\d.]+", lines[-1])
    assert match is not None and match.group(1) == match.group(2)
    assert any(line.startswith("gemma3: lookup_us=") for line in lines)
