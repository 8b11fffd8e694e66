"""`simulate`'s progress on stderr: requests finished per run (the main run, then `--plot`'s).

On by default where stderr is a terminal: a bar per run, gone once the runs end. `--progress` where it is
not (a log file): a line at every tenth of the trace. `--no-progress`: nothing. stdout, and so `--json`,
never carries it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

#: `simulate`'s callback: (requests finished, requests in the trace)
Update = Callable[[int, int], None]


class RunBars:
    """Progress of each simulated run: `bar(label)` is the callback of the next one (None when off)."""

    def __init__(self, progress: Progress | None, *, lines: bool) -> None:
        self._progress = progress
        self._lines = lines

    def bar(self, label: str) -> Update | None:
        progress = self._progress
        if progress is not None:
            task = progress.add_task(label, total=None)
            return lambda done, total: progress.update(task, completed=done, total=total)
        return _lines(label) if self._lines else None


def _lines(label: str) -> Update:
    """A stderr line each time another tenth of the trace has finished (and at the end)."""
    started = time.perf_counter()
    printed = -1

    def update(done: int, total: int) -> None:
        nonlocal printed
        tenth = done * 10 // max(1, total)
        if tenth > printed:
            printed = tenth
            print(f"simulate {label}: {done}/{total} requests finished ({time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)

    return update


@contextmanager
def run_bars(enabled: bool | None) -> Iterator[RunBars]:
    """The progress of one `simulate` command; `enabled` None: on where stderr is a terminal."""
    terminal = sys.stderr.isatty()
    if not (terminal if enabled is None else enabled):
        yield RunBars(None, lines=False)
        return
    if not terminal:
        yield RunBars(None, lines=True)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        yield RunBars(progress, lines=False)
