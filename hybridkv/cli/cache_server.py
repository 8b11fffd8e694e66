"""`hybridkv server`: the KV cache server process (docs/design.md §6).

Registered in `hybridkv/cli/__init__.py` as `app.command("server")(server.server_command)`.
Every option's default is `ServerConfig`'s, so each is defined once. It never imports torch or
the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridkv.cache_server.config import ServerConfig
from hybridkv.cache_server.l1_eviction import L1EvictionPolicyName
from hybridkv.cache_server.l2_sizing import L2Sizing
from hybridkv.cache_server.store_config import ObjectGroupMode
from hybridkv.cli.errors import usage_error
from hybridkv.errors import HybridKVError

_D = ServerConfig()


def server_command(
    host: Annotated[str, typer.Option("--host", help="bind address (loopback unless --allow-remote)")] = _D.host,
    port: Annotated[int, typer.Option("--port", help="ZeroMQ control port (0: any free port)")] = _D.port,
    http_port: Annotated[int, typer.Option("--http-port", help="HTTP port of /metrics, /status, /cache/clear, "
                                           "/healthz (0: any free port)")] = _D.http_port,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="tokens per chunk: a multiple of every "
                                            "group's block size")] = _D.chunk_tokens,
    l1_size_gib: Annotated[float, typer.Option(
        "--l1-size-gib", "--l1-size-gb", help="L1 memory pool in GiB (--l1-size-gb: its old name)")] = _D.l1_size_gib,
    eviction_policy: Annotated[L1EvictionPolicyName, typer.Option(
        "--eviction-policy", help="which stored chunk L1 drops first when full")] = _D.eviction_policy,
    separate_object_groups: Annotated[bool, typer.Option(
        "--separate-object-groups/--no-separate-object-groups",
        help="one object group per window class (on) or one for every group")] = True,
    l2_disk: Annotated[Path | None, typer.Option("--l2-disk", help="directory of the L2 disk tier")] = _D.l2_disk,
    l2_disk_size_gib: Annotated[float, typer.Option(
        "--l2-disk-size-gib", "--l2-disk-size-gb",
        help="capacity of the L2 disk tier in GiB (--l2-disk-size-gb: its old name)")] = _D.l2_disk_size_gib,
    l2_sizing: Annotated[L2Sizing, typer.Option(
        "--l2-sizing", help="how a bounded L2 tier makes room: by resumable prefixes (dead objects first, a "
        "state with its attention chain) or object by object (the tier's own LRU)")] = _D.l2_sizing,
    l2_valkey: Annotated[str | None, typer.Option("--l2-valkey", help="redis:// or valkey:// URL of a shared "
                                                  "L2 tier (write-behind, read-through)")] = _D.l2_valkey,
    l2_valkey_namespace: Annotated[str | None, typer.Option(
        "--l2-valkey-namespace", help="this server's keys in the Valkey tier; a clear removes only these (default: "
        "shared by servers with one --auth-token-file secret, else this host, user and --port)")] = (
        _D.l2_valkey_namespace),
    max_message_mib: Annotated[float, typer.Option("--max-message-mib", help="largest control message")] = (
        _D.max_message_mib),
    lock_ttl_s: Annotated[float, typer.Option("--lock-ttl-s", help="how long a lookup holds its chunks")] = (
        _D.lock_ttl_s),
    allow_remote: Annotated[bool, typer.Option("--allow-remote", help="allow a non-loopback --host "
                                               "(set --auth-token-file too)")] = _D.allow_remote,
    auth_token_file: Annotated[Path | None, typer.Option(
        "--auth-token-file", help="file holding the shared secret every client must send (default: "
        "$HYBRIDKV_AUTH_TOKEN, else none)")] = _D.auth_token_file,
    max_registrations: Annotated[int, typer.Option("--max-registrations", help="most engines registered at "
                                                   "once")] = _D.max_registrations,
    kv_events_config: Annotated[str | None, typer.Option(
        "--kv-events-config", help="vLLM's KV events JSON ('{\"enable_kv_cache_events\": true, \"publisher\": "
        "\"zmq\", \"endpoint\": \"tcp://127.0.0.1:5560\"}'): publish the chunks of L1 (medium CPU) and a "
        "sized disk tier (DISK) for `hybridkv index` (register the stream as type hybridkv-server; "
        "docs/routing.md)")] = _D.kv_events_config,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error")] = _D.log_level,
) -> None:
    """Run the KV cache server: every group's pages, memory / disk / Valkey tiers, metrics."""
    from hybridkv.cache_server.service import run_server

    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise usage_error(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    try:
        config = ServerConfig(
            host=host, port=port, http_port=http_port, chunk_tokens=chunk_size, l1_size_gib=l1_size_gib,
            eviction_policy=eviction_policy,
            object_groups=ObjectGroupMode.SEPARATE if separate_object_groups else ObjectGroupMode.ONE,
            l2_disk=l2_disk, l2_disk_size_gib=l2_disk_size_gib, l2_sizing=l2_sizing, l2_valkey=l2_valkey,
            l2_valkey_namespace=l2_valkey_namespace,
            max_message_mib=max_message_mib,
            lock_ttl_s=lock_ttl_s, allow_remote=allow_remote, auth_token_file=auth_token_file,
            max_registrations=max_registrations, log_level=log_level.lower(), kv_events_config=kv_events_config,
        )
        run_server(config)
    except (HybridKVError, OSError) as e:
        raise usage_error(str(e)) from None
