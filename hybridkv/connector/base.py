"""The KV connector interface: what an engine implements against to load and save KV through an
external KV cache, one object per (chunk, object group), for every KV cache group at once.

Two sides, which may live in different processes (as vLLM's scheduler and workers do):

    scheduler side (KVConnectorScheduler)            worker side (KVConnectorWorker)
    -------------------------------------            -------------------------------
    get_num_new_matched_tokens(req, local_hit)       start_load_kv(meta)  /  wait_for_load()
      -> tokens the server adds beyond the local hit save_kv(meta)        /  wait_for_save()
    update_state_after_alloc(req, blocks, external)  get_finished() -> (saved ids, loaded ids)
    build_connector_meta(steps) -> ConnectorMeta     get_failed_loads() -> request ids
    request_finished(req_id, blocks) -> hold blocks?
    request_load_failed(req_id)

The interface has no registration verb: an implementation registers the engine's KV cache
buffers when it is built. `ServerConnector` registers its wire `Layout` (passing the buffers'
memfd segments, docs/cache_server_security.md) from its constructor, retries while the server is unreachable, and its
`KVClient` registers again when a restarted server has forgotten it; the vLLM integration builds
its `ServerConnector` in vLLM's `register_kv_caches`.

One engine step, in order: the scheduler looks up its local prefix cache, then asks
`get_num_new_matched_tokens`; it allocates blocks for local hit + external tokens + new tokens
(caching of the external range delayed) and calls `update_state_after_alloc` with the block ids
of every group. `build_connector_meta` turns the step's scheduled work into loads (external hits
to copy into blocks) and saves (chunks the step completes, with the blocks of every group while
window blocks are still live). The worker loads before the forward pass and saves after it. A
load that failed is reported by `get_failed_loads`; the engine then frees that request's blocks
and recomputes it (`request_load_failed` tells the scheduler side to stop offering that hit).

Block ids are per group and pool-wide (`block_ids[g][i]`: group g's block of table entry i, 0 =
the null block where a group keeps nothing). Pure Python: no torch, no engine imports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "ConnectorMeta", "ConnectorRequest", "KVConnectorScheduler", "KVConnectorWorker", "LoadSpec", "SaveSpec",
    "StepWork",
]

BlockTables = Sequence[Sequence[int]]  # per group: block id of each table entry


class ConnectorRequest(Protocol):
    """What the connector reads of a request (the manager's `KVRequest` has these fields)."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def cache_salt(self) -> str | None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWork:
    """One request's work in a step: tokens [start, end) are computed; `block_tables` are the
    request's tables of every group after this step's allocation."""

    request: ConnectorRequest
    start: int
    end: int
    block_tables: BlockTables


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadSpec:
    """Copy the server's hit into the request's blocks: tokens [skip_tokens, skip_tokens +
    num_external_tokens) are new; blocks that end at or before `skip_tokens` (the local hit)
    are not written."""

    request_id: str
    lookup_id: int
    skip_tokens: int
    num_external_tokens: int
    block_tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveSpec:
    """Store chunks first_chunk .. first_chunk + len(chunk_hashes) - 1 of one request;
    `block_ids[g]` are group g's blocks of exactly those chunks (0 where a group keeps none)."""

    request_id: str
    first_chunk: int
    chunk_hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    cache_salt: str
    parent_hash: bytes = b""  # chunk first_chunk - 1's hash (b"" for chunk 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorMeta:
    """What the worker side does in one step."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(slots=True)
class TransferStats:
    """Counters of one connector (engine side), per object group where the server reports them."""

    lookups: int = 0
    external_hit_tokens: int = 0
    loads: int = 0
    failed_loads: int = 0
    loaded_bytes: int = 0
    saved_chunks: int = 0
    refused_chunks: int = 0
    failed_saves: int = 0
    errors: int = 0
    saved_bytes_by_group: dict[str, int] = field(default_factory=dict)
    loaded_bytes_by_group: dict[str, int] = field(default_factory=dict)


class KVConnectorScheduler(ABC):
    """Scheduler side: decides what to load and what to save; moves no data."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_local_hit_tokens: int) -> int:
        """Tokens beyond the local hit that the external cache can supply (0: none), leaving at
        least the last prompt token to compute. May be asked again for the same request."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_tables: BlockTables,
                                 num_external_tokens: int) -> None:
        """The request got blocks for local hit + `num_external_tokens` (+ its new tokens)."""

    @abstractmethod
    def build_connector_meta(self, steps: Sequence[StepWork]) -> ConnectorMeta:
        """Loads of the requests allocated since the last call, saves of the chunks this step completes."""

    @abstractmethod
    def request_finished(self, request_id: str, block_tables: BlockTables) -> bool:
        """The request finished or was preempted; True when its blocks must stay held until a save
        in flight completes (`get_finished` then reports it)."""

    @abstractmethod
    def request_load_failed(self, request_id: str) -> None:
        """The request's load failed: it is recomputed, and gets no external hit for that prefix again."""


class KVConnectorWorker(ABC):
    """Worker side: owns the registration of the KV cache buffers and moves the pages."""

    @abstractmethod
    def start_load_kv(self, meta: ConnectorMeta) -> None:
        """Start copying every load of `meta` into the KV cache buffers."""

    @abstractmethod
    def wait_for_load(self) -> None:
        """Block until the loads started are done (failed ones included)."""

    @abstractmethod
    def save_kv(self, meta: ConnectorMeta) -> None:
        """Start storing every save of `meta` (after the forward pass wrote those pages)."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until the saves started are done."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose saves and whose loads finished since the last call."""

    @abstractmethod
    def get_failed_loads(self) -> set[str]:
        """Request ids whose load failed since the last call (their blocks hold no valid KV)."""
