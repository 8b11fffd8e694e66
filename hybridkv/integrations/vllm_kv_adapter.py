"""hybridkv's `KVCacheManager` behind the verbs vLLM's scheduler calls on its own `KVCacheManager`.

`HybridKVScheduler` (vllm_scheduler.py) swaps its manager for a `VllmManagerAdapter`. The adapter
answers every verb vLLM 0.32's `Scheduler` calls with hybridkv's public verbs only:

    vLLM (scheduler -> manager)                  hybridkv KVCacheManager
    new_step_starts()                         -> begin_step()
    get_computed_blocks(request)              -> lookup(kv): the hit is kept for allocate_slots
    allocate_slots(request, n, hit, ...)      -> allocate(kv, n, hit=, num_external_tokens=, caching=)
    cache_blocks(request, n)                  -> cache(kv, n)
    free(request)                             -> free(kv)
    get_blocks / get_block_ids(request_id)    -> block_ids(request_id) (0 = vLLM's null block)
    take_events()                             -> take_events(), as vLLM's BlockStored / BlockRemoved
    usage, reset_prefix_cache()               -> usage(), reset_prefix_cache()
    make_prefix_cache_stats / record_...      -> counted here, as vLLM counts them (admitted hits)
    take_new_block_ids()                      -> the attention blocks `allocate` handed out (zeroing)

The block ids, the groups (vLLM's order) and the null block 0 are vLLM's own: the runner builds its
tables from them unchanged. The verbs that exist for features the scheduler refuses at startup
(copy-on-write partial hits, deferred frees, evicting blocks of a failed load, partial-tail
offloads) and any attribute below the manager (`coordinator`, `block_pool`) raise
`UnsupportedByAdapter`: never a silent answer. docs/vllm.md lists each one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import ConfigError, HybridKVError, UnknownRequestError
from hybridkv.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import CacheHit, CacheTiming, KVCacheManager
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest, MultiModalFeature
from hybridkv.plan.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MambaType, SpecKind

__all__ = ["UnsupportedByAdapter", "VllmManagerAdapter", "hybridkv_config"]


class UnsupportedByAdapter(HybridKVError):
    """vLLM's scheduler reached a verb or attribute the adapter does not answer."""


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_spec(spec: Any) -> LayerSpec:
    """hybridkv's spec of one vLLM KV cache spec (the hit and release rules follow the kind)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.kv_cache_interface import (
        MambaSpec as VllmMambaSpec,
    )

    if isinstance(spec, VllmMambaSpec):
        return MambaSpec(mamba_type=MambaType.GATED_DELTANET, shapes=tuple(tuple(s) for s in spec.shapes),
                         dtypes=tuple(_dtype_name(d) for d in spec.dtypes))
    heads, head_dim, dtype = int(spec.num_kv_heads), int(spec.head_size), _dtype_name(spec.dtype)
    if isinstance(spec, CrossAttentionSpec):
        raise ConfigError("HybridKVScheduler supports decoder-only models; got a cross-attention KV cache group "
                          "(an encoder-decoder model): use vLLM's own scheduler")
    if isinstance(spec, SlidingWindowSpec):
        return AttentionSpec(kind=SpecKind.SLIDING_WINDOW, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                             window_tokens=int(spec.sliding_window))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return AttentionSpec(kind=SpecKind.CHUNKED_LOCAL, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                             chunk_tokens=int(spec.attention_chunk_size))
    if type(spec) is FullAttentionSpec:
        return AttentionSpec(kind=SpecKind.FULL, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    raise ConfigError(f"HybridKVScheduler does not support vLLM KV cache spec {type(spec).__name__}; expected "
                      f"FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec or MambaSpec")


def hybridkv_config(kv_cache_config: Any, *, model: str) -> KVCacheConfig:
    """hybridkv's `KVCacheConfig` of vLLM's: the same groups in vLLM's order, block sizes and block count.

    Raises:
        ConfigError: a spec the manager does not model (cross attention, MLA, ...).
    """
    groups = []
    first = 0
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = tuple(range(first, first + len(group.layer_names)))
        first += len(layers)
        groups.append(KVCacheGroupSpec(group_id=gid, spec=_layer_spec(spec), layer_indices=layers,
                                       block_size=int(spec.block_size)))
    page = max((int(g.kv_cache_spec.page_size_bytes) for g in kv_cache_config.kv_cache_groups), default=1)
    return KVCacheConfig(model=model, num_blocks=int(kv_cache_config.num_blocks), page_size_bytes=page,
                         group_size=max((len(g.layer_indices) for g in groups), default=1), groups=tuple(groups),
                         tensors=())


def _kv_request(request: Any) -> KVRequest:
    lora = getattr(request, "lora_request", None)
    features = []
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        features.append(MultiModalFeature(identifier=str(feature.identifier), offset_tokens=int(position.offset),
                                          length_tokens=int(position.length)))
    return KVRequest(request_id=RequestId(request.request_id), token_ids=list(request.all_token_ids),
                     cache_salt=request.cache_salt, lora_name=None if lora is None else lora.lora_name,
                     mm_features=tuple(features))


@dataclass(frozen=True, slots=True)
class _GroupView:
    """What the engine core reads of one of vLLM's single-type managers: its group's spec and block size."""

    kv_cache_group_id: int
    kv_cache_spec: Any
    block_size: int


class _Below:
    """What the adapter answers for vLLM's `coordinator` / `block_pool`: the groups' specs (the engine
    core reads them at startup), nothing else (docs/vllm.md)."""

    def __init__(self, name: str, managers: tuple[_GroupView, ...] = ()) -> None:
        self._name = name
        self.single_type_managers = managers

    def __getattr__(self, attr: str) -> Any:
        raise UnsupportedByAdapter(
            f"vLLM's scheduler reached below its KV cache manager ({self._name}.{attr}); HybridKVScheduler answers "
            f"only the manager's verbs (docs/vllm.md lists them): expected a vLLM version and features it checked")


class VllmManagerAdapter:
    """vLLM 0.32's `KVCacheManager` surface over hybridkv's `KVCacheManager` (module docstring)."""

    def __init__(self, kv_cache_config: Any, *, model: str, max_model_len: int, options: CacheOptions,
                 log_stats: bool, enable_events: bool, admission_caps: Sequence[int | None] = ()) -> None:
        """`admission_caps`: per group, the most blocks vLLM's admission gate asks of one request (its
        sliding-window and chunked-local cap; None: no cap)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        self.kv_cache_config = kv_cache_config
        self.config = hybridkv_config(kv_cache_config, model=model)
        self.manager = KVCacheManager(self.config, max_model_len=max_model_len, options=options)
        self.enable_caching = options.caching
        self.enable_kv_cache_events = enable_events
        self.log_stats = log_stats
        self.max_model_len = max_model_len
        self.num_kv_cache_groups = len(self.config.groups)
        self.coordinator = _Below("coordinator", tuple(
            _GroupView(kv_cache_group_id=i, kv_cache_spec=g.kv_cache_spec, block_size=int(g.kv_cache_spec.block_size))
            for i, g in enumerate(kv_cache_config.kv_cache_groups)))
        self.block_pool = _Below("block_pool")
        self.mamba_shared_prefix_checkpoint = False
        self._blocks_cls = KVCacheBlocks
        self._block = [KVCacheBlock(block_id=i) for i in range(self.config.num_blocks)]
        self._block[0].is_null = True
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in self.config.groups))
        self._requests: dict[str, KVRequest] = {}
        self._hits: dict[str, CacheHit] = {}
        self._zeroed_groups = tuple(g.group_id for g in self.config.groups if g.kind is not SpecKind.MAMBA)
        self._new_block_ids: list[int] = []
        self._spec_kinds = tuple(_event_kind(g) for g in kv_cache_config.kv_cache_groups)
        self.prefix_cache_stats = self._new_stats() if log_stats else None
        self._caps = tuple(admission_caps) or tuple(None for _ in self.config.groups)

    # -- requests ---------------------------------------------------------------------------------

    def _kv(self, request: Any) -> KVRequest:
        """The manager's view of `request`, its tokens and computed tokens brought up to date."""
        kv = self._requests.get(request.request_id)
        if kv is None:
            kv = self._requests[request.request_id] = _kv_request(request)
        else:
            tokens = request.all_token_ids
            if len(tokens) > len(kv.token_ids):
                kv.token_ids.extend(tokens[len(kv.token_ids):])
        kv.num_computed_tokens = request.num_computed_tokens
        return kv

    def _blocks(self, tables: Sequence[Sequence[int]]) -> Any:
        block = self._block
        if not any(tables):
            return self.empty_kv_cache_blocks
        return self._blocks_cls(tuple([block[i] for i in ids] for ids in tables))

    # -- lookup / allocate / cache / free ---------------------------------------------------------

    def new_step_starts(self) -> None:
        self.manager.begin_step()

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]:
        """(hit blocks, hit tokens, shared-prefix boundary) as vLLM's; the hit waits for `allocate_slots`."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        kv = self._kv(request)
        hit = self.manager.lookup(kv)
        self._hits[request.request_id] = hit
        return self._blocks(hit.blocks), hit.num_tokens, kv.shared_prefix_boundary

    def get_computed_blocks_for_connector(self, request: Any) -> tuple[Any, int, int, bool]:
        return (*self.get_computed_blocks(request), False)

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """vLLM's `allocate_slots`: the new blocks per group, or None (nothing changed) when they do not fit.

        `full_sequence_must_fit` is vLLM's gate (`_sequence_blocks`); `reserved_blocks` (async loads'
        reservation) is not modelled."""
        del num_encoder_tokens, reserved_blocks, has_scheduled_reqs, new_computed_blocks
        kv = self._kv(request)
        hit = self._hits.pop(request.request_id, None) if num_new_computed_tokens else None
        if num_new_computed_tokens and (hit is None or hit.num_tokens != num_new_computed_tokens):
            raise UnsupportedByAdapter(
                f"allocate_slots of request {request.request_id!r} adopts {num_new_computed_tokens} hit tokens; "
                f"expected the {0 if hit is None else hit.num_tokens} of its last get_computed_blocks")
        if full_sequence_must_fit and self._sequence_blocks(request, hit, num_external_computed_tokens) > \
                self._free_blocks():
            if hit is not None:
                self._hits[request.request_id] = hit
            return None
        caching = CacheTiming.DELAYED if delay_cache_blocks else CacheTiming.IMMEDIATE
        new = self.manager.allocate(kv, num_new_tokens, hit=hit, num_lookahead_tokens=num_lookahead_tokens,
                                    num_external_tokens=num_external_computed_tokens, caching=caching)
        if new is None:
            if hit is not None:
                self._hits[request.request_id] = hit  # (vLLM retries with the blocks it holds)
            return None
        skip = set(skip_zeroing_group_ids)
        for gid in self._zeroed_groups:
            if gid not in skip:
                self._new_block_ids.extend(b for b in new[gid] if b)
        return self._blocks(new)

    def _free_blocks(self) -> int:
        usable = self.config.usable_blocks
        return usable - round(self.manager.usage() * usable)

    def _sequence_blocks(self, request: Any, hit: CacheHit | None, num_external_tokens: int) -> int:
        """vLLM's admission gate (`full_sequence_must_fit`): per group, the blocks the whole sequence
        needs (window groups capped as vLLM caps them) beyond the blocks the request holds or adopts,
        counted as vLLM 0.32's `get_num_blocks_to_allocate` counts them: a new request's hit row
        (nulls included) or its skipped blocks, whichever is longer, plus the hit blocks no request
        holds (adopting them takes them off the free count)."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        try:
            tables: Sequence[Sequence[int]] | None = self.manager.block_ids(RequestId(request.request_id))
        except UnknownRequestError:
            tables = None
        computed = request.num_computed_tokens + (hit.num_tokens if hit else 0) + num_external_tokens
        total = 0
        for group, cap in zip(self.config.groups, self._caps, strict=True):
            size, gid = group.block_size, group.group_id
            if group.kind is SpecKind.MAMBA:
                total += int(tables is None)  # align mode: the block its first chunk writes
                continue
            need = -(-num_tokens // size) if cap is None else min(-(-num_tokens // size), cap)
            if tables is not None:  # running: no new hit
                total += max(0, need - len(tables[gid]))
                continue
            row = hit.blocks[gid] if hit is not None else ()
            skipped = _skipped_tokens(group.window_tokens, group.chunk_tokens, computed) // size
            total += max(0, need - max(skipped, len(row))) + self.manager.num_evictable(row[skipped:])
        return total

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.manager.cache(self._kv(request), num_computed_tokens)

    def free(self, request: Any) -> None:
        kv = self._kv(request)
        self.manager.free(kv)
        self._hits.pop(request.request_id, None)
        if request.is_finished():
            del self._requests[request.request_id]

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """No-op: hybridkv's `allocate` already replaced every block out of the window by the null block."""
        del request_id, processed_computed_tokens, num_prompt_tokens

    # -- what HybridKVScheduler adds -------------------------------------------------------------

    def protect_waiting(self, request: Any) -> None:
        """Keep the hit of a waiting request from a value-aware eviction (counts nothing)."""
        kv = self._kv(request)
        self.manager.protect_waiting(kv, self.manager.peek(kv))

    def checkpoint_stops(self, request_id: str) -> tuple[int, ...]:
        """Where align-mode chunks of the request must also end (set by its last lookup)."""
        kv = self._requests.get(request_id)
        return kv.checkpoint_stops if kv is not None else ()

    def remaining_blocks(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request lacks to hold `num_tokens` (attention groups; a window group needs its
        window's blocks at most; a state group already holds its states)."""
        try:
            tables: tuple[list[int], ...] = tuple(list(t) for t in self.manager.block_ids(RequestId(request_id)))
        except UnknownRequestError:
            tables = tuple([] for _ in self.config.groups)
        total = 0
        for group, table in zip(self.config.groups, tables, strict=True):
            if group.kind is SpecKind.MAMBA:
                continue
            need = -(-num_tokens // group.block_size)
            if group.window_tokens:
                need = min(need, -(-(group.window_tokens - 1) // group.block_size) + 1)
                total += max(0, need - sum(1 for b in table if b))
            else:
                total += max(0, need - len(table))
        return total

    # -- tables -----------------------------------------------------------------------------------

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        return self._blocks_cls(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_blocks(self, request_id: str) -> Any:
        return self._blocks(self.manager.block_ids(RequestId(request_id)))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.manager.block_ids(RequestId(request_id)))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """The attention groups' tables clipped to the blocks that hold the computed tokens (vLLM's rule)."""
        tables = self.get_block_ids(request_id)
        return tuple(ids if g.kind is SpecKind.MAMBA else ids[: -(-num_computed_tokens // g.block_size)]
                     for g, ids in zip(self.config.groups, tables, strict=True))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        del running_request_id
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens the request's full blocks cache (vLLM reads it for `num_cache_creation_tokens` only)."""
        step = self.config.shortest_cacheable_prefix
        return request.num_computed_tokens // step * step if self.enable_caching else 0

    def take_new_block_ids(self) -> list[int]:
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """The attention blocks from `start_token` on are zeroed again (a failed load left them unwritten)."""
        tables = self.manager.block_ids(RequestId(request_id))
        for gid in self._zeroed_groups:
            size = self.config.groups[gid].block_size
            self._new_block_ids.extend(b for b in tables[gid][start_token // size:] if b)

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        return [], []  # (partial hits, the only source of copies, are refused at startup)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    # -- cache-wide -------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.manager.usage()

    def reset_prefix_cache(self) -> bool:
        if not self.manager.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    @staticmethod
    def _new_stats() -> Any:
        from vllm.v1.metrics.stats import PrefixCacheStats

        return PrefixCacheStats()

    def make_prefix_cache_stats(self) -> Any:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._new_stats()
        return stats

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def take_events(self) -> list[Any]:
        """hybridkv's events as vLLM's (`BlockStored` with the group, its kind and window)."""
        if not self.enable_kv_cache_events:
            self.manager.take_events()
            return []
        return [self._event(e) for e in self.manager.take_events()]

    def _event(self, event: KVEvent) -> Any:
        from vllm.distributed import kv_events

        if isinstance(event, BlockStored):
            kind, window = self._spec_kinds[event.group_id]
            return kv_events.BlockStored(
                block_hashes=list(event.block_hashes), parent_block_hash=event.parent_hash,
                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium="GPU",
                lora_name=None, group_idx=int(event.group_id), kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window)
        if isinstance(event, BlockRemoved):
            return kv_events.BlockRemoved(block_hashes=list(event.block_hashes), medium="GPU",
                                          group_idx=int(event.group_id))
        assert isinstance(event, AllBlocksCleared)
        return kv_events.AllBlocksCleared()

    # -- refused (docs/vllm.md: each is a feature the scheduler refuses at startup) ----------------

    def _refuse(self, verb: str) -> Any:
        raise UnsupportedByAdapter(f"vLLM's scheduler called {verb}, which HybridKVScheduler does not answer; "
                                   f"expected the feature that needs it refused at startup (docs/vllm.md)")

    def pop_blocks_for_free(self, request: Any) -> Any:
        return self._refuse("pop_blocks_for_free (deferred frees: async scheduling with a KV consumer)")

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._refuse("evict_blocks (a KV load failure with kv_load_failure_policy other than recompute)")

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        return self._refuse("truncate_computed_blocks (partial hits with a connector)")


    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        return []  # (only a KV producer's partial tails, refused with P/D)


def _skipped_tokens(window_tokens: int, chunk_tokens: int, num_computed_tokens: int) -> int:
    """Tokens no later token attends to (vLLM's `get_num_skipped_tokens`): before the sliding window
    of the next token, or before its local-attention chunk."""
    if window_tokens:
        return max(0, num_computed_tokens - window_tokens + 1)
    if chunk_tokens:
        return num_computed_tokens // chunk_tokens * chunk_tokens
    return 0


def _event_kind(group: Any) -> tuple[str, int | None]:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    spec = group.kv_cache_spec
    return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
