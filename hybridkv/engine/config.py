"""`EngineConfig`: every engine option, defined once (LLM keywords and `hybridkv run` flags).

Pure Python (no torch), so the CLI can build its options without loading the engine.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass
from typing import Any

from hybridkv.engine.queue_order import QueueOrder
from hybridkv.errors import ConfigError
from hybridkv.kvcache.manager import (
    AdmissionHeadroom,
    CheckpointPlacement,
    DecodeCheckpoints,
    EvictionPolicyName,
    MambaCacheMode,
    PrefixCaching,
    SlidingWindowCaching,
)
from hybridkv.plan.match_unit import check_prefix_match_unit
from hybridkv.plan.planner import DEFAULT_MAX_NUM_BATCHED_TOKENS, RunningState, StateLayout, memory_gib_to_bytes

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MODEL_NAME = "default-gemma3"  # the embedded tiny Gemma 3 (engine/default_model.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine options; `LLM(model, **options)` accepts exactly these names.

    `kv_cache_memory_gib` is the KV cache budget handed to the planner; `num_threads` 0 keeps
    torch's default. `prefix_caching` also accepts "on" / "off". `max_model_len` None means the
    model's `max_position_embeddings`, capped at `DEFAULT_MAX_MODEL_LEN`. `mamba_cache_mode`
    ("align" / "all") says where state groups keep checkpoints when prefix caching is on.
    `kv_server` attaches a KV cache server: a tcp:// URL of a running `hybridkv server`, or
    "auto" to start one for this engine (stopped by `LLM.close`); `kv_server_timeout_s` bounds
    each call to it (a server that does not answer in time is treated as down, and retried later).
    """

    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 4096
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 64
    kv_cache_memory_gib: float = 0.25
    block_size: int = 16
    prefix_caching: PrefixCaching = PrefixCaching.ON
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    #: Mamba hybrids: a state in one page (vLLM's) or over several pages of `block_size` tokens (docs/state_layout.md)
    state_layout: StateLayout = StateLayout.ONE_PAGE
    #: vLLM's option: None keeps sliding-window tails and state checkpoints at every aligned boundary,
    #: 0 only at each prompt's replay boundary, N once per N tokens too (docs/prefix_caching.md)
    prefix_cache_retention_interval: int | None = None
    sliding_window_caching: SlidingWindowCaching = SlidingWindowCaching.REACHABLE
    #: vLLM's option (alias hash_block_size): tokens per prefix-cache key; None = the block size
    #: (docs/prefix_caching.md); checked against the planned block sizes when the engine starts
    prefix_match_unit: int | None = None
    #: lru (vLLM's) or value (recency plus compute saved per byte, hit points kept; docs/prefix_caching.md)
    eviction: EvictionPolicyName = EvictionPolicyName.LRU
    #: junction (vLLM's chunk cuts) or placed (also popular branch depths: state checkpoints where hits land)
    checkpoint_placement: CheckpointPlacement = CheckpointPlacement.JUNCTION
    #: every (vLLM's: a state checkpoint at each block boundary decode crosses) or last (one per request)
    decode_checkpoints: DecodeCheckpoints = DecodeCheckpoints.EVERY
    #: none (vLLM's) or next_block (a new request leaves one block per group free for each running one)
    admission_headroom: AdmissionHeadroom = AdmissionHeadroom.NONE
    #: moving (vLLM's: align mode holds 2 states per state group) or fixed (1; checkpoints by copy)
    running_state: RunningState = RunningState.MOVING
    #: fcfs (vLLM's) or cache_aware (the longest cached prefix first, bounded bypass; engine/queue_order.py)
    queue_order: QueueOrder = QueueOrder.FCFS
    seed: int = 0
    dtype: str = "float32"
    num_threads: int = 0
    kv_server: str | None = None
    kv_server_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if isinstance(self.prefix_caching, str):
            values = [m.value for m in PrefixCaching]
            if self.prefix_caching not in values:
                raise ConfigError(f"prefix_caching must be one of {values}, got {self.prefix_caching!r}")
            object.__setattr__(self, "prefix_caching", PrefixCaching(self.prefix_caching))
        if not isinstance(self.mamba_cache_mode, MambaCacheMode):
            values = [m.value for m in MambaCacheMode]
            if self.mamba_cache_mode not in values:
                raise ConfigError(f"mamba_cache_mode must be one of {values}, got {self.mamba_cache_mode!r}")
            object.__setattr__(self, "mamba_cache_mode", MambaCacheMode(self.mamba_cache_mode))
        if not isinstance(self.state_layout, StateLayout):
            values = [m.value for m in StateLayout]
            if self.state_layout not in values:
                raise ConfigError(f"state_layout must be one of {values}, got {self.state_layout!r}")
            object.__setattr__(self, "state_layout", StateLayout(self.state_layout))
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        memory_gib_to_bytes(self.kv_cache_memory_gib, option="kv_cache_memory_gib")
        interval = self.prefix_cache_retention_interval
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
            raise ConfigError(f"prefix_cache_retention_interval must be None or an integer >= 0, got {interval!r}")
        check_prefix_match_unit(self.prefix_match_unit)
        if not isinstance(self.sliding_window_caching, SlidingWindowCaching):
            values = [m.value for m in SlidingWindowCaching]
            if self.sliding_window_caching not in values:
                raise ConfigError(f"sliding_window_caching must be one of {values}, "
                                  f"got {self.sliding_window_caching!r}")
            object.__setattr__(self, "sliding_window_caching", SlidingWindowCaching(self.sliding_window_caching))
        for name, enum in (("eviction", EvictionPolicyName), ("checkpoint_placement", CheckpointPlacement),
                           ("decode_checkpoints", DecodeCheckpoints), ("admission_headroom", AdmissionHeadroom),
                           ("running_state", RunningState), ("queue_order", QueueOrder)):
            value = getattr(self, name)
            if not isinstance(value, enum):
                values = [m.value for m in enum]
                if value not in values:
                    raise ConfigError(f"{name} must be one of {values}, got {value!r}")
                object.__setattr__(self, name, enum(value))
        if not isinstance(self.num_threads, int) or self.num_threads < 0:
            raise ConfigError(f"num_threads must be an integer >= 0 (0 = torch default), got {self.num_threads!r}")
        if self.kv_server is not None and (not isinstance(self.kv_server, str) or not self.kv_server):
            raise ConfigError(f"kv_server must be a tcp://host:port URL or 'auto', got {self.kv_server!r}")
        if self.kv_server not in (None, "auto"):
            check_kv_server_url(self.kv_server)
        timeout = self.kv_server_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < float("inf"):
            raise ConfigError(f"kv_server_timeout_s must be a positive number of seconds, got {timeout!r}")
        if self.dtype not in ENGINE_DTYPES:
            raise ConfigError(f"dtype must be one of {list(ENGINE_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls)}

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from keyword options; raises ConfigError naming unknown ones and listing the valid."""
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; valid options: {', '.join(cls.option_names())}")
        return cls(**options)


def check_kv_server_url(url: str) -> None:
    """ConfigError unless `url` is tcp://host:port (port in 1..65535) or ipc://path."""
    expected = "expected auto or a running server's tcp://host:port (or ipc://path)"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "ipc" and len(url) > len("ipc://"):
        return
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or not 0 < port < 65536:
        raise ConfigError(f"kv_server {url!r} is not a KV cache server URL; {expected}")
