"""HF config.json -> `ModelSpec`: the cache spec of every layer, read by `model_type`.

One small reader per family, registered in `_REGISTRY`; an unknown `model_type` raises
`UnsupportedModelError` listing the supported ones. Multimodal wrappers (gemma3, gemma3n,
gemma4, llama4, qwen3_5, qwen3_5_moe) are read from their `text_config`. Pure Python: this
module reads plain dicts and imports neither torch nor transformers.

    config.json --load_config--> dict --model_spec_from_config(options)--> ModelSpec
        model_type -> family reader -> one spec per decoder layer (None: no cache)
                                       + kv_shared_from (Gemma 3n / 4)
                                       + extra state slots (Falcon-H1, Zamba2 hybrid layers)

Layer-kind rules follow transformers' config classes; head/state sizes per TP rank follow
vLLM (see model_specs_mamba for the state shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hybridkv.errors import ConfigError, UnsupportedModelError
from hybridkv.plan import bounded_json
from hybridkv.plan.config_fields import (
    DEFAULT_DTYPE,
    ConfigReader,
    FamilyLayers,
    IndexerFormat,
    KVCacheDType,
    LayerRole,
    SpecContext,
    SpecOptions,
    derived_head_dim,
    layer_roles,
    normalize_dtype,
    pattern_roles,
)
from hybridkv.plan.generic_specs import FIELD_ALIASES, FIELD_DEFAULTS, GENERIC_FAMILIES
from hybridkv.plan.linear_state_specs import (
    read_kimi_linear,
    read_lfm2,
    read_mamba,
    read_mamba2,
    read_minimax,
    read_olmo_hybrid,
    read_qwen4_exp,
    read_recurrent_gemma,
)
from hybridkv.plan.mla_specs import (
    DSV4_BACKEND,
    SPARSE_MLA_BACKEND,
    check_kv_cache_dtype,
    read_deepseek_mla,
    read_deepseek_v4,
    read_minimax_m3,
)
from hybridkv.plan.specs import LayerSpec, ModelSpec
from hybridkv.plan.state_specs import (
    read_bamba,
    read_falcon_h1,
    read_gated_deltanet_hybrid,
    read_granitemoehybrid,
    read_jamba,
    read_nemotron_h,
    read_zamba,
    read_zamba2,
)

__all__ = ["IndexerFormat", "KVCacheDType", "SpecOptions", "load_config", "model_spec_from_config",
           "model_type_families", "supported_model_types"]

FamilyReader = Callable[[SpecContext], FamilyLayers]
HeadDimRule = Callable[[SpecContext], int]
_FULL, _SLIDING, _CHUNKED = LayerRole.FULL, LayerRole.SLIDING, LayerRole.CHUNKED
_DEFAULT_OPTIONS = SpecOptions()

# transformers' Gemma3nTextConfig defaults for the fields the reader uses: a config.json that
# omits one (or sets it to null) means this value to transformers and to the engine's model.
_GEMMA3N_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "sliding_window": 512, "num_kv_shared_layers": 15, "max_position_embeddings": 32_768,
})
# Families whose missing fields take their transformers config class default instead of being an error.
_FIELD_DEFAULTS: dict[str, Mapping[str, Any]] = {"gemma3n": _GEMMA3N_DEFAULTS, "gemma3n_text": _GEMMA3N_DEFAULTS,
                                                 **FIELD_DEFAULTS}


def _declared_head_dim(ctx: SpecContext) -> int:
    """`head_dim` as written: families whose transformers default is not hidden // heads."""
    return ctx.cfg.require_int("head_dim")


def _derived_head_dim(ctx: SpecContext) -> int:
    """Cohere2 always uses hidden_size // num_attention_heads, whatever head_dim says."""
    return derived_head_dim(ctx.cfg)


def _uniform(ctx: SpecContext, role: LayerRole, head_dim: int) -> FamilyLayers:
    window = ctx.cfg.optional_int("sliding_window")
    specs = ctx.attention_stack([role] * ctx.num_layers, kv_heads=ctx.kv_heads(), head_dim=head_dim,
                                window_tokens=window)
    return FamilyLayers(layers=tuple(specs))


def _read_llama(ctx: SpecContext) -> FamilyLayers:
    """Llama: full attention everywhere."""
    return _uniform(ctx, _FULL, ctx.head_dim())


def _read_mistral(ctx: SpecContext) -> FamilyLayers:
    """Mistral: every layer slides when `sliding_window` is set, else full attention."""
    role = _SLIDING if ctx.cfg.has("sliding_window") else _FULL
    return _uniform(ctx, role, ctx.head_dim())


def _read_ministral(ctx: SpecContext) -> FamilyLayers:
    """Ministral: `layer_types`, else like Mistral."""
    cfg = ctx.cfg
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _SLIDING}, num_layers=ctx.num_layers)
    if roles is None:
        return _read_mistral(ctx)
    specs = ctx.attention_stack(roles, kv_heads=ctx.kv_heads(), head_dim=ctx.head_dim(),
                                window_tokens=cfg.optional_int("sliding_window"))
    return FamilyLayers(layers=tuple(specs))


def _qwen_reader(head_dim: HeadDimRule) -> FamilyReader:
    """Qwen2 / Qwen3: sliding only with `use_sliding_window`, on layers >= `max_window_layers`."""

    def read(ctx: SpecContext) -> FamilyLayers:
        cfg, n = ctx.cfg, ctx.num_layers
        window = cfg.optional_int("sliding_window") if cfg.get_bool("use_sliding_window", default=False) else None
        roles = [_FULL] * n
        if window is not None:
            first = cfg.get_int("max_window_layers", default=28, minimum=0)
            roles = layer_roles(cfg, "layer_types", allowed={_FULL, _SLIDING}, num_layers=n) or [
                _SLIDING if i >= first else _FULL for i in range(n)]
        specs = ctx.attention_stack(roles, kv_heads=ctx.kv_heads(), head_dim=head_dim(ctx), window_tokens=window)
        return FamilyLayers(layers=tuple(specs))

    return read


def _alternating_reader(*, period: int, period_key: str | None, head_dim: HeadDimRule) -> FamilyReader:
    """Sliding layers with a full layer every `period`-th (Gemma 2/3, Cohere2, gpt-oss), or `layer_types`."""

    def read(ctx: SpecContext) -> FamilyLayers:
        cfg, n = ctx.cfg, ctx.num_layers
        roles = layer_roles(cfg, "layer_types", allowed={_FULL, _SLIDING}, num_layers=n)
        if roles is None:
            every = cfg.get_int(period_key, default=period) if period_key else period
            roles = pattern_roles(n, period=every, sparse=_FULL, dense=_SLIDING)
        specs = ctx.attention_stack(roles, kv_heads=ctx.kv_heads(), head_dim=head_dim(ctx),
                                    window_tokens=cfg.optional_int("sliding_window"))
        return FamilyLayers(layers=tuple(specs))

    return read


def _kv_sharing(ctx: SpecContext, roles: list[LayerRole]) -> dict[int, int]:
    """The last `num_kv_shared_layers` layers read the KV of the last earlier layer of their type."""
    cfg, n = ctx.cfg, len(roles)
    shared = cfg.get_int("num_kv_shared_layers", default=0, minimum=0)
    if shared == 0:
        return {}
    first = n - shared
    if first <= 0:
        raise cfg.error(f"num_kv_shared_layers = {shared} must be smaller than num_hidden_layers = {n}")
    last_of = {role: i for i, role in enumerate(roles[:first])}
    sharing = {}
    for i in range(first, n):
        if roles[i] not in last_of:
            raise cfg.error(f"layer {i} ({roles[i].value}) shares KV, but none of layers 0..{first - 1} "
                            f"is {roles[i].value} to share it from")
        sharing[i] = last_of[roles[i]]
    return sharing


def _read_gemma3n(ctx: SpecContext) -> FamilyLayers:
    """Gemma 3n: full attention every 5th layer; the last `num_kv_shared_layers` reuse earlier KV.

    Missing fields take Gemma3nTextConfig's defaults (`_GEMMA3N_DEFAULTS`), as in transformers."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _SLIDING}, num_layers=n)
    roles = roles or pattern_roles(n, period=5, sparse=_FULL, dense=_SLIDING)
    specs = ctx.attention_stack(roles, kv_heads=ctx.kv_heads(), head_dim=cfg.require_int("head_dim"),
                                window_tokens=cfg.optional_int("sliding_window"))
    return FamilyLayers(layers=tuple(specs), kv_shared_from=_kv_sharing(ctx, roles))


def _gemma4_layer(ctx: SpecContext, i: int, role: LayerRole) -> LayerSpec:
    """Full layers use `global_head_dim` (and `num_global_key_value_heads` when K = V); sliding use
    `head_dim`. transformers' saved form puts the same numbers in `per_layer_config[i]`."""
    cfg = ctx.cfg
    head_dim, kv_heads = cfg.require_int("head_dim"), ctx.kv_heads()
    if role is _FULL:
        head_dim = cfg.get_int("global_head_dim", default=head_dim)
        if cfg.get_bool("attention_k_eq_v", default=False):
            kv_heads = cfg.get_int("num_global_key_value_heads", default=kv_heads)
    override = cfg.sub_mapping("per_layer_config").get(str(i)) or {}  # JSON keys are strings
    if not isinstance(override, Mapping):
        raise cfg.error(f"per_layer_config[{i!r}] must be an object, got {override!r}")
    layer = ConfigReader(override, model_type=f"{cfg.model_type} per_layer_config[{i}]")
    return ctx.attention(role, kv_heads=layer.get_int("num_key_value_heads", default=kv_heads),
                         head_dim=layer.get_int("head_dim", default=head_dim),
                         window_tokens=cfg.optional_int("sliding_window"))


def _read_gemma4(ctx: SpecContext) -> FamilyLayers:
    """Gemma 4: sliding layers with a full layer every 6th; per-type head dims; optional KV sharing."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _SLIDING}, num_layers=n)
    roles = roles or pattern_roles(n, period=6, sparse=_FULL, dense=_SLIDING)
    layers = tuple(_gemma4_layer(ctx, i, role) for i, role in enumerate(roles))
    return FamilyLayers(layers=layers, kv_shared_from=_kv_sharing(ctx, roles))


def _read_llama4(ctx: SpecContext) -> FamilyLayers:
    """Llama 4: chunked local attention on RoPE layers, full attention on the NoPE layers.

    `no_rope_layers[i] == 1` means layer i *uses* RoPE (HF naming); by default every
    `no_rope_layer_interval`-th layer is NoPE. Without `attention_chunk_size` all layers are full.
    """
    cfg, n = ctx.cfg, ctx.num_layers
    chunk = cfg.optional_int("attention_chunk_size")
    roles = layer_roles(cfg, "layer_types", allowed={_FULL, _CHUNKED}, num_layers=n)
    if roles is None:
        uses_rope = cfg.int_list("no_rope_layers") or [
            int((i + 1) % cfg.get_int("no_rope_layer_interval", default=4) != 0) for i in range(n)]
        if len(uses_rope) != n:
            raise cfg.error(f"no_rope_layers has {len(uses_rope)} entries, expected num_hidden_layers = {n}")
        roles = [_CHUNKED if flag else _FULL for flag in uses_rope]
    if chunk is None:
        roles = [_FULL] * n
    specs = ctx.attention_stack(roles, kv_heads=ctx.kv_heads(), head_dim=cfg.require_int("head_dim"),
                                chunk_tokens=chunk)
    return FamilyLayers(layers=tuple(specs))


_GEMMA_ALTERNATING = _alternating_reader(period=6, period_key="sliding_window_pattern", head_dim=_declared_head_dim)
_REGISTRY: dict[str, FamilyReader] = {
    "llama": _read_llama,
    "mistral": _read_mistral,
    "ministral": _read_ministral,
    "qwen2": _qwen_reader(SpecContext.head_dim),
    "qwen3": _qwen_reader(_declared_head_dim),
    "gemma2": _alternating_reader(period=2, period_key=None, head_dim=_declared_head_dim),
    "gemma3": _GEMMA_ALTERNATING,
    "gemma3_text": _GEMMA_ALTERNATING,
    "cohere2": _alternating_reader(period=4, period_key="sliding_window_pattern", head_dim=_derived_head_dim),
    "gpt_oss": _alternating_reader(period=2, period_key=None, head_dim=_declared_head_dim),
    "gemma3n": _read_gemma3n,
    "gemma3n_text": _read_gemma3n,
    "gemma4": _read_gemma4,
    "gemma4_text": _read_gemma4,
    "llama4": _read_llama4,
    "llama4_text": _read_llama4,
    "qwen3_next": read_gated_deltanet_hybrid,
    "qwen3_5": read_gated_deltanet_hybrid,
    "qwen3_5_text": read_gated_deltanet_hybrid,
    "qwen3_5_moe": read_gated_deltanet_hybrid,
    "qwen3_5_moe_text": read_gated_deltanet_hybrid,
    "jamba": read_jamba,
    "bamba": read_bamba,
    "granitemoehybrid": read_granitemoehybrid,
    "falcon_h1": read_falcon_h1,
    "nemotron_h": read_nemotron_h,
    "zamba2": read_zamba2,
    "zamba": read_zamba,
    "deepseek_v2": read_deepseek_mla,
    "deepseek_v3": read_deepseek_mla,
    "kimi_k2": read_deepseek_mla,
    "deepseek_v32": read_deepseek_mla,
    "glm_moe_dsa": read_deepseek_mla,
    "deepseek_v4": read_deepseek_v4,
    "minimax_m3_vl": read_minimax_m3,
    "minimax_m3_vl_text": read_minimax_m3,
    "qwen2_moe": _qwen_reader(SpecContext.head_dim),
    "qwen3_moe": _qwen_reader(SpecContext.head_dim),
    **GENERIC_FAMILIES,
    "lfm2": read_lfm2,
    "lfm2_moe": read_lfm2,
    "kimi_linear": read_kimi_linear,
    "mamba": read_mamba,
    "falcon_mamba": read_mamba,
    "mamba2": read_mamba2,
    "olmo_hybrid": read_olmo_hybrid,
    "qwen4_exp": read_qwen4_exp,
    "minimax": read_minimax,
    "recurrent_gemma": read_recurrent_gemma,
    "qwen4_exp_text": read_qwen4_exp,
}


def supported_model_types() -> list[str]:
    """Every `model_type` that `model_spec_from_config` reads, sorted."""
    return sorted(_REGISTRY)


_PURE_STATE = {read_mamba, read_mamba2}
_FAMILY_OF_MODULE = {
    "hybridkv.plan.model_specs": "attention: full, sliding window, chunked local",
    "hybridkv.plan.generic_specs": "attention: full, sliding window, chunked local",
    "hybridkv.plan.mla_specs": "latent (MLA) and sparse attention",
    "hybridkv.plan.state_specs": "state hybrids: Mamba, Gated DeltaNet, KDA, short convolution + attention",
    "hybridkv.plan.linear_state_specs": "state hybrids: Mamba, Gated DeltaNet, KDA, short convolution + attention",
}


def model_type_families() -> dict[str, list[str]]:
    """Every supported `model_type` by family (what its layers cache), families and types sorted."""
    families: dict[str, list[str]] = {}
    for model_type, reader in _REGISTRY.items():
        family = "pure state: Mamba" if reader in _PURE_STATE else _FAMILY_OF_MODULE[reader.__module__]
        families.setdefault(family, []).append(model_type)
    return {family: sorted(types) for family, types in sorted(families.items())}


def _context(config: Mapping[str, Any], model_type: str, options: SpecOptions) -> SpecContext:
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ConfigError(f"{model_type} config: field 'text_config' must be an object, got {text!r}")
    data: Mapping[str, Any] = text or config
    defaults = _FIELD_DEFAULTS.get(model_type)
    if defaults:
        data = {**defaults, **{key: value for key, value in data.items() if value is not None}}
    aliases = FIELD_ALIASES.get(model_type, {})
    renamed = {new: data[old] for old, new in aliases.items() if data.get(old) is not None and data.get(new) is None}
    if renamed:
        data = {**data, **renamed}
    cfg = ConfigReader(data, model_type=model_type, parent=config if text else None)
    if options.dtype is not None:
        dtype = normalize_dtype(options.dtype, what="SpecOptions.dtype")
    else:
        declared = cfg.inherited("dtype", "torch_dtype")
        dtype = DEFAULT_DTYPE if declared is None else normalize_dtype(declared, what=f"{model_type} config: dtype")
    return SpecContext(cfg=cfg, options=options, dtype=dtype)


# vLLM's keys for a model's length, the smallest found wins; `model_max_length` overrides them all
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")


def _max_length(cfg: ConfigReader) -> int:
    """The model's length limit read as vLLM reads it (`model_arch_config_convertor`), or a ConfigError."""
    if cfg.inherited("model_max_length") is not None:
        return cfg.require_inherited_int("model_max_length")
    found = [cfg.require_inherited_int(key) for key in _LENGTH_KEYS if cfg.inherited(key) is not None]
    if not found:
        return cfg.require_inherited_int("max_position_embeddings")  # the error names the usual field
    return min(found)


def model_spec_from_config(
    config: Mapping[str, Any], *, name: str, options: SpecOptions = _DEFAULT_OPTIONS
) -> ModelSpec:
    """The per-layer cache specs of the model described by `config` (a parsed config.json).

    Raises `UnsupportedModelError` for a `model_type` not in `supported_model_types()` and
    `ConfigError` for a missing or invalid field (the message names the field and model type).
    A layer with attention and a state gets its state in an extra slot (`ModelSpec.decoder_layer_of`).
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a JSON object (dict), got {type(config).__name__}")
    model_type = config.get("model_type")
    reader = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if reader is None:
        supported = ", ".join(supported_model_types())
        if model_type is None:
            raise ConfigError(f"config has no 'model_type' field; expected one of: {supported}")
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported model types: {supported}")
    assert isinstance(model_type, str)
    ctx = _context(config, model_type, options)
    family = reader(ctx)
    sparse_mla = family.kernel_backend in (SPARSE_MLA_BACKEND, DSV4_BACKEND)
    check_kv_cache_dtype(model_type, options.kv_cache_dtype, sparse_mla=sparse_mla)
    num_decoder_layers = len(family.layers)
    return ModelSpec(
        name=name,
        model_type=model_type,
        dtype=ctx.dtype,
        layers=family.layers + tuple(spec for _, spec in family.second_caches),
        kv_shared_from=dict(family.kv_shared_from),
        max_position_embeddings=_max_length(ctx.cfg),
        decoder_layer_of={num_decoder_layers + k: layer for k, (layer, _) in enumerate(family.second_caches)},
        kernel_block_size=family.kernel_block_size,
        kernel_backend=family.kernel_backend,
    )


def load_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json at `path`, a file or a Hugging Face model directory holding one.

    Raises `ConfigError` when the file is missing, unreadable, not JSON, or not a JSON object.
    """
    location = Path(path)
    file = location / "config.json" if location.is_dir() else location
    if not file.is_file():
        raise ConfigError(f"no config.json at {file}; expected a config.json file or a model directory holding one")
    try:
        if file.stat().st_size > bounded_json.MAX_CONFIG_BYTES:
            raise ConfigError(f"{file} has {file.stat().st_size} bytes; a config.json of at most "
                              f"{bounded_json.MAX_CONFIG_BYTES} is read")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from None
    data = bounded_json.loads(text, what=str(file))
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, got a JSON {type(data).__name__}")
    return data
