"""`hybridkv index`: the Mooncake Conductor Indexer HTTP API over an `IndexService`.

    POST /register        a KV event publisher (ZMQ endpoint, replay endpoint, model, instance, ...)
    POST /unregister      stop consuming it and forget its blocks
    POST /query           {"model", "token_ids", ...} -> {tenant: {instance: {"longest_matched", ...}}}
    POST /query_by_hash   {"model", "seq_hashes", "block_size", ...} -> the same shape
    GET  /health          200 "ok"
    GET  /metrics         Prometheus text: indexed blocks, registrations, ingest and stream counters

With a token (`--auth-token-file` or $HYBRIDKV_INDEX_TOKEN) every POST needs
`Authorization: Bearer <token>`. Bodies are capped (`max_body_bytes`); every error is one JSON line
`{"error": {"message": ...}}` with status 400 / 401 / 404 / 413 / 503, never a traceback. Served by
`IndexServer` (http_server.py: llhttp on an asyncio protocol, no ASGI layer); `AppServer` is uvicorn
for an ASGI app (`hybridkv route`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Literal, TypeVar

import msgspec
import uvicorn

from hybridkv.http_serving import BoundServer, bind_socket, event_loop
from hybridkv.index.http_server import IndexServer, Reply, Routes, json_error
from hybridkv.index.native import native_split_array, native_u32_array
from hybridkv.index.seq_hash import token_bytes
from hybridkv.index.service import IndexFullError, IndexService, Query
from hybridkv.index.table import Registration, group_rule

__all__ = ["AppServer", "IndexServer", "make_routes"]

_T = TypeVar("_T")
_log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # ~2M token ids as JSON
MAX_TOKENS = 2_000_000


class GroupSpecBody(msgspec.Struct, forbid_unknown_fields=True):
    """A hybridkv extension of /register: a group's layout before its first event."""

    kind: str
    block_size: int
    sliding_window: int | None = None
    group_idx: int | None = None


class RegisterBody(msgspec.Struct):
    endpoint: str
    type: str
    modelname: str
    instance_id: str
    block_size: int
    dp_rank: int = 0
    replay_endpoint: str | None = None
    lora_name: str | None = None
    tenant_id: str = "default"
    additionalsalt: str = ""
    kv_groups: list[GroupSpecBody] | None = None


class UnregisterBody(msgspec.Struct):
    instance_id: str
    tenant_id: str = "default"
    dp_rank: int | None = None
    type: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    block_size: int | None = None


class QueryBody(msgspec.Struct):
    model: str
    token_ids: msgspec.Raw = msgspec.Raw()  # (the array's text: parsed natively, `_token_data`)
    seq_hashes: list[int] | None = None
    block_hash: list[int] | None = None  # (an earlier draft's name for seq_hashes)
    tenant_id: str = "default"
    instance_id: str | None = None
    block_size: int | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    num_tokens: int | None = None


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> Reply:
    return json_error(status, message)


def _json(body: Any) -> Reply:
    return 200, msgspec.json.encode(body)


def _decode(raw: bytes, kind: type[_T], path: str) -> _T:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise HttpError(400, f"{path}: {e}") from None
    except msgspec.DecodeError as e:
        raise HttpError(400, f"{path}: body is not JSON ({e})") from None


def _check_endpoint(endpoint: str, field: str) -> None:
    if not endpoint.startswith(("tcp://", "ipc://")) or len(endpoint) > 512:
        raise HttpError(400, f"{field} {endpoint[:80]!r} is not a ZMQ endpoint; expected tcp://HOST:PORT or ipc://PATH")


def _registration(body: RegisterBody) -> Registration:
    _check_endpoint(body.endpoint, "endpoint")
    if body.replay_endpoint is not None:
        _check_endpoint(body.replay_endpoint, "replay_endpoint")
    if body.block_size <= 0 or body.dp_rank < 0:
        raise HttpError(400, f"block_size must be positive and dp_rank non-negative, got {body.block_size} "
                             f"and {body.dp_rank}")
    if not body.instance_id or not body.modelname or len(body.instance_id) > 256 or len(body.modelname) > 256:
        raise HttpError(400, "instance_id and modelname must be non-empty strings of at most 256 characters")
    reg = Registration(key=(body.tenant_id, body.instance_id, body.dp_rank), model=body.modelname,
                       lora_name=body.lora_name or None, block_size=body.block_size, kind=body.type)
    for i, g in enumerate((body.kv_groups or [])[:64]):
        if g.block_size <= 0:
            raise HttpError(400, f"kv_groups[{i}].block_size must be positive, got {g.block_size}")
        reg.groups[g.group_idx if g.group_idx is not None else i] = group_rule(g.kind, g.block_size, g.sliding_window)
    return reg


def _token_data(raw: msgspec.Raw, parsed: memoryview | None) -> memoryview:
    """`token_ids` (the JSON array's text) as little-endian u32 bytes: the native parse, or, when it
    refuses (or is unavailable), msgspec's decode and a check that names the fault."""
    text = bytes(raw)
    data = parsed if parsed is not None else native_u32_array(text) if text else None
    if data is None:
        ids = None if text in (b"", b"null") else _decode(text, list[int], "/query token_ids")
        if ids is None:
            raise HttpError(400, "/query needs token_ids (a list of token ids)")
        if ids and (min(ids) < 0 or max(ids) > 0xFFFFFFFF):
            raise HttpError(400, "token_ids must be integers in 0..4294967295")
        data = token_bytes(ids)
    if len(data) > 4 * MAX_TOKENS:
        raise HttpError(400, f"{len(data) // 4} token ids is over the limit of {MAX_TOKENS}")
    return data


def _query_body(raw: bytes) -> tuple[QueryBody, memoryview | None]:
    """A `/query` body, and its token ids as u32s when the native pass took them (native.py: one pass
    over the array, the small rest decoded by msgspec); else the body as msgspec decodes it whole."""
    split = native_split_array(raw, b"token_ids")
    if split is not None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            return msgspec.json.decode(split[0], type=QueryBody), split[1]
    return _decode(raw, QueryBody, "/query"), None


def _query(body: QueryBody, *, by_hash: bool, token_data: memoryview | None = None) -> Query:
    hashes = body.seq_hashes if body.seq_hashes is not None else body.block_hash
    if by_hash:
        if hashes is None or body.block_size is None or body.block_size <= 0:
            raise HttpError(400, "/query_by_hash needs seq_hashes and a positive block_size")
        if len(hashes) > MAX_TOKENS:
            raise HttpError(400, f"{len(hashes)} seq_hashes is over the limit of {MAX_TOKENS}")
        if any(h < 0 or h >= 1 << 64 for h in hashes):
            raise HttpError(400, "seq_hashes must be unsigned 64-bit integers")
    return Query(model=body.model, tenant_id=body.tenant_id, lora_name=body.lora_name, instance_id=body.instance_id,
                 cache_salt=body.cache_salt, token_data=None if by_hash else _token_data(body.token_ids, token_data),
                 seq_hashes=hashes if by_hash else None, block_size=body.block_size, num_tokens=body.num_tokens)


def _metrics(service: IndexService) -> str:
    table = service.table
    c = table.counts
    lines = [
        f"hybridkv_index_blocks {table.num_blocks}",
        f"hybridkv_index_registrations {len(table.registrations)}",
        f"hybridkv_index_stored_blocks_total {c.stored_blocks}",
        f"hybridkv_index_removed_blocks_total {c.removed_blocks}",
        f"hybridkv_index_unplaced_blocks_total {c.unplaced_blocks}",
        f"hybridkv_index_skipped_blocks_total {c.skipped_blocks}",
        f"hybridkv_index_unknown_removals_total {c.unknown_removals}",
    ]
    if service.subscriber is not None:
        s = service.subscriber.counts
        lines += [f"hybridkv_index_batches_total {s.batches}", f"hybridkv_index_sequence_gaps_total {s.gaps}",
                  f"hybridkv_index_replayed_batches_total {s.replayed}", f"hybridkv_index_resets_total {s.resets}",
                  f"hybridkv_index_bad_messages_total {s.bad_messages}",
                  f"hybridkv_index_duplicate_batches_total {s.duplicates}"]
    return "\n".join(lines) + "\n"


def make_routes(service: IndexService, *, token: str = "", max_body_bytes: int = MAX_BODY_BYTES) -> Routes:
    """The index's routes over `service` (`token` empty: no authentication), for `IndexServer`."""

    def register(raw: bytes) -> Reply:
        body = _decode(raw, RegisterBody, "/register")
        service.register(_registration(body), body.endpoint, body.replay_endpoint)
        return _json({"status": "registered successfully", "instance_id": body.instance_id})

    def unregister(raw: bytes) -> Reply:
        body = _decode(raw, UnregisterBody, "/unregister")
        removed = service.unregister(body.tenant_id, body.instance_id, body.dp_rank)
        if not removed:
            raise HttpError(404, f"no registration of instance {body.instance_id[:80]!r} under tenant "
                                 f"{body.tenant_id[:80]!r}")
        return _json({"status": "unregistered successfully", "removed_instances": removed})

    def query(raw: bytes) -> Reply:
        body, data = _query_body(raw)
        return _json(service.query(_query(body, by_hash=False, token_data=data)))

    def query_by_hash(raw: bytes) -> Reply:
        return _json(service.query(_query(_decode(raw, QueryBody, "/query_by_hash"), by_hash=True)))

    def health() -> tuple[int, bytes, bytes]:
        return 200, b"ok", b"text/plain; charset=utf-8"

    def metrics() -> tuple[int, bytes, bytes]:
        with service.lock:
            text = _metrics(service)
        return 200, text.encode(), b"text/plain; version=0.0.4"

    def on_error(path: str, e: Exception) -> Reply:
        if isinstance(e, HttpError):
            return _error(e.status, e.message)
        if isinstance(e, IndexFullError):
            return _error(503, str(e))
        _log.exception("%s failed", path)  # (a bug: the traceback to the log, one line to the client)
        return _error(500, f"internal error: {type(e).__name__}")

    return Routes(posts={"/register": register, "/unregister": unregister, "/query": query,
                         "/query_by_hash": query_by_hash},
                  gets={"/health": health, "/metrics": metrics}, secret=token.encode(), max_body_bytes=max_body_bytes,
                  not_found="no such route; expected POST /register, /unregister, /query, /query_by_hash",
                  on_error=on_error)


class AppServer(BoundServer):
    """uvicorn serving an ASGI app (`hybridkv route`'s) on a socket bound at construction (port 0 works;
    an address in use: ConfigError)."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "hybridkv-http",
                 lifespan: Literal["on", "off"] = "off") -> None:
        sock = bind_socket(host, port)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan, loop=event_loop(),
                                http="httptools", timeout_keep_alive=30, limit_concurrency=1024)
        super().__init__(uvicorn.Server(config), sock, name=name)
