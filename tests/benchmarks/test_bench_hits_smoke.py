"""bench_hits.py runs end to end on short traces and prints its summary line last."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_hits import main


def test_bench_hits_prints_hits_vs_vllm_and_ideal_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--no-vllm"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"hits_vs_vllm=skipped hits_vs_ideal=0\.\d{3}", lines[-1]), lines[-1]
    runs = [tuple(line.split()[:5]) for line in lines[:-1]]
    # the last five turn prefix_match_unit on: 8 tokens on Gemma 3, the state block on Qwen3.5 and the Mamba2
    # hybrid, then 16 tokens on both (below their state blocks: partial hits), with dense retention and with 0
    expected = [("gemma3", None, "off", "None"), ("qwen3.5", None, "off", "None"), ("mamba2", None, "off", "None"),
                ("gemma3", 0, "off", "None"), ("qwen3.5", 0, "off", "None"), ("mamba2", 0, "off", "None"),
                ("gemma3", None, "eagle", "None"), ("gemma3", 0, "eagle", "None"), ("full", None, "eagle", "None"),
                ("gemma3", None, "off", "8"), ("qwen3.5", None, "off", "block"), ("mamba2", None, "off", "block"),
                ("qwen3.5", None, "off", "16"), ("mamba2", None, "off", "16"),
                ("qwen3.5", 0, "off", "16"), ("mamba2", 0, "off", "16")]
    assert runs == [(f"layout={layout}", "trace=chat", f"retention={retention}", f"spec_decode={spec}",
                     f"prefix_match_unit={unit}") for layout, retention, spec, unit in expected]
    for line in lines[:-1]:
        fields = dict(item.split("=") for item in line.split())
        assert 0 < int(fields["hits"]) <= int(fields["ideal"]) and fields["requests"] == "30"
