"""`--prefix-match-unit` on run, serve and simulate: a bad value or a combination the manager does
not take is a usage error (exit 2) naming it, before any model loads."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_engine_commands_refuse_a_non_positive_unit(command: str) -> None:
    result = runner.invoke(app, [command, "--prefix-match-unit", "0"])
    assert result.exit_code == 2
    assert "--prefix-match-unit must be None or a positive integer (tokens), got 0" in result.output


def test_simulate_takes_the_option_with_sub_block_hits() -> None:
    ok = runner.invoke(app, ["simulate", "gemma-3-4b", "--generate", "chat", "--num-requests", "3",
                             "--prefix-match-unit", "8", "--json"])
    assert ok.exit_code == 0, ok.output
    # 32 tokens inside Qwen3.5-0.8B's 544-token blocks: hits land every 32 tokens, blocks are copied on write
    sub = runner.invoke(app, ["simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "3",
                              "--prefix-match-unit", "32", "--json"])
    assert sub.exit_code == 0, sub.output
    report = json.loads(sub.output)
    assert report["block_copies"] > 0 and any(h % 544 for h in report["request_hits"])
    sparse = runner.invoke(app, ["simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "3",
                                 "--prefix-match-unit", "32", "--prefix-cache-retention-interval", "0", "--json"])
    assert sparse.exit_code == 0, sparse.output  # with vLLM's sparse retention too
    assert json.loads(sparse.output)["block_copies"] > 0
    refused = runner.invoke(app, ["simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "3",
                                  "--prefix-match-unit", "48"])
    assert refused.exit_code == 2
    message = " ".join(refused.output.split())  # (a narrow terminal wraps it)
    assert "prefix_match_unit=48 is invalid" in message and "block sizes [544, 544, 544, 544]" in message
