"""bench_routing.py: the scale part runs quick and prints its figures last; the workload is sessions."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_routing import Clients, Shape, main, workload


def test_scale_part_prints_its_figures_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--part", "scale"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"query_p99_ms=[\d.]+ query_by_hash_p99_ms=[\d.]+ http_query_p99_ms=[\d.]+ "
                        r"ingest_blocks_per_s=\d+ bytes_per_block=\d+", last), last


def test_sessions_extend_or_branch_from_their_own_turns() -> None:
    shape = Shape(system_prompts=3, system_tokens=32, question_tokens=8, requests=40, kv_gib=0.01, vocab=100)
    sessions = workload(shape, seed=0, drive=Clients())
    assert sum(len(s) for s in sessions) >= 40
    for turns in sessions:
        for later in turns[1:]:
            assert any(later[: len(t)] == t for t in turns[: turns.index(later)])  # a turn's prefix
