"""The `hybridkv` command line: one entry point, one module per subcommand.

    hybridkv plan MODEL...     KV cache layout and capacity from a config.json (no engine, no GPU)
    hybridkv run               the reference engine on a chat workload
    hybridkv serve             an OpenAI-compatible HTTP server on the reference engine
    hybridkv simulate MODEL    the KV cache manager alone on a trace: hits vs an infinite cache
    hybridkv index             the KV cache indexer routers query (joint hybrid hits per instance)
    hybridkv route             an OpenAI-compatible router over N engines, by the index's joint hit
    hybridkv --version         the installed version

Layout of this package (a newcomer finds each command's code beside its siblings):

    __init__.py      `app` (the typer application), `main` (the console-script entry point) and
                     the one registration line per subcommand below
    errors.py        how a command reports bad input: one red `error:` line on stderr, exit code 2
    plan.py          `hybridkv plan` (options and dispatch)
    plan_report.py   plan tables and the documented JSON report
    plan_plot.py     `plan --plot`: capacity vs context length
    run.py           `hybridkv run`
    serve.py         `hybridkv serve` (the server itself: hybridkv/openai_api/)

Adding a subcommand: write `hybridkv/cli/NAME.py` with one typer command function (keep heavy
imports such as torch inside the function, so `hybridkv plan` stays light), import the module
below and register it with ONE line, e.g.

    app.command("server")(cache_server.server_command)

or, for a subcommand with its own subcommands, `app.add_typer(NAME.app, name="NAME")`.
The entry point stays `hybridkv.cli:main`; `python -m hybridkv` runs the same `main`.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from hybridkv import __version__
from hybridkv.cli import cache_server, index, openai_server, plan, route, run, simulate
from hybridkv.cli.errors import OneLineErrors, PanelledCommand

# Plain (click-style) help, like vLLM's argparse help: `--json  description`, no type column; a parse
# error is one `error:` line, as every other bad input.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, cls=OneLineErrors)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hybridkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    """Hybrid KV cache planner and reference engine."""


# One line per subcommand (see the module docstring).
app.command("plan")(plan.plan_command)
app.command("run", cls=PanelledCommand)(run.run_command)
app.command("server")(cache_server.server_command)
app.command("serve", cls=PanelledCommand)(openai_server.serve_command)
app.command("simulate", cls=PanelledCommand)(simulate.simulate_command)
app.command("index")(index.index_command)
app.command("route")(route.route_command)


def main() -> None:
    """Console-script entry point (`hybridkv`, `python -m hybridkv`). `hybridkv server` first re-executes
    its process with glibc's copy tunable (`cache_server/copy_tuning.py`): a process-wide setting, so
    only the entry point does it, never a command called in-process (a test's `CliRunner`)."""
    if sys.argv[1:2] == ["server"]:
        from hybridkv.cache_server.copy_tuning import reexec_tuned

        reexec_tuned()
    app()
