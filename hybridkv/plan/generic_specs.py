"""The generic reader: decoder families described by transformers' standard attention fields.

Most decoder families need no code of their own: their config.json says everything the cache
needs in fields every transformers config class spells the same way.

    layer_types[i]          "full_attention" | "sliding_attention" | "chunked_attention"
                            (any other value: a ConfigError naming it and the accepted ones)
    hybrid_layer_pattern[i] the MiMo hub form of the same list: 1 = sliding, 0 = full
    sliding_window          the window of the sliding layers (0 or null: no window, as vLLM reads it);
                            without a layer list every layer slides when it is set
                            (vLLM's `CacheConfig.sliding_window`), unless `use_sliding_window` is false
    attention_chunk_size    the chunk of chunked-local layers
    no_rope_layers          NoPE layers (SmolLM3): full attention, nothing changes in the cache
    num_key_value_heads     KV heads (default: num_attention_heads); must divide num_attention_heads
    head_dim                K/V head size (default: hidden_size // num_attention_heads)
    swa_num_key_value_heads, swa_head_dim, swa_v_head_dim
                            the sliding layers' own geometry where it differs (MiMo-V2-Flash, Inkling)

Older families spell the same facts differently (GPT-2's `n_layer` / `n_head` / `n_embd`, DBRX's
`d_model`, LongCat's `num_layers`): `FIELD_ALIASES` renames them before any reader runs, so a new
family with standard fields is one line in `GENERIC_FAMILIES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

from hybridkv.plan.config_fields import (
    ConfigReader,
    FamilyLayers,
    LayerRole,
    SpecContext,
    check_kv_heads,
    layer_roles,
)
from hybridkv.plan.mla_specs import read_deepseek_mla, read_longcat
from hybridkv.plan.specs import LayerSpec

__all__ = ["FIELD_ALIASES", "FIELD_DEFAULTS", "GENERIC_FAMILIES", "generic_roles", "read_generic", "read_step3p5"]

FamilyReader = Callable[[SpecContext], FamilyLayers]
KVHeadsRule = Callable[[SpecContext], int]
_FULL, _SLIDING, _CHUNKED = LayerRole.FULL, LayerRole.SLIDING, LayerRole.CHUNKED
_ATTENTION_ROLES = {_FULL, _SLIDING, _CHUNKED}

_GPT2_NAMES = MappingProxyType({"n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                                "n_embd": "hidden_size"})
# Old field name -> the standard one, per model_type (applied only where the standard name is absent).
FIELD_ALIASES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "gpt2": _GPT2_NAMES, "gpt-sw3": _GPT2_NAMES, "gpt_bigcode": _GPT2_NAMES, "gptj": _GPT2_NAMES, "bloom": _GPT2_NAMES,
    "dbrx": MappingProxyType({"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                              "d_model": "hidden_size"}),
    "longcat_flash": MappingProxyType({"num_layers": "num_hidden_layers"}),
    "step3p5": MappingProxyType({"num_attention_groups": "num_key_value_heads"}),
    "mimo_v2_flash": MappingProxyType({"sliding_window_size": "sliding_window"}),
})
# Fields a family's config class gives a default that config.json may omit.
FIELD_DEFAULTS: Mapping[str, Mapping[str, object]] = MappingProxyType({
    # No length field at all (BLOOM's ALiBi, the Mamba families, RecurrentGemma): vLLM assumes 2048 tokens.
    **dict.fromkeys(("bloom", "mamba", "falcon_mamba", "mamba2", "recurrent_gemma"),
                    MappingProxyType({"max_position_embeddings": 2048})),
})


def generic_roles(ctx: SpecContext) -> list[LayerRole]:
    """Each decoder layer's attention kind from `layer_types` (or `hybrid_layer_pattern`), else one kind."""
    cfg, n = ctx.cfg, ctx.num_layers
    roles = layer_roles(cfg, "layer_types", allowed=_ATTENTION_ROLES, num_layers=n)
    if roles is not None:
        return roles
    pattern = cfg.int_list("hybrid_layer_pattern")
    if pattern is not None:
        if len(pattern) != n or set(pattern) - {0, 1}:
            raise cfg.error(f"field 'hybrid_layer_pattern' must list {n} entries 0 (full) or 1 (sliding), "
                            f"got {pattern!r}")
        return [_SLIDING if flag else _FULL for flag in pattern]
    return [_SLIDING if _window(cfg) is not None else _FULL] * n


def _window(cfg: ConfigReader) -> int | None:
    """The sliding window; 0 / null / `use_sliding_window: false` mean none (vLLM turns 0 into None)."""
    if not cfg.get_bool("use_sliding_window", default=True):
        return None
    return cfg.optional_int("sliding_window", minimum=0) or None


def _head_dim(cfg: ConfigReader) -> int:
    """`head_dim` when set, else `hidden_size // num_attention_heads` rounded down, as both transformers and
    vLLM build these families (GLM-4.5's class default 4096 / 96 gives 42)."""
    if cfg.has("head_dim"):
        return cfg.require_int("head_dim")
    return cfg.require_int("hidden_size") // cfg.require_int("num_attention_heads")


def _standard_kv_heads(ctx: SpecContext) -> int:
    return ctx.kv_heads()


def _falcon_kv_heads(ctx: SpecContext) -> int:
    """Falcon: `num_kv_heads` with the new decoder architecture, else 1 (multi-query) or one per head."""
    cfg = ctx.cfg
    heads = cfg.require_int("num_attention_heads")
    if cfg.get_bool("new_decoder_architecture", default=False):
        kv_heads = cfg.get_int("num_kv_heads", default=heads)
    else:
        kv_heads = 1 if cfg.get_bool("multi_query", default=True) else heads
    check_kv_heads(cfg, kv_heads=kv_heads, heads=heads, fields=("num_kv_heads", "num_attention_heads"))
    return kv_heads


def _mha_kv_heads(ctx: SpecContext) -> int:
    """Multi-head attention families (GPT-2, GPT-J, GPT-NeoX, OPT, BLOOM, HRM): one KV head per query head,
    whatever `num_key_value_heads` says (neither transformers nor vLLM reads it for them)."""
    return ctx.cfg.require_int("num_attention_heads")


def _multi_query_kv_heads(ctx: SpecContext) -> int:
    """GPT-BigCode: one KV head with `multi_query` (the default), else one per head."""
    return 1 if ctx.cfg.get_bool("multi_query", default=True) else ctx.cfg.require_int("num_attention_heads")


def _dbrx_kv_heads(ctx: SpecContext) -> int:
    """DBRX: `attn_config.kv_n_heads` (default 1)."""
    cfg = ctx.cfg
    nested = ConfigReader(cfg.sub_mapping("attn_config"), model_type=f"{cfg.model_type} attn_config")
    heads = cfg.require_int("num_attention_heads")
    kv_heads = nested.get_int("kv_n_heads", default=1)
    check_kv_heads(cfg, kv_heads=kv_heads, heads=heads, fields=("attn_config.kv_n_heads", "n_heads"))
    return kv_heads


def _generic_reader(*, kv_heads: KVHeadsRule = _standard_kv_heads, value_head_field: str = "",
                    swa_kv_factor: int = 1) -> FamilyReader:
    """A reader of the standard fields; `value_head_field` names a V head size that differs from K's;
    sliding layers without `swa_num_key_value_heads` have `swa_kv_factor` times the full layers' KV heads."""

    def read(ctx: SpecContext) -> FamilyLayers:
        cfg = ctx.cfg
        roles = generic_roles(ctx)
        full_kv, head_dim = kv_heads(ctx), _head_dim(cfg)
        value_dim = cfg.get_int(value_head_field, default=0, minimum=0) if value_head_field else 0
        window, chunk = _window(cfg), cfg.optional_int("attention_chunk_size")
        layers: list[LayerSpec | None] = []
        for role in roles:
            if role is _SLIDING:  # the sliding layers' own geometry, where the config gives one
                swa_kv = cfg.get_int("swa_num_key_value_heads", default=swa_kv_factor * full_kv)
                check_kv_heads(cfg, kv_heads=swa_kv, heads=cfg.get_int("swa_num_attention_heads",
                                                                       default=cfg.require_int("num_attention_heads")),
                               fields=("swa_num_key_value_heads", "swa_num_attention_heads"))
                swa_dim = cfg.get_int("swa_head_dim", default=head_dim)
                # vLLM: without swa_v_head_dim the sliding layers' V head is their K head (swa_head_dim)
                swa_value = value_dim if value_head_field and not cfg.has("swa_head_dim") else swa_dim
                swa_value = cfg.get_int("swa_v_head_dim", default=swa_value)
                layers.append(ctx.attention(role, kv_heads=swa_kv, head_dim=swa_dim, window_tokens=window,
                                            value_head_dim=0 if swa_value == swa_dim else swa_value))
            else:
                layers.append(ctx.attention(role, kv_heads=full_kv, head_dim=head_dim, chunk_tokens=chunk,
                                            value_head_dim=0 if value_dim == head_dim else value_dim))
        return FamilyLayers(layers=tuple(layers))

    return read


read_generic = _generic_reader()


def read_step3p5(ctx: SpecContext) -> FamilyLayers:
    """Step-3.5: the hub form names KV heads `num_attention_groups` and gives the sliding layers their own
    heads in `attention_other_setting`; without `layer_types` the even layers slide (vLLM's step3p5)."""
    cfg = ctx.cfg
    other = cfg.sub_mapping("attention_other_setting")
    fields: dict[str, object] = {}
    if other.get("attention_type") == "sliding_attention":
        fields = {"swa_num_key_value_heads": other.get("num_attention_groups"),
                  "swa_num_attention_heads": other.get("num_attention_heads"), "swa_head_dim": other.get("head_dim")}
    if not cfg.has("layer_types") and _window(cfg) is not None:
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(ctx.num_layers)]
    reader = cfg.with_fields({key: value for key, value in fields.items() if value is not None})
    return read_generic(dataclasses.replace(ctx, cfg=reader))


_PLAIN = (
    "afmoe", "apertus", "arcee", "cohere", "cohere2_moe", "cwm", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe",
    "flex_olmo", "gemma", "glm", "glm4", "glm4_moe", "granite", "granite_swa", "granitemoe", "granitemoe_swa",
    "granitemoeshared", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3", "hyperclovax", "internlm3", "iquestcoder",
    "jais2", "laguna", "mellum", "minimax_m2", "ministral3", "mixtral", "nemotron", "olmo", "olmo2", "olmo3", "olmoe",
    "phi", "phi3", "seed_oss", "smollm3", "stablelm", "starcoder2", "vaultgemma",
)
_MHA = ("bloom", "gpt2", "gpt-sw3", "gptj", "gpt_neox", "hrm_text", "opt")
GENERIC_FAMILIES: Mapping[str, FamilyReader] = MappingProxyType({
    **dict.fromkeys(_PLAIN, read_generic),
    **dict.fromkeys(_MHA, _generic_reader(kv_heads=_mha_kv_heads)),
    "falcon": _generic_reader(kv_heads=_falcon_kv_heads),
    "gpt_bigcode": _generic_reader(kv_heads=_multi_query_kv_heads),
    "dbrx": _generic_reader(kv_heads=_dbrx_kv_heads),
    "step3p5": read_step3p5,
    # transformers' saved form gives the sliding layers twice the KV heads; the hub form says swa_num_key_value_heads
    "mimo_v2_flash": _generic_reader(value_head_field="v_head_dim", swa_kv_factor=2),
    # MLA (one latent per token), laid out like DeepSeek-V3
    "glm4_moe_lite": read_deepseek_mla,
    "axk1": read_deepseek_mla,
    "minicpm3": read_deepseek_mla,
    "longcat_flash": read_longcat,
    # MLA + a DSA indexer on the layers `indexer_types` marks "full" (sparse: its kernels force block 64)
    "hy_v4": read_deepseek_mla,
})
