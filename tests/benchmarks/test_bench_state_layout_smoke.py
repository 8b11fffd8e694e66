"""bench_state_layout.py runs quick and prints its summary line last."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_state_layout import main


def test_bench_state_layout_prints_hits_of_both_layouts_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"multi_page_hits=(\d+) one_page_hits=(\d+) concurrency_ratio=(\d+\.\d\d) "
                         r"concurrency_fixed_ratio=(\d+\.\d\d)", lines[-1])
    assert match, lines[-1]
    multi, one = int(match[1]), int(match[2])
    assert one == 0 < multi  # prefixes of 100-500 tokens never fill a 544-token block
    assert [line.split()[0] for line in lines[:2]] == ["layout=one_page", "layout=multi_page"]
    bursts = [dict(field.split("=") for field in line.split()[1:]) for line in lines if line.startswith("burst ")]
    assert [(b["layout"], b["running_state"]) for b in bursts] == [
        ("one_page", "moving"), ("multi_page", "moving"), ("multi_page", "fixed")]
    peaks = [int(b["peak_running"]) for b in bursts]
    assert abs(float(match[4]) - peaks[2] / peaks[0]) <= 0.005
    assert int(bursts[2]["checkpoint_copies"]) > 0 and int(bursts[1]["checkpoint_copies"]) == 0
