"""How every subcommand reports bad input: one red `error:` line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import typer
from rich.console import Console

USAGE_EXIT_CODE = 2


def usage_error(message: str) -> typer.Exit:
    """Print `error: MESSAGE` on stderr and return the `typer.Exit` the caller raises."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code=USAGE_EXIT_CODE)
