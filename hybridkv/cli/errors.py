"""How every subcommand reports bad input: one red `error:` line on stderr, exit code 2, no traceback.

Library errors name options as Python does (`max_model_len must be ...`); on the command line
the user typed `--max-model-len`, so `usage_error` renames a leading option name to its flag.
"""

from __future__ import annotations

from collections.abc import Mapping

import typer
from rich.console import Console

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
