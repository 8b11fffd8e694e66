"""Layer lists as the plan tables write them, checked against hand-written expectations."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.cli.tables import SHORT_LAYER_LIST, layer_list


@pytest.mark.parametrize(("names", "expected"), [
    (["0", "1", "2", "3", "4", "6", "8", "9", "10"], "0-4,6,8-10"),
    (["0", "1"], "0,1"),
    ([f"{i}.mamba" for i in range(44)], "0-43.mamba"),
    (["0", "2", "1"], "0,2,1"),  # a short list keeps the given order (the tensor slots' order)
    ([str(i) for i in range(5, 60, 6)], "5,11,17,23,29,35,41,47,53,59"),  # short: every layer written
])
def test_short_lists_name_every_layer_or_run(names: list[str], expected: str) -> None:
    assert layer_list(names) == expected


def test_long_lists_use_steps_per_part() -> None:
    # DeepSeek-V4-Flash group 2: the indexer of every even layer from 2, the compressed latents of 2..42
    names = [n for i in range(2, 43) for n in ([f"{i}.indexer"] if i % 2 == 0 else []) + [f"{i}.compressed"]]
    assert len(",".join(names)) > SHORT_LAYER_LIST
    assert layer_list(names) == "2-42/2.indexer,2-42.compressed"
    window = ["0", *(f"{i}.swa" for i in range(2, 43, 2))]
    assert layer_list(window) == "0,2-42/2.swa"
    # three layers of one step are written out; a run needs four
    assert layer_list([str(i) for i in (*range(0, 100, 5), 101, 103, 105)]) == "0-95/5,101,103,105"


def test_deepseek_v4_plan_shows_each_block_size() -> None:
    result = CliRunner().invoke(app, ["plan", "deepseek-v4-flash"])
    assert result.exit_code == 0, result.output
    assert "4/8/64/256" in result.output and "2-42/2.indexer,2-42.compressed" in result.output
