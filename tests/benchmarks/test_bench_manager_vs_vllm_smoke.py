"""The side-by-side manager benchmark: a clear refusal without vLLM's bench, a full round with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.bench_manager_vs_vllm import DEFAULT_VLLM_PYTHON, main


def test_refuses_clearly_without_vllms_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--vllm-python", str(tmp_path / "python")]) == 2
    assert "vLLM's bench is not available" in capsys.readouterr().err


@pytest.mark.skipif(not DEFAULT_VLLM_PYTHON.is_file(),
                    reason="needs the vLLM manager venv (bash benchmarks/vllm_manager_venv.sh)")
def test_one_round_prints_both_sides_and_ratios_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    vllm = next(line for line in lines if line.strip().startswith("vllm "))
    ours = next(line for line in lines if line.strip().startswith("hybridkv "))
    figures = [dict(re.findall(r"(\w+)=([\d.]+)", row)) for row in (vllm, ours)]
    last = dict(re.findall(r"(\w+)=([\d.]+)", lines[-1]))
    # the reported ratio of a single round is that round's ours / vLLM's
    for op in ("lookup", "prefill", "decode", "free", "ns_per_token"):
        assert float(last[f"ratio_{op}"]) == pytest.approx(float(figures[1][op]) / float(figures[0][op]), rel=0.02)
    assert last["rounds"] == "1"
