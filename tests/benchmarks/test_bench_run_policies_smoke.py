"""bench_run_policies.py runs quick through `hybridkv run`: both sides generate the same tokens."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_run_policies import main, workload


@pytest.mark.slow
def test_bench_run_policies_prints_its_ratios_last_and_tokens_match(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick"]) == 0  # 1: the two sides generated different tokens
    lines = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"prefill_ours_vs_vllm=(\d+\.\d{3}) hits_ours_vs_vllm=(\d+\.\d{3}) same_tokens=True",
                         lines[-1])
    assert match, lines[-1]
    sides = [line for line in lines if line.startswith("side=")]
    assert [line.split()[0] for line in sides] == ["side=vllm", "side=ours"]
    prompts = {re.search(r"prompt_tokens=(\d+)", line)[1] for line in sides}  # type: ignore[index]
    assert len(prompts) == 1  # the same workload on both sides


def test_the_workload_is_chains_of_turns() -> None:
    trace = workload(12, seed=0)
    assert len(trace) == 12
    children = [item.parent for item in trace if item.parent is not None]
    assert len(children) == len(set(children))  # every parent has one child: a session's next turn
    assert all(parent < index for index, parent in enumerate(item.parent for item in trace) if parent is not None)
