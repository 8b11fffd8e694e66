"""`hybridkv index`: the KV cache indexer service (hybridkv/index/, docs/routing.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridkv.cli.errors import usage_error
from hybridkv.errors import HybridKVError


def index_command(
    host: Annotated[str, typer.Option("--host", help="bind address (loopback unless --allow-remote)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (0: any free port)")] = 8200,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow a non-loopback --host (needs a "
                                               "token)")] = False,
    auth_token_file: Annotated[Path | None, typer.Option(
        "--auth-token-file", help="file holding the bearer token of /register, /unregister and /query "
        "(default: $HYBRIDKV_INDEX_TOKEN, else none)")] = None,
    max_blocks: Annotated[int, typer.Option("--max-blocks", help="most indexed blocks (later ones are counted "
                                            "and dropped)")] = 4_000_000,
    max_registrations: Annotated[int, typer.Option("--max-registrations", help="most registered "
                                                   "publishers")] = 1024,
    dead_after_s: Annotated[float, typer.Option("--dead-after-s", help="a publisher that answers no probe "
                                                "for this long loses its entries")] = 10.0,
) -> None:
    """Serve the KV cache index: the Mooncake Conductor API, answering the joint hybrid hit."""
    from hybridkv.http_serving import tune_for_latency
    from hybridkv.index.auth import check_bind, index_token
    from hybridkv.index.http import IndexServer, make_routes
    from hybridkv.index.service import IndexService

    if max_blocks <= 0 or max_registrations <= 0 or dead_after_s <= 0:
        raise usage_error(f"--max-blocks, --max-registrations and --dead-after-s must be positive, got "
                          f"{max_blocks}, {max_registrations} and {dead_after_s}")
    try:
        token = index_token(auth_token_file)
        check_bind(host, allow_remote=allow_remote, token=token)
        service = IndexService(max_blocks=max_blocks, max_registrations=max_registrations, dead_after_s=dead_after_s)
        server = IndexServer(make_routes(service, token=token), host=host, port=port, name="hybridkv-index")
    except (HybridKVError, OSError) as e:
        raise usage_error(str(e)) from None
    typer.echo(f"hybridkv index on {server.url} (auth {'on' if token else 'off'})")
    tune_for_latency()
    try:
        server.run()
    finally:
        service.close()
