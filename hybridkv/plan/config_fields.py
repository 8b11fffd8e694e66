"""What every model_specs family reader shares: options, typed config access, spec builders.

A family reader gets a `SpecContext` (the text part of one config.json, the options and the
resolved model dtype) and returns `FamilyLayers`. Errors name the model type, the field, what
was found and what was expected:

    gemma3_text config: field 'num_key_value_heads' must be a positive integer, got -2
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.plan.specs import DTYPE_BYTES, AttentionSpec, LayerSpec, SpecKind

DEFAULT_DTYPE = "bfloat16"
MAX_CONFIG_INT = 1 << 40  # sizes, windows, lengths, counts: no real model comes near (1.1e12)
MAX_LAYERS = 10_000  # a field counting or naming layers (the deepest real models have a few hundred)
_DTYPE_ALIASES: dict[str, str] = {
    "float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16",
}


class KVCacheDType(Enum):
    """Element type of attention K/V: the model dtype, or fp8 (1 byte). Mamba state never changes.

    The `*_ds_mla` values are the sparse-MLA backends' packed latent formats (DeepSeek-V3.2,
    GLM-5; 656 and 352 bytes per token); `fp8` already means `fp8_ds_mla` on those models.
    """

    AUTO = "auto"
    FP8 = "fp8"
    FP8_DS_MLA = "fp8_ds_mla"
    NVFP4_DS_MLA = "nvfp4_ds_mla"


class IndexerFormat(Enum):
    """How DSA indexer keys are cached: vLLM's packed fp8 values + fp32 scales (uint8, 132 bytes for
    head dim 128), or unquantized in the model dtype (the reference engine, exact against transformers)."""

    PACKED_FP8 = "packed_fp8"
    UNQUANTIZED = "unquantized"


def normalize_dtype(value: object, *, what: str) -> str:
    """`torch.bfloat16`, `bf16`, `bfloat16` -> `bfloat16`; raises ConfigError for anything unknown."""
    text = str(value).removeprefix("torch.").lower() if isinstance(value, str) else None
    dtype = _DTYPE_ALIASES.get(text, text) if text is not None else None
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"{what} {value!r} is not a known dtype; expected one of {sorted(DTYPE_BYTES)}")
    return dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecOptions:
    """How the model is served, where that changes what a layer caches.

    `dtype` overrides the config's `dtype`/`torch_dtype` (default bfloat16). `kv_cache_dtype=FP8`
    stores attention K/V in 1 byte. `tp_size` splits KV heads (at least one per rank) and Mamba
    heads / channels. `num_speculative_tokens` widens every conv state by that many columns.
    `indexer` says how DSA indexer keys are stored (vLLM's packed format by default).
    """

    dtype: str | None = None
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO
    tp_size: int = 1
    num_speculative_tokens: int = 0
    indexer: IndexerFormat = IndexerFormat.PACKED_FP8
    mamba_ssm_dtype: str | None = None  # the recurrent states' dtype, over the config's (vLLM --mamba-ssm-cache-dtype)

    def __post_init__(self) -> None:
        if self.dtype is not None:
            normalize_dtype(self.dtype, what="dtype")
        if self.mamba_ssm_dtype not in (None, "auto"):
            normalize_dtype(self.mamba_ssm_dtype, what="mamba_ssm_dtype")
        if not isinstance(self.kv_cache_dtype, KVCacheDType):
            raise ConfigError(f"kv_cache_dtype must be a KVCacheDType, got {self.kv_cache_dtype!r}")
        if not isinstance(self.indexer, IndexerFormat):
            raise ConfigError(f"indexer must be an IndexerFormat, got {self.indexer!r}")
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ConfigError(f"tensor-parallel size must be a positive integer, got {self.tp_size!r}")
        spec = self.num_speculative_tokens
        if isinstance(spec, bool) or not isinstance(spec, int) or spec < 0:
            raise ConfigError(f"num_speculative_tokens must be a non-negative integer, got {spec!r}")


class ConfigReader:
    """Typed, validated access to the text part of one config.json (a plain dict)."""

    __slots__ = ("_data", "_parent", "model_type")

    def __init__(self, data: Mapping[str, Any], *, model_type: str, parent: Mapping[str, Any] | None = None) -> None:
        self._data = data
        self._parent: Mapping[str, Any] = parent if parent is not None else {}
        self.model_type = model_type

    def with_fields(self, fields: Mapping[str, Any]) -> ConfigReader:
        """This config with `fields` set over its own (a family's own spelling turned into the standard one)."""
        return ConfigReader({**self._data, **fields}, model_type=self.model_type, parent=self._parent)

    def error(self, message: str) -> ConfigError:
        """A ConfigError prefixed with the model type."""
        return ConfigError(f"{self.model_type} config: {message}")

    def has(self, key: str) -> bool:
        """True when `key` is present and not null."""
        return self._data.get(key) is not None

    def raw(self, key: str) -> Any:
        """The value of `key` (None when absent)."""
        return self._data.get(key)

    def inherited(self, *keys: str) -> Any:
        """First non-null value of `keys` in the text part, then in the wrapper config."""
        for source in (self._data, self._parent):
            for key in keys:
                if source.get(key) is not None:
                    return source[key]
        return None

    def _as_int(self, key: str, value: object, minimum: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(f"field {key!r} must be {expected}, got {value!r:.40}")
        maximum = MAX_LAYERS if "layer" in key else MAX_CONFIG_INT
        if value > maximum:
            raise self.error(f"field {key!r} must be at most {maximum}, got {value!r:.40}")
        return value

    def require_int(self, key: str, *, minimum: int = 1) -> int:
        """The integer at `key`; ConfigError when it is missing or below `minimum`."""
        if not self.has(key):
            raise self.error(f"required field {key!r} is missing; expected an integer >= {minimum}")
        return self._as_int(key, self._data[key], minimum)

    def require_inherited_int(self, key: str, *, minimum: int = 1) -> int:
        """Like `require_int`, falling back to the wrapper config (multimodal models)."""
        value = self.inherited(key)
        if value is None:
            raise self.error(f"required field {key!r} is missing; expected an integer >= {minimum}")
        return self._as_int(key, value, minimum)

    def get_int(self, key: str, *, default: int, minimum: int = 1) -> int:
        """The integer at `key`, or `default` when it is missing or null."""
        return self._as_int(key, self._data[key], minimum) if self.has(key) else default

    def optional_int(self, key: str, *, minimum: int = 1) -> int | None:
        """The integer at `key`, or None when it is missing or null."""
        return self._as_int(key, self._data[key], minimum) if self.has(key) else None

    def get_bool(self, key: str, *, default: bool) -> bool:
        """The boolean at `key`, or `default` when it is missing or null."""
        value = self._data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"field {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str, *, minimum: int = 0) -> list[int] | None:
        """The list of integers at `key`, or None when it is missing or null."""
        value = self._data.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self.error(f"field {key!r} must be a list of integers, got {value!r}")
        return [self._as_int(key, item, minimum) for item in value]

    def str_list(self, key: str) -> list[str] | None:
        """The list of strings at `key`, or None when it is missing or null."""
        value = self._data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.error(f"field {key!r} must be a list of strings, got {value!r}")
        return list(value)

    def sub_mapping(self, key: str) -> Mapping[str, Any]:
        """The object at `key` (an empty mapping when missing or null)."""
        value = self._data.get(key)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self.error(f"field {key!r} must be an object, got {value!r}")
        return value


class LayerRole(Enum):
    """What a decoder layer caches, as read from `layer_types`-like fields."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    CHUNKED = "chunked_attention"
    STATE = "linear_attention"  # Mamba1 / Mamba2 / Gated DeltaNet, depending on the family
    HYBRID = "hybrid"  # attention and a state in one layer
    NONE = "none"  # MLP / MoE only


# Both transformers' current names and the legacy names still found in hub config.json files.
_ROLE_NAMES: dict[str, LayerRole] = {
    "full_attention": LayerRole.FULL, "attention": LayerRole.FULL,
    "sliding_attention": LayerRole.SLIDING, "chunked_attention": LayerRole.CHUNKED,
    "linear_attention": LayerRole.STATE, "mamba": LayerRole.STATE,
    "hybrid": LayerRole.HYBRID, "mlp": LayerRole.NONE, "moe": LayerRole.NONE,
}


def layer_roles(
    cfg: ConfigReader, key: str, *, allowed: set[LayerRole], num_layers: int | None
) -> list[LayerRole] | None:
    """Roles named by the list at `key` (None when absent); checks names and length."""
    names = cfg.str_list(key)
    if names is None:
        return None
    if num_layers is not None and len(names) != num_layers:
        raise cfg.error(f"field {key!r} has {len(names)} entries, expected num_hidden_layers = {num_layers}")
    accepted = sorted(name for name, role in _ROLE_NAMES.items() if role in allowed)
    roles = []
    for i, name in enumerate(names):
        role = _ROLE_NAMES.get(name)
        if role not in allowed:
            raise cfg.error(f"{key}[{i}] = {name!r} is not a layer type of this model; expected one of {accepted}")
        assert role is not None  # `allowed` only holds roles
        roles.append(role)
    return roles


def pattern_roles(num_layers: int, *, period: int, sparse: LayerRole, dense: LayerRole) -> list[LayerRole]:
    """Every `period`-th layer (1-based) gets `sparse`, the others `dense` (HF's `(i + 1) % period`)."""
    return [sparse if (i + 1) % period == 0 else dense for i in range(num_layers)]


def derived_head_dim(cfg: ConfigReader) -> int:
    """`hidden_size // num_attention_heads`, which must divide exactly (transformers' default head_dim)."""
    hidden, heads = cfg.require_int("hidden_size"), cfg.require_int("num_attention_heads")
    if hidden % heads:
        raise cfg.error(f"hidden_size = {hidden} is not divisible by num_attention_heads = {heads} and no "
                        "head_dim is set; expected head_dim in the config, or a hidden size that divides")
    return hidden // heads


def check_kv_heads(cfg: ConfigReader, *, kv_heads: int, heads: int, fields: tuple[str, str]) -> None:
    """Grouped-query attention as the model builds it: every KV head serves a whole group of query heads,
    so the KV head count must divide the query head count (transformers' attention reshapes fail otherwise)."""
    if kv_heads > heads or heads % kv_heads:
        kv_field, heads_field = fields
        raise cfg.error(f"{kv_field} = {kv_heads} must divide {heads_field} = {heads} (each KV head serves a "
                        f"whole group of query heads); expected a divisor of {heads}, e.g. "
                        f"{max(d for d in range(1, min(kv_heads, heads) + 1) if heads % d == 0)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FamilyLayers:
    """A family reader's answer: one spec (or None) per decoder layer, plus sharing and second caches.

    `second_caches` lists (decoder layer, state spec) for layers that hold attention and a state,
    or (decoder layer, indexer spec) for sparse-attention layers. `kernel_block_size` is the block
    size the model's kernels force (`kernel_backend` names them), None when any size works.
    """

    layers: tuple[LayerSpec | None, ...]
    kv_shared_from: dict[int, int] = field(default_factory=dict)
    second_caches: tuple[tuple[int, LayerSpec], ...] = ()
    kernel_block_size: int | None = None
    kernel_backend: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecContext:
    """One config being read: its fields, the serving options and the resolved dtypes."""

    cfg: ConfigReader
    options: SpecOptions
    dtype: str

    @property
    def num_layers(self) -> int:
        return self.cfg.require_int("num_hidden_layers")

    def kv_heads(self, default_key: str = "num_attention_heads") -> int:
        """`num_key_value_heads`, defaulting to `default_key` as transformers does; checked against it."""
        heads = self.cfg.require_int(default_key)
        kv_heads = self.cfg.get_int("num_key_value_heads", default=heads)
        check_kv_heads(self.cfg, kv_heads=kv_heads, heads=heads, fields=("num_key_value_heads", default_key))
        return kv_heads

    def head_dim(self) -> int:
        """`head_dim` when set, else `hidden_size // num_attention_heads`."""
        if self.cfg.has("head_dim"):
            return self.cfg.require_int("head_dim")
        return derived_head_dim(self.cfg)

    def ssm_dtype(self, *, default: str | None = None) -> str:
        """Recurrent-state dtype: `SpecOptions.mamba_ssm_dtype`, else the config's `mamba_ssm_dtype` /
        `mamba_ssm_cache_dtype` when set, else the default."""
        override = self.options.mamba_ssm_dtype
        if override not in (None, "auto"):
            return normalize_dtype(override, what="mamba_ssm_dtype")
        value = self.cfg.inherited("mamba_ssm_dtype", "mamba_ssm_cache_dtype")
        if value is None or value == "auto":
            return default or self.dtype
        return normalize_dtype(value, what=f"{self.cfg.model_type} config: mamba_ssm_dtype")

    def split(self, what: str, value: int) -> int:
        """`value / tp_size`, which must divide exactly (a Mamba channel or head count)."""
        tp = self.options.tp_size
        if value % tp:
            raise self.cfg.error(f"{what} = {value} is not divisible by the tensor-parallel size {tp}")
        return value // tp

    def attention(self, role: LayerRole, *, kv_heads: int, head_dim: int, window_tokens: int | None = None,
                  chunk_tokens: int | None = None, value_head_dim: int = 0) -> AttentionSpec:
        """The attention spec of one layer under the options (TP head split, fp8 KV)."""
        tp = self.options.tp_size
        heads = self.cfg.optional_int("num_attention_heads")
        if heads is not None and heads % tp:
            raise self.cfg.error(f"num_attention_heads = {heads} is not divisible by the tensor-parallel size {tp}; "
                                 f"expected a size that divides {heads}")
        if kv_heads > tp and kv_heads % tp:
            raise self.cfg.error(f"num_key_value_heads = {kv_heads} is not divisible by the tensor-parallel size {tp}")
        if kv_heads < tp and tp % kv_heads:
            raise self.cfg.error(f"the tensor-parallel size {tp} is not a multiple of num_key_value_heads = "
                                 f"{kv_heads}; each KV head must be replicated on a whole number of ranks")
        dtype = "fp8" if self.options.kv_cache_dtype is KVCacheDType.FP8 else self.dtype
        per_rank = max(1, kv_heads // tp)
        if role is LayerRole.FULL:
            return AttentionSpec(kind=SpecKind.FULL, num_kv_heads=per_rank, head_dim=head_dim, dtype=dtype,
                                 value_head_dim=value_head_dim)
        if role is LayerRole.SLIDING:
            if window_tokens is None:
                raise self.cfg.error("a sliding_attention layer needs 'sliding_window', which is missing or null")
            return AttentionSpec(kind=SpecKind.SLIDING_WINDOW, num_kv_heads=per_rank, head_dim=head_dim,
                                 dtype=dtype, window_tokens=window_tokens, value_head_dim=value_head_dim)
        if role is LayerRole.CHUNKED:
            if chunk_tokens is None:
                raise self.cfg.error("a chunked_attention layer needs 'attention_chunk_size', which is missing or null")
            return AttentionSpec(kind=SpecKind.CHUNKED_LOCAL, num_kv_heads=per_rank, head_dim=head_dim,
                                 dtype=dtype, chunk_tokens=chunk_tokens, value_head_dim=value_head_dim)
        raise AssertionError(f"not an attention role: {role}")

    def attention_stack(self, roles: Sequence[LayerRole], *, kv_heads: int, head_dim: int,
                        window_tokens: int | None = None, chunk_tokens: int | None = None) -> list[LayerSpec]:
        """One attention spec per role (all roles must be attention roles)."""
        return [self.attention(role, kv_heads=kv_heads, head_dim=head_dim, window_tokens=window_tokens,
                               chunk_tokens=chunk_tokens) for role in roles]
