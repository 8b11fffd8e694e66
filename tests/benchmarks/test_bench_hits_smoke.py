"""bench_hits.py runs end to end on short traces and prints its summary line last."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_hits import main


def test_bench_hits_prints_hits_vs_vllm_and_ideal_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--no-vllm"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"hits_vs_vllm=skipped hits_vs_ideal=0\.\d{3}", lines[-1]), lines[-1]
    runs = [tuple(line.split()[:4]) for line in lines[:-1]]
    assert runs == [(f"layout={layout}", "trace=chat", f"retention={retention}", f"spec_decode={spec}")
                    for layout, retention, spec in (("gemma3", None, "off"), ("qwen3.5", None, "off"),
                                                    ("mamba2", None, "off"), ("gemma3", 0, "off"),
                                                    ("qwen3.5", 0, "off"), ("mamba2", 0, "off"),
                                                    ("gemma3", None, "eagle"), ("gemma3", 0, "eagle"),
                                                    ("full", None, "eagle"))]
    for line in lines[:-1]:
        fields = dict(item.split("=") for item in line.split())
        assert 0 < int(fields["hits"]) <= int(fields["ideal"]) and fields["requests"] == "30"
