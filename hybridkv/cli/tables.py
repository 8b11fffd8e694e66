"""Tables a person can read on an 80-column terminal and in a pipe.

Every column folds (wraps inside a word) instead of cutting text with an ellipsis, so an id a
user must type is never shortened. On a terminal the table fits its width; in a pipe or a file
there is no width to fit, so the console is as wide as the content needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

PIPE_WIDTH = 10_000  # in a pipe: wide enough that no table wraps; rich prints only what the content needs
Justify = Literal["left", "right"]


def stdout_console() -> Console:
    """The console for a command's report: the terminal's width, or unlimited in a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def new_table(*columns: str | tuple[str, Justify], show_header: bool = True, compact: bool = False) -> Table:
    """A table whose text columns fold rather than truncate.

    A column given as (name, "right") is a right-aligned figure that never wraps, so on a narrow
    terminal only the text columns (ids, layer lists) fold. `compact` drops the vertical rules.
    """
    table = Table(show_header=show_header, box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD)
    for column in columns:
        if isinstance(column, str):
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column[0], justify=column[1], no_wrap=True)
    return table


def print_table(console: Console, table: Table, *, title: str, caption: str | None = None) -> None:
    """Title line, table, caption line: titles and captions wrap at the console, not at the table's width."""
    console.print(f"[bold]{escape(title)}[/]", highlight=False)
    console.print(table)
    if caption:
        console.print(caption, highlight=False, markup=False)


SHORT_LAYER_LIST = 60  # characters: a longer list is written per part, in arithmetic runs


def layer_list(names: Sequence[str]) -> str:
    """Layer names with runs of consecutive layers as ranges: `0-4,6,8-10`, `0-43.mamba`.

    A name is `7` or `7.part` (`7.attn`, `7.swa`); a run shares its part. A list longer than
    SHORT_LAYER_LIST characters is written per part (the parts in the order they first appear),
    with runs of a wider step as `a-b/step` (4 layers or more): `5-59/6`, `2-42/2.swa,2-42.compressed`.
    Never cut: the column folds.
    """
    runs: list[tuple[int, int, str]] = []
    for name in names:
        layer_text, _, part = name.partition(".")
        layer = int(layer_text)
        if runs and runs[-1][1] == layer - 1 and runs[-1][2] == part:
            runs[-1] = (runs[-1][0], layer, part)
        else:
            runs.append((layer, layer, part))
    text = ",".join(_run_text(*run) for run in runs)
    if len(text) <= SHORT_LAYER_LIST:
        return text
    parts: dict[str, list[int]] = {}
    for name in names:
        layer_text, _, part = name.partition(".")
        parts.setdefault(part, []).append(int(layer_text))
    return ",".join(run for part, layers in parts.items() for run in _runs(sorted(set(layers)), part))


def _run_text(first: int, last: int, part: str) -> str:
    suffix = f".{part}" if part else ""
    if first == last:
        return f"{first}{suffix}"
    if last == first + 1:
        return f"{first}{suffix},{last}{suffix}"
    return f"{first}-{last}{suffix}"


def _runs(layers: list[int], part: str) -> list[str]:
    suffix = f".{part}" if part else ""
    out: list[str] = []
    i = 0
    while i < len(layers):
        end = i
        if i + 1 < len(layers):
            step = layers[i + 1] - layers[i]
            while end + 1 < len(layers) and layers[end + 1] - layers[end] == step:
                end += 1
            if end - i + 1 < (3 if step == 1 else 4):
                end = i
        if end == i:
            out.append(f"{layers[i]}{suffix}")
        else:
            step_text = "" if layers[i + 1] - layers[i] == 1 else f"/{layers[i + 1] - layers[i]}"
            out.append(f"{layers[i]}-{layers[end]}{step_text}{suffix}")
        i = end + 1
    return out
