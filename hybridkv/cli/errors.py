"""How every subcommand reports bad input: one red `error:` line on stderr, exit code 2, no traceback.

Library errors name options as Python does (`max_model_len must be ...`); on the command line
the user typed `--max-model-len`, so `usage_error` renames a leading option name to its flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import typer
from rich.console import Console
from typer._click.core import Context, Parameter  # typer 0.29 vendors click: its own Context and parse errors
from typer._click.exceptions import UsageError
from typer._click.formatting import HelpFormatter
from typer.core import TyperCommand, TyperGroup

USAGE_EXIT_CODE = 2


def flags_of(names: list[str], **renamed: str) -> dict[str, str]:
    """`{"max_model_len": "--max-model-len", ...}`; `renamed` overrides, e.g. num_threads="--threads"."""
    return {name: renamed.get(name, "--" + name.replace("_", "-")) for name in names}


def in_flag_words(message: str, flags: Mapping[str, str]) -> str:
    """`max_model_len 0 ...` -> `--max-model-len 0 ...` when the message starts with an option name."""
    first, sep, rest = message.partition(" ")
    return f"{flags[first]}{sep}{rest}" if first in flags else message


def usage_error(message: str, flags: Mapping[str, str] | None = None) -> typer.Exit:
    """Print `error: MESSAGE` on stderr and return the `typer.Exit` the caller raises."""
    text = in_flag_words(message, flags) if flags else message
    Console(stderr=True).print(f"[bold red]error:[/] {text}", highlight=False, soft_wrap=True)
    return typer.Exit(code=USAGE_EXIT_CODE)


class OneLineErrors(TyperGroup):
    """The command group whose parse errors (a wrong type, a missing argument, an unknown option) are
    one `error:` line as well, instead of click's usage block."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            sub = [exc.ctx.info_name or ""] if exc.ctx is not None and exc.ctx is not ctx else []
            command = " ".join(["hybridkv", *ctx.command_path.split()[1:], *sub])
            raise usage_error(f"{exc.format_message().rstrip('.')}; see `{command} --help`") from None


class PanelledCommand(TyperCommand):
    """A command whose plain `--help` lists the options of each `rich_help_panel` (e.g. "Engine",
    "Cache policy") under a heading of their own, after the command's other options."""

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        panels: dict[str, list[Parameter]] = {}
        for param in self.params:
            panel = getattr(param, "rich_help_panel", None)
            if panel:
                panels.setdefault(panel, []).append(param)
        original = self.params
        try:
            self.params = [p for p in original if not getattr(p, "rich_help_panel", None)]
            super().format_options(ctx, formatter)
        finally:
            self.params = original
        for panel, params in panels.items():
            records = [record for record in (p.get_help_record(ctx) for p in params) if record]
            with formatter.section(panel):
                formatter.write_dl(records)
