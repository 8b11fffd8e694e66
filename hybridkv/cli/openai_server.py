"""`hybridkv serve`: an OpenAI-compatible HTTP server on the reference engine (hybridkv/openai_api/).

Registered in `hybridkv/cli/__init__.py` as `app.command("serve")(serve.serve_command)`. The
engine options are `hybridkv run`'s (EngineConfig's defaults); torch loads only when the command
runs. Every flag is checked before the model loads, and the address is bound before the server
says it is ready, so a bad option, a missing model or a port in use is one `error:` line, exit
code 2. A clean stop on SIGTERM exits 0, on Ctrl-C 130.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from hybridkv.cli import engine_options as opt
from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.engine.config import DEFAULT_MODEL_NAME, EngineConfig
from hybridkv.errors import HybridKVError
from hybridkv.kvcache.options import describe

if TYPE_CHECKING:
    from hybridkv.engine.llm import LLM

SERVE_FLAGS = flags_of([*EngineConfig.option_names(), "host", "port"], num_threads="--threads")
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="HYBRIDKV_API_KEY", show_envvar=True,
    help="require 'Authorization: Bearer KEY' on /v1/* and POST /reset_prefix_cache")]
MaxBodyBytes = Annotated[int, typer.Option("--max-body-bytes", help="largest request body (413 beyond)")]
HeaderTimeout = Annotated[float, typer.Option(
    "--header-timeout-s", help="close a connection that has not sent its request head within this time")]
BodyTimeout = Annotated[float, typer.Option(
    "--body-timeout-s", help="answer 408 to a request whose body has not all arrived within this time")]
IdleTimeout = Annotated[int, typer.Option("--idle-timeout-s", help="close a keep-alive connection idle this long")]
MaxConnections = Annotated[int, typer.Option(
    "--max-connections", help="open connections (and requests) at most; beyond: 503")]


@opt.with_engine_options
def serve_command(
    model: opt.Model = DEFAULT_MODEL_NAME,
    host: Annotated[str, typer.Option("--host", help="bind address (loopback unless --allow-remote)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (0: any free port)")] = 8000,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="the model name clients send (default: --model)")] = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow a non-loopback --host "
                                               "(set --api-key too)")] = False,
    graceful_s: Annotated[float, typer.Option("--graceful-s", help="on Ctrl-C / SIGTERM, seconds the requests in "
                                              "flight may take to finish")] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error")] = "info",
    api_key: ApiKey = None,
    max_body_bytes: MaxBodyBytes = 4 * 1024 * 1024,
    header_timeout_s: HeaderTimeout = 10.0,
    body_timeout_s: BodyTimeout = 30.0,
    idle_timeout_s: IdleTimeout = 5,
    max_connections: MaxConnections = 1024,
    *,
    engine: EngineConfig,
) -> None:
    """Serve the model over OpenAI's HTTP API: /v1/completions, /v1/chat/completions, /metrics.

    Streaming (SSE) and not; the engine batches every request in flight (continuous batching)
    over the hybrid KV cache with prefix caching. Ctrl-C stops gracefully.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `hybridkv run`: idle OpenMP threads sleep
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise usage_error(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    if graceful_s < 0:
        raise usage_error(f"--graceful-s must be >= 0, got {graceful_s}")
    if not 0 <= port <= 65535:
        raise usage_error(f"--port must be in [0, 65535] (0: any free port), got {port}")
    try:
        from hybridkv.openai_api.http_server import ServeServer, check_host
        from hybridkv.openai_api.limits import ServeLimits

        check_host(host, allow_remote=allow_remote)
        if any(arg == "--api-key" or arg.startswith("--api-key=") for arg in sys.argv):
            typer.echo("warning: --api-key on the command line is visible to every user (ps, /proc); set "
                       "$HYBRIDKV_API_KEY instead", err=True)
        limits = ServeLimits(api_key=api_key, max_body_bytes=max_body_bytes, header_timeout_s=header_timeout_s,
                             body_timeout_s=body_timeout_s, idle_timeout_s=idle_timeout_s,
                             max_connections=max_connections)
        from hybridkv.engine.llm import LLM

        llm = LLM(model, **opt.engine_kwargs(engine))
        try:
            server = ServeServer(llm, host=host, port=port, model_name=served_model_name or model,
                                 allow_remote=allow_remote, graceful_s=graceful_s, log_level=log_level.lower(),
                                 limits=limits)
        except BaseException:
            llm.close()  # a KV cache server started for "auto" goes with it
            raise
    except HybridKVError as exc:
        raise usage_error(str(exc), SERVE_FLAGS) from None
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())  # until uvicorn installs its own handlers
    if api_key is None and not server.loopback:
        typer.echo(f"warning: serving {server.url} to other machines without --api-key: anyone who reaches it may "
                   "use it", err=True)
    typer.echo(f"hybridkv serve: {served_model_name or model} on {server.url} (max_model_len {llm.max_model_len}"
               f"; cache {describe(llm.config.cache)}{_kv_server_words(llm)}); Ctrl-C to stop", err=True)
    server.run()
    if server.interrupted:
        raise typer.Exit(130)


def _kv_server_words(llm: LLM) -> str:
    """`; KV cache server URL (started for this server)` when one is attached."""
    transfer = llm.transfer
    if transfer is None:
        return ""
    if transfer.server is not None:
        return f"; KV cache server {transfer.server.endpoint} (started for this server, stops with it)"
    return f"; KV cache server {llm.config.kv_server}"
