"""`EngineConfig`: every engine option, defined once (LLM keywords and `hybridkv run` flags).

Pure Python (no torch), so the CLI can build its options without loading the engine.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.kv_events.wire import KVEventsConfig
from hybridkv.kvcache.options import DEFAULT_PRESET, FIELDS, PRESETS, CacheOptions, options_from
from hybridkv.plan.planner import DEFAULT_MAX_NUM_BATCHED_TOKENS, memory_gib_to_bytes

ENGINE_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MODEL_NAME = "default-gemma3"  # the embedded tiny Gemma 3 (engine/default_model.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine options; `LLM(model, **options)` accepts these names, `preset` and every `CacheOptions` field.

    `kv_cache_memory_gib` is the KV cache budget handed to the planner; `num_threads` 0 keeps
    torch's default. `max_model_len` None means the model's `max_position_embeddings`, capped at
    `DEFAULT_MAX_MODEL_LEN`. `cache` holds the prefix-cache knobs (`kvcache/options.py`).
    `kv_server` attaches a KV cache server: a tcp:// URL of a running `hybridkv server`, or
    "auto" to start one for this engine (stopped by `LLM.close`); `kv_server_timeout_s` bounds
    each call to it (a server that does not answer in time is treated as down, and retried later).
    """

    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 4096
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 64
    kv_cache_memory_gib: float = 0.25
    block_size: int = 16
    #: every prefix-cache knob (`kvcache/options.py`); `LLM(preset=..., eviction=...)` builds it
    cache: CacheOptions = PRESETS[DEFAULT_PRESET]
    seed: int = 0
    dtype: str = "float32"
    num_threads: int = 0
    kv_server: str | None = None
    kv_server_timeout_s: float = 5.0
    #: vLLM's `--kv-events-config` JSON: publish the KV cache's events over ZMQ as vLLM does (for KV indexers)
    kv_events_config: str | None = None

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            KVEventsConfig.from_json(self.kv_events_config)  # (ConfigError naming the bad field)
        if not isinstance(self.cache, CacheOptions):
            raise ConfigError(f"cache must be a CacheOptions, got {type(self.cache).__name__}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if name == "max_model_len" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        memory_gib_to_bytes(self.kv_cache_memory_gib, option="kv_cache_memory_gib")
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
        """The engine's own options (the cache knobs are `CacheOptions`' fields, taken beside them)."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "cache"]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name != "cache"}

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EngineConfig:
        """Build from keyword options: engine options, `preset` (a `PRESETS` name) and any
        `CacheOptions` field, applied over the preset; ConfigError names an unknown option and lists the valid."""
        options = dict(options)
        name = options.pop("preset", None)
        cache = options.pop("cache", None)
        changes = {k: options.pop(k) for k in list(options) if k in FIELDS}
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; valid options: {', '.join(cls.option_names())}, "
                              f"preset and the cache options {', '.join(FIELDS)}")
        if cache is not None and name is not None:
            raise ConfigError("give either cache (a CacheOptions) or preset, not both")
        base = cache if cache is not None else (name if name is not None else DEFAULT_PRESET)
        if not isinstance(base, CacheOptions | str):
            raise ConfigError(f"preset must be one of {', '.join(PRESETS)}, got {base!r}")
        return cls(cache=options_from(base, changes), **options)


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
