"""`--prefix-match-unit` on run, serve and simulate: a bad value or a unit the layout cannot take is
a usage error (exit 2) naming it, before any model loads."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_engine_commands_refuse_a_non_positive_unit(command: str) -> None:
    result = runner.invoke(app, [command, "--prefix-match-unit", "0"])
    assert result.exit_code == 2
    assert "--prefix-match-unit must be None or a positive integer (tokens), got 0" in result.output


def test_simulate_takes_the_option_and_refuses_sub_block_hits() -> None:
    ok = runner.invoke(app, ["simulate", "gemma-3-4b", "--generate", "chat", "--num-requests", "3",
                             "--prefix-match-unit", "8", "--json"])
    assert ok.exit_code == 0, ok.output
    refused = runner.invoke(app, ["simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "3",
                                  "--prefix-match-unit", "32"])
    assert refused.exit_code == 2
    assert "inside the 544-token blocks" in refused.output
