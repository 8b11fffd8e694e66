"""Command-line conventions: plain boolean flags, a description for every option, README lists = --help."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()
README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def _commands() -> dict[str, Any]:
    return dict(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def _options(name: str) -> list[Any]:
    """The command's options (typer's own click: TyperOption objects)."""
    return [p for p in _commands()[name].params if p.param_type_name == "option"]


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_has_a_description_and_flags_take_no_value(name: str) -> None:
    for option in _options(name):
        assert option.help, (name, option.opts)
    text = runner.invoke(app, [name, "--help"]).output
    assert "<bool>" not in text
    for option in _options(name):
        if option.is_flag and option.opts[0] != "--help":  # `--json   description`, no value placeholder
            pair = f" / {option.secondary_opts[0]}" if option.secondary_opts else ""  # --x / --no-x
            assert re.search(rf"^\s+{option.opts[0]}{pair}(\s{{2,}}\S|\n)", text, re.MULTILINE), (option.opts, text)


def test_top_level_help_lists_what_exists() -> None:
    text = runner.invoke(app, ["--help"]).output
    assert "--version" in text and "<bool>" not in text
    listed = set(re.findall(r"^\s{2}([a-z]+)\s{2,}", text.split("Commands:")[1], re.MULTILINE))
    assert listed == set(_commands())


@pytest.mark.parametrize(("name", "marker"), [("plan", "`hybridkv plan` options:"), ("run", "`hybridkv run` flags:")])
def test_readme_option_list_matches_help(name: str, marker: str) -> None:
    paragraph = README.split(marker, 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", paragraph))
    actual = {opt for option in _options(name) for opt in option.opts if opt.startswith("--")} - {"--help"}
    assert documented == actual, (sorted(documented - actual), sorted(actual - documented))
