"""`hybridkv serve`: an OpenAI-compatible HTTP server on the reference engine (hybridkv/serve/).

Registered in `hybridkv/cli/__init__.py` as `app.command("serve")(serve.serve_command)`. The
engine options are `hybridkv run`'s (EngineConfig's defaults); torch loads only when the command
runs. The model loads and the address is bound before the server says it is ready, so a bad
option, a missing model or a port in use is one `error:` line, exit code 2.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from hybridkv.cli.errors import flags_of, usage_error
from hybridkv.core.errors import HybridKVError
from hybridkv.core.kv_cache_manager import MambaCacheMode, PrefixCaching
from hybridkv.engine.config import DEFAULT_MODEL_NAME, EngineConfig

_D = EngineConfig.defaults()
SERVE_FLAGS = flags_of([*EngineConfig.option_names(), "host", "port"], num_threads="--threads")


def serve_command(
    model: Annotated[str, typer.Option("--model", "-m", help="HF-format model directory, or the embedded default")]
    = DEFAULT_MODEL_NAME,
    host: Annotated[str, typer.Option("--host", help="bind address (loopback unless --allow-remote)")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (0: any free port)")] = 8000,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="the model name clients send (default: --model)")] = None,
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow a non-loopback --host "
                                               "(no authentication!)")] = False,
    graceful_s: Annotated[float, typer.Option("--graceful-s", help="on Ctrl-C / SIGTERM, seconds the requests in "
                                              "flight may take to finish")] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error")] = "info",
    kv_server: Annotated[str | None, typer.Option(
        "--kv-server", help="attach a KV cache server: tcp://host:port of a running `hybridkv server`, or auto "
                            "(start one for this server, stopped with it)")] = _D["kv_server"],
    kv_server_timeout_s: Annotated[float, typer.Option(
        "--kv-server-timeout-s", help="bound on each call to the KV cache server")] = _D["kv_server_timeout_s"],
    kv_cache_memory_gib: Annotated[float, typer.Option(help="KV cache budget in GiB")] = _D["kv_cache_memory_gib"],
    max_num_batched_tokens: Annotated[int, typer.Option(help="token budget per step")] = _D["max_num_batched_tokens"],
    max_num_seqs: Annotated[int, typer.Option(help="most requests running at once")] = _D["max_num_seqs"],
    max_model_len: Annotated[int | None, typer.Option(
        help="longest prompt + output (default: the model's limit, at most 4096)")] = _D["max_model_len"],
    block_size: Annotated[int, typer.Option(help="attention block size in tokens")] = _D["block_size"],
    prefix_caching: Annotated[PrefixCaching, typer.Option(help="prefix caching")] = _D["prefix_caching"],
    mamba_cache_mode: Annotated[MambaCacheMode, typer.Option(
        help="state checkpoints (Mamba / Gated DeltaNet): align = where a step ends on a block boundary, "
             "all = at every block boundary")] = _D["mamba_cache_mode"],
    seed: Annotated[int, typer.Option(help="sampling seed of requests that set none")] = _D["seed"],
    num_threads: Annotated[int, typer.Option("--threads", help="torch threads (0: torch default)")]
    = _D["num_threads"],
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
    try:
        from hybridkv.serve.server import ServeServer, check_host

        check_host(host, allow_remote=allow_remote)
        options = dict(kv_cache_memory_gib=kv_cache_memory_gib, max_num_batched_tokens=max_num_batched_tokens,
                       max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                       prefix_caching=prefix_caching, mamba_cache_mode=mamba_cache_mode, seed=seed,
                       num_threads=num_threads, kv_server=kv_server, kv_server_timeout_s=kv_server_timeout_s)
        EngineConfig.from_options(options)
        from hybridkv.engine.llm import LLM

        llm = LLM(model, **options)
        try:
            server = ServeServer(llm, host=host, port=port, model_name=served_model_name or model,
                                 allow_remote=allow_remote, graceful_s=graceful_s, log_level=log_level.lower())
        except BaseException:
            llm.close()  # a KV cache server started for "auto" goes with it
            raise
    except HybridKVError as exc:
        raise usage_error(str(exc), SERVE_FLAGS) from None
    typer.echo(f"hybridkv serve: {served_model_name or model} on {server.url} (max_model_len {llm.max_model_len}); "
               "Ctrl-C to stop", err=True)
    server.run()
