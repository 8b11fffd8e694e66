"""bench_simulate_scale.py runs quick (every layout x preset, one process each) and prints its summary line last."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_simulate_scale import main


def test_bench_simulate_scale_quick_runs_every_layout_and_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"max_wall_s=(\d+\.\d) max_rss_gib=(\d+\.\d\d) runs=(\d+) failed=(\d+)", lines[-1])
    assert match, lines[-1]
    assert (int(match[3]), int(match[4])) == (6, 0), lines
    rows = [dict(field.split("=", 1) for field in line.split()) for line in lines[:-1]]
    assert [(r["layout"], r["preset"]) for r in rows] == [
        (layout, preset) for layout in ("qwen3.5", "mamba2", "gemma3") for preset in ("vllm", "hybridkv")]
    for row in rows:  # one trace for all: the same prompt tokens and ideal; hits within it
        assert (row["prompt_tokens"], row["ideal"]) == (rows[0]["prompt_tokens"], rows[0]["ideal"])
        assert 0 < int(row["hits"]) <= int(row["ideal"])
        assert float(row["rss_gib"]) <= float(match[2]) and float(row["wall_s"]) <= float(match[1])
