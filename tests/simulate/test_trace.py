"""Trace files for `hybridkv simulate`: the Mooncake format and our JSONL workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.errors import ConfigError
from hybridkv.simulate.trace import TraceFormat, read_trace


def write(tmp_path: Path, records: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_blocks_become_tokens_and_timestamps_start_at_zero(tmp_path: Path) -> None:
    path = write(tmp_path, [
        {"timestamp": 2000, "input_length": 6, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 4, "output_length": 0, "hash_ids": [1]},
    ])
    first, second = read_trace(path, block_tokens=4)  # sorted by arrival
    assert (first.arrival_ms, first.new_tokens, first.output_tokens) == (0.0, (4, 5, 6, 7), 1)
    assert (second.arrival_ms, second.new_tokens, second.output_tokens) == (500.0, (4, 5, 6, 7, 8, 9), 3)


def test_mooncake_length_that_does_not_match_the_blocks_names_the_option(tmp_path: Path) -> None:
    path = write(tmp_path, [{"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [1]}])
    with pytest.raises(ConfigError, match=r"trace line 1: input_length 900 .*--trace-block-tokens"):
        read_trace(path)


def test_workload_sessions_chain_and_text_is_bytes(tmp_path: Path) -> None:
    path = write(tmp_path, [{"session": "a", "prompt": "hi"}, {"prompt_token_ids": [7, 8], "max_tokens": 2},
                            {"session": "a", "prompt": "é"}])
    first, other, second = read_trace(path)
    assert first.new_tokens == (104, 105) and first.parent is None and first.output_tokens == 16
    assert other.parent is None and other.output_tokens == 2
    assert second.parent == 0 and second.new_tokens == (0xC3, 0xA9)
    with pytest.raises(ConfigError, match=r"timestamp. must be a number"):
        read_trace(path, trace_format=TraceFormat.MOONCAKE)
