"""bench_routing.py: the scale part runs quick and prints its figures last; the workloads are what they
say; the ideal is hand-computed."""

from __future__ import annotations

import re

import pytest

from benchmarks.bench_routing import Clients, Shape, documents, ideal_hits, main, workload


def test_scale_part_prints_its_figures_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--part", "scale"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"query_p99_ms=[\d.]+ query_by_hash_p99_ms=[\d.]+ http_query_cpu_ms=[\d.]+ "
                        r"http_query_p50_ms=[\d.]+ http_query_p99_ms=[\d.]+ "
                        r"ingest_blocks_per_s=\d+ bytes_per_block=\d+", last), last


def test_sessions_extend_or_branch_from_their_own_turns() -> None:
    shape = Shape(system_prompts=3, system_tokens=32, question_tokens=8, requests=40, kv_gib=0.01, vocab=100)
    sessions = workload(shape, seed=0, drive=Clients())
    assert sum(len(s) for s in sessions) >= 40
    for turns in sessions:
        for later in turns[1:]:
            assert any(later[: len(t)] == t for t in turns[: turns.index(later)])  # a turn's prefix


def test_documents_are_cut_at_section_ends_and_end_in_a_question() -> None:
    shape = Shape(system_prompts=2, system_tokens=200, question_tokens=8, requests=30, kv_gib=0.01, vocab=1000)
    sessions = documents(shape, seed=0, drive=Clients())
    assert sum(len(s) for s in sessions) >= 30
    for turns in sessions:
        longest = max(turns, key=len)
        for turn in turns:  # (one document: every turn is a cut of it plus its own 8-token question)
            body = turn[:-8]
            assert longest[: len(body)] == body and 8 + 8 <= len(body) <= 8 + 200
    assert len({len(t) for turns in sessions for t in turns}) > 3  # (different depths)


def test_ideal_hits_by_hand() -> None:
    sessions = [[[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 9, 9], [1, 2, 3]], [[7, 7, 7]]]
    # 0 (nothing seen) + 4 (blocks (1,2),(3,4)) + 2 ((1,2); at most 3 - 1 tokens, whole blocks) + 0
    assert ideal_hits(sessions, 2) == 6
