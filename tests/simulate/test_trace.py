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


def test_cli_replays_a_mooncake_trace(tmp_path: Path) -> None:
    import json as json_module

    from typer.testing import CliRunner

    from hybridkv.cli import app

    # Gemma 3's blocks are 16 tokens: the second request shares its first two 16-token blocks with the first
    path = write(tmp_path, [
        {"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 40, "output_length": 4, "hash_ids": [1, 2, 3]},
    ])
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--trace", str(path), "--trace-block-tokens", "16",
                                      "--memory-gib", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json_module.loads(result.output)
    assert (out["requests"], out["prompt_tokens"], out["hit_tokens"], out["ideal_tokens"]) == (2, 72, 32, 32)
    assert out["request_hits"] == [0, 32] and out["generated_tokens"] == 5


def test_mooncake_prompts_share_each_blocks_token_objects(tmp_path: Path) -> None:
    """Equal hash ids give equal tokens, and one object per distinct token (a long trace's memory)."""
    path = write(tmp_path, [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [5, 6]},
        {"timestamp": 1, "input_length": 7, "output_length": 1, "hash_ids": [5, 7]},
    ])
    first, second = read_trace(path, block_tokens=4)
    assert first.new_tokens == (20, 21, 22, 23, 24, 25, 26, 27) and second.new_tokens == (20, 21, 22, 23, 28, 29, 30)
    assert all(a is b for a, b in zip(first.new_tokens[:4], second.new_tokens[:4], strict=True))


def test_cli_budget_that_cannot_be_simulated_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import hybridkv.cli.simulate as simulate_cli
    from hybridkv.cli import app

    def out_of_memory(*_: object, **__: object) -> None:
        raise MemoryError("Unable to allocate 43.0 GiB for an array with shape (575, 10044620)")

    monkeypatch.setattr(simulate_cli, "simulate", out_of_memory)
    path = write(tmp_path, [{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}])
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--trace", str(path), "--trace-block-tokens",
                                      "16", "--memory-gib", "1"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "cannot be simulated in this machine's memory" in lines[0], result.output
    assert "Traceback" not in result.output


def test_cli_budget_no_machine_holds_is_one_line(tmp_path: Path) -> None:
    """Not mocked: 10^9 GiB is 1.024 * 10^12 blocks of the Mamba hybrid's multi-page layout (4 tensors x
    256 KiB pages of 64 tokens: 1 MiB a block; 7 states x 21 pages + 1 attention group); the pool's arrays
    cannot be allocated, and the CLI says so in one line."""
    from typer.testing import CliRunner

    from hybridkv.cli import app

    path = write(tmp_path, [{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}])
    result = CliRunner().invoke(app, ["simulate", "nemotron-nano-9b-v2", "--trace", str(path), "--trace-block-tokens",
                                      "16", "--memory-gib", "1e9", "--preset", "hybridkv"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "1024000000000 blocks x 148 KV cache groups cannot be simulated" in lines[0], lines
    assert "Traceback" not in result.output


def test_mooncake_records_number_blocks_by_their_prefix_content() -> None:
    """Hand-computed, 4-token blocks: r0 = 1..6 (then 2 generated tokens g0 g1); r1 extends r0 by 9."""
    from hybridkv.simulate.trace import TraceRequest, mooncake_records

    trace = [TraceRequest(arrival_ms=0.0, new_tokens=(1, 2, 3, 4, 5, 6), output_tokens=2),
             TraceRequest(arrival_ms=10.4, new_tokens=(9,), output_tokens=3, parent=0),
             TraceRequest(arrival_ms=20.0, new_tokens=(1, 2, 3, 4, 5, 6, 7), output_tokens=1)]
    assert mooncake_records(trace, block_tokens=4) == [
        {"timestamp": 0, "input_length": 6, "output_length": 2, "hash_ids": [0, 1]},  # [1 2 3 4] [5 6]
        {"timestamp": 10, "input_length": 9, "output_length": 3, "hash_ids": [0, 2, 3]},  # [1-4] [5 6 g0 g1] [9]
        {"timestamp": 20, "input_length": 7, "output_length": 1, "hash_ids": [0, 4]},  # [1-4] [5 6 7]
    ]


def test_cli_writes_a_generated_trace_that_reads_back(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from hybridkv.cli import app
    from hybridkv.simulate.generators import Generator, GeneratorOptions, generate

    out = tmp_path / "sessions.jsonl"
    result = CliRunner().invoke(app, ["simulate", "gemma-3-27b-it", "--generate", "sessions", "--num-requests", "12",
                                      "--memory-gib", "4", "--write-trace", str(out)])
    assert result.exit_code == 0, result.output
    back = read_trace(out)
    generated = generate(Generator.SESSIONS, GeneratorOptions(num_requests=12))
    assert len(back) == 12 and [r.output_tokens for r in back] == [r.output_tokens for r in generated]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in records)
