"""model_spec_from_config on small hand-written config.json dicts, with hand-computed numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.errors import ConfigError, UnsupportedModelError
from hybridkv.plan.model_specs import (
    KVCacheDType,
    SpecOptions,
    load_config,
    model_spec_from_config,
    supported_model_types,
)
from hybridkv.plan.planner import PlannerOptions, build_kv_cache_config
from hybridkv.plan.specs import AttentionSpec, MambaSpec, MambaType, ModelSpec, SpecKind

F, S, C, M = SpecKind.FULL, SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL, SpecKind.MAMBA

BASE: dict[str, Any] = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
}
FAMILY: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2},
    "qwen2": {"num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2},
    "gemma3_text": {"num_hidden_layers": 7, "head_dim": 256, "sliding_window": 1024},
    "gemma4_text": {"num_hidden_layers": 6, "head_dim": 256, "global_head_dim": 512, "num_key_value_heads": 16,
                    "num_global_key_value_heads": 4, "attention_k_eq_v": True, "sliding_window": 1024},
    "llama4_text": {"num_hidden_layers": 8, "head_dim": 128, "attention_chunk_size": 8192, "no_rope_layers": []},
    "qwen3_5_text": {"num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                     "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                     "linear_conv_kernel_dim": 4, "full_attention_interval": 4},
    "jamba": {"num_hidden_layers": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
              "mamba_d_conv": 4, "mamba_expand": 2},
    "bamba": {"num_hidden_layers": 4, "attn_layer_indices": [2], "mamba_n_heads": 128, "mamba_d_head": "auto",
              "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2},
    "falcon_h1": {"num_hidden_layers": 2, "head_dim": 128, "mamba_d_ssm": 1024, "mamba_n_heads": 16,
                  "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4},
    "nemotron_h": {"hybrid_override_pattern": "M-M*-E", "head_dim": 128, "mamba_num_heads": 128,
                   "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4},
    "zamba2": {"num_hidden_layers": 3, "hidden_size": 2560, "layers_block_type": ["mamba", "hybrid", "mamba"],
               "n_mamba_heads": 80, "mamba_ngroups": 1, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2},
}


def make_config(*, model_type: str, **overrides: Any) -> dict[str, Any]:
    """A config.json dict of `model_type`: the family's base fields, then `overrides` (None deletes)."""
    family = model_type if model_type in FAMILY else "llama"
    config = {"model_type": model_type, **BASE, **FAMILY[family], **overrides}
    return {key: value for key, value in config.items() if value is not None}


def read(*, options: SpecOptions | None = None, **config: Any) -> ModelSpec:
    return model_spec_from_config(make_config(**config), name="m", options=options or SpecOptions())


def kinds(spec: ModelSpec) -> list[SpecKind | None]:
    return [None if layer is None else layer.kind for layer in spec.layers]


def attention(spec: ModelSpec, i: int) -> AttentionSpec:
    layer = spec.layers[i]
    assert isinstance(layer, AttentionSpec)
    return layer


def state(spec: ModelSpec, i: int) -> MambaSpec:
    layer = spec.layers[i]
    assert isinstance(layer, MambaSpec)
    return layer


# --- attention-only families ---------------------------------------------------------------

def test_llama_pages_and_defaults() -> None:
    spec = read(model_type="llama")
    assert (spec.model_type, spec.dtype, spec.max_position_embeddings) == ("llama", "bfloat16", 8192)
    assert kinds(spec) == [F, F]
    layer = attention(spec, 0)
    assert (layer.num_kv_heads, layer.head_dim) == (8, 128)  # head_dim = 4096 // 32
    assert layer.page_size_bytes(16) == 2 * 16 * 8 * 128 * 2 == 65536
    assert spec.kv_shared_from == {} and spec.decoder_layer_of == {} and spec.num_decoder_layers == 2


@pytest.mark.parametrize(("fields", "expected"), [
    ({"torch_dtype": "float16"}, "float16"),
    ({"dtype": "float32", "torch_dtype": "float16"}, "float32"),
    ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
])
def test_model_dtype_from_config(fields: dict[str, Any], expected: str) -> None:
    spec = read(model_type="llama", **fields)
    assert spec.dtype == expected == attention(spec, 1).dtype


def test_dtype_option_overrides_config() -> None:
    spec = read(model_type="llama", torch_dtype="float16", options=SpecOptions(dtype="float32"))
    assert attention(spec, 0).page_size_bytes(1) == 2 * 8 * 128 * 4


def test_missing_num_key_value_heads_means_multi_head_attention() -> None:
    assert attention(read(model_type="llama", num_key_value_heads=None), 0).num_kv_heads == 32


def test_mistral_slides_everywhere_when_window_set() -> None:
    assert kinds(read(model_type="mistral", num_hidden_layers=3, sliding_window=4096)) == [S, S, S]
    assert attention(read(model_type="mistral", num_hidden_layers=1, sliding_window=4096), 0).window_tokens == 4096
    assert kinds(read(model_type="mistral", num_hidden_layers=2)) == [F, F]


def test_ministral_layer_types() -> None:
    spec = read(model_type="ministral", num_hidden_layers=3, sliding_window=32768,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert kinds(spec) == [S, F, S]


def test_qwen2_sliding_needs_use_sliding_window() -> None:
    assert kinds(read(model_type="qwen2")) == [F, F, F, F]
    spec = read(model_type="qwen2", use_sliding_window=True)
    assert kinds(spec) == [F, F, S, S]  # layers >= max_window_layers slide
    assert attention(spec, 3).window_tokens == 4096
    explicit = ["sliding_attention", "full_attention", "full_attention", "full_attention"]
    assert kinds(read(model_type="qwen2", use_sliding_window=True, layer_types=explicit)) == [S, F, F, F]


def test_qwen3_reads_head_dim_not_hidden_over_heads() -> None:
    spec = read(model_type="qwen3", hidden_size=1024, num_attention_heads=16, head_dim=128, num_hidden_layers=1)
    assert attention(spec, 0).head_dim == 128
    with pytest.raises(ConfigError, match=r"qwen3 config: required field 'head_dim' is missing"):
        read(model_type="qwen3", num_hidden_layers=1)


def test_gemma2_and_gemma3_patterns() -> None:
    assert kinds(read(model_type="gemma2", num_hidden_layers=3, head_dim=256, sliding_window=4096)) == [S, F, S]
    assert kinds(read(model_type="gemma3_text")) == [S, S, S, S, S, F, S]  # full every 6th
    assert kinds(read(model_type="gemma3_text", sliding_window_pattern=2, num_hidden_layers=4)) == [S, F, S, F]


def test_gemma3_27b_has_52_sliding_and_10_full_layers() -> None:
    spec = read(model_type="gemma3_text", num_hidden_layers=62, sliding_window_pattern=6)
    assert (kinds(spec).count(S), kinds(spec).count(F)) == (52, 10)
    assert [i for i, kind in enumerate(kinds(spec)) if kind is F] == list(range(5, 62, 6))


def test_gemma3_wrapper_reads_text_config_and_top_level_dtype() -> None:
    text = make_config(model_type="gemma3_text")
    wrapper = {"model_type": "gemma3", "torch_dtype": "float16", "text_config": text,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}
    spec = model_spec_from_config(wrapper, name="gemma-3")
    assert (spec.model_type, spec.dtype, spec.max_position_embeddings) == ("gemma3", "float16", 8192)
    assert kinds(spec) == [S, S, S, S, S, F, S]
    assert (attention(spec, 5).head_dim, attention(spec, 0).window_tokens) == (256, 1024)


def test_cohere2_head_dim_is_hidden_over_heads() -> None:
    spec = read(model_type="cohere2", num_hidden_layers=4, head_dim=999, sliding_window=4096)
    assert kinds(spec) == [S, S, S, F]
    assert attention(spec, 0).head_dim == 128


def test_gpt_oss_alternates_from_sliding() -> None:
    spec = read(model_type="gpt_oss", num_hidden_layers=4, head_dim=64, sliding_window=128)
    assert kinds(spec) == [S, F, S, F]
    assert attention(spec, 0).page_size_bytes(16) == 2 * 16 * 8 * 64 * 2


def test_gemma3n_kv_sharing_reads_last_earlier_layer_of_same_type() -> None:
    spec = read(model_type="gemma3n_text", num_hidden_layers=10, head_dim=256, sliding_window=512,
                num_kv_shared_layers=4)
    assert kinds(spec) == [S, S, S, S, F, S, S, S, S, F]  # full every 5th
    assert spec.kv_shared_from == {6: 5, 7: 5, 8: 5, 9: 4}
    assert [i for i, _ in spec.owned_layers()] == [0, 1, 2, 3, 4, 5]


def test_gemma3n_missing_fields_take_the_transformers_defaults() -> None:
    """Gemma3nTextConfig defaults: 35 layers, full every 5th, 2 KV heads of 256, window 512, the
    last 15 layers share KV, 32768 positions. Layers 20..34 read layer 18 (sliding) or 19 (full)."""
    spec = model_spec_from_config({"model_type": "gemma3n_text"}, name="g3n")
    assert spec.num_decoder_layers == 35 and spec.max_position_embeddings == 32768
    assert [i for i, kind in enumerate(kinds(spec)) if kind is F] == [4, 9, 14, 19, 24, 29, 34]
    assert spec.kv_shared_from == {i: 19 if i % 5 == 4 else 18 for i in range(20, 35)}
    sliding, full = attention(spec, 0), attention(spec, 4)
    assert (sliding.num_kv_heads, sliding.head_dim, sliding.window_tokens) == (2, 256, 512)
    assert (full.num_kv_heads, full.head_dim) == (2, 256)
    # Explicit values win; an explicit null means the default too.
    spec = model_spec_from_config({"model_type": "gemma3n_text", "num_hidden_layers": 10, "head_dim": 128,
                                   "num_key_value_heads": 4, "sliding_window": None, "num_kv_shared_layers": 0},
                                  name="g3n")
    assert spec.kv_shared_from == {} and attention(spec, 0).window_tokens == 512
    assert (attention(spec, 0).num_kv_heads, attention(spec, 0).head_dim) == (4, 128)
    with pytest.raises(ConfigError, match="num_kv_shared_layers = 15 must be smaller than num_hidden_layers = 10"):
        model_spec_from_config({"model_type": "gemma3n_text", "num_hidden_layers": 10}, name="g3n")


def test_gemma4_hub_form_full_layers_use_global_geometry() -> None:
    spec = read(model_type="gemma4_text")
    assert kinds(spec) == [S, S, S, S, S, F]
    full, sliding = attention(spec, 5), attention(spec, 0)
    assert (full.num_kv_heads, full.head_dim, sliding.num_kv_heads, sliding.head_dim) == (4, 512, 16, 256)
    assert full.page_size_bytes(16) == 2 * 16 * 4 * 512 * 2 == 131072
    assert sliding.page_size_bytes(16) == 2 * 16 * 16 * 256 * 2 == 262144
    # num_global_key_value_heads only applies when K = V (attention_k_eq_v).
    assert attention(read(model_type="gemma4_text", attention_k_eq_v=False), 5).num_kv_heads == 16


def test_gemma4_per_layer_config_and_wrapper() -> None:
    text = make_config(model_type="gemma4_text", global_head_dim=None, num_global_key_value_heads=None,
                       per_layer_config={"5": {"head_dim": 512, "num_key_value_heads": 2}})
    spec = model_spec_from_config({"model_type": "gemma4", "text_config": text}, name="g4")
    assert (attention(spec, 5).num_kv_heads, attention(spec, 5).head_dim) == (2, 512)
    assert attention(spec, 4).head_dim == 256


def test_gemma4_kv_sharing() -> None:
    spec = read(model_type="gemma4_text", num_hidden_layers=12, num_kv_shared_layers=5)
    assert kinds(spec) == [S, S, S, S, S, F] * 2
    assert spec.kv_shared_from == {7: 6, 8: 6, 9: 6, 10: 6, 11: 5}


def test_llama4_chunked_rope_layers_full_nope_layers() -> None:
    spec = read(model_type="llama4_text")
    assert kinds(spec) == [C, C, C, F, C, C, C, F]  # default: every 4th layer is NoPE (full)
    assert attention(spec, 0).chunk_tokens == 8192
    assert kinds(read(model_type="llama4_text", num_hidden_layers=2, no_rope_layers=[0, 1])) == [F, C]
    assert kinds(read(model_type="llama4_text", num_hidden_layers=2, attention_chunk_size=None)) == [F, F]
    wrapped = model_spec_from_config({"model_type": "llama4", "text_config": make_config(model_type="llama4_text")},
                                     name="scout")
    assert wrapped.layers == spec.layers


def test_tensor_parallel_and_fp8_attention() -> None:
    options = SpecOptions(tp_size=4, kv_cache_dtype=KVCacheDType.FP8)
    layer = attention(read(model_type="llama", options=options), 0)
    assert (layer.num_kv_heads, layer.dtype, layer.page_size_bytes(16)) == (2, "fp8", 2 * 16 * 2 * 128 * 1)
    # More ranks than KV heads: each rank keeps one (replicated) head.
    assert attention(read(model_type="llama", options=SpecOptions(tp_size=16)), 0).num_kv_heads == 1
    with pytest.raises(ConfigError, match=r"num_key_value_heads = 6 is not divisible by the tensor-parallel size 4"):
        read(model_type="llama", num_attention_heads=24, num_key_value_heads=6, head_dim=128,
             options=SpecOptions(tp_size=4))


def test_tensor_parallel_must_split_heads_evenly_and_head_dim_must_be_whole() -> None:
    # vLLM's rules: TP divides the attention heads; KV heads split (tp <= kv) or replicate (tp a multiple).
    with pytest.raises(ConfigError, match=r"num_attention_heads = 32 is not divisible by the tensor-parallel size 64"):
        read(model_type="llama", options=SpecOptions(tp_size=64))
    with pytest.raises(ConfigError, match=r"tensor-parallel size 16 is not a multiple of num_key_value_heads = 6"):
        read(model_type="llama", num_attention_heads=48, num_key_value_heads=6, head_dim=128,
             options=SpecOptions(tp_size=16))
    # 4032 / 192 = 21: a whole head_dim is fine; 4000 / 192 is not.
    assert attention(read(model_type="llama", hidden_size=4032, num_attention_heads=192,
                          num_key_value_heads=192), 0).head_dim == 21
    with pytest.raises(ConfigError, match=r"hidden_size = 4000 is not divisible by num_attention_heads = 192"):
        read(model_type="llama", hidden_size=4000, num_attention_heads=192, num_key_value_heads=192)


# --- recurrent-state families --------------------------------------------------------------

def test_qwen3_5_gated_deltanet_state() -> None:
    spec = read(model_type="qwen3_5_text", mamba_ssm_dtype="float32")
    assert kinds(spec) == [M, M, M, F]
    gdn = state(spec, 0)
    assert gdn.mamba_type is MambaType.GATED_DELTANET
    assert gdn.shapes == ((3, 2 * 16 * 128 + 32 * 128), (32, 128, 128))
    assert gdn.dtypes == ("bfloat16", "float32")
    assert gdn.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 4 == 2146304
    assert attention(spec, 3).page_size_bytes(16) == 2 * 16 * 2 * 256 * 2


def test_qwen3_5_wrapper_inherits_ssm_dtype_and_tp_speculative_fp8() -> None:
    text = make_config(model_type="qwen3_5_text")
    config = {"model_type": "qwen3_5_moe", "text_config": text, "mamba_ssm_dtype": "float32"}
    options = SpecOptions(tp_size=2, num_speculative_tokens=2, kv_cache_dtype=KVCacheDType.FP8)
    spec = model_spec_from_config(config, name="q", options=options)
    gdn = state(spec, 0)
    assert gdn.shapes == ((3 + 2, 8192 // 2), (16, 128, 128))
    assert gdn.dtypes == ("bfloat16", "float32")  # fp8 applies to attention K/V only
    assert (attention(spec, 3).num_kv_heads, attention(spec, 3).dtype) == (1, "fp8")


def test_qwen3_next_layer_types() -> None:
    fields = FAMILY["qwen3_5_text"] | {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
    spec = read(model_type="qwen3_next", **fields)
    assert kinds(spec) == [F, M]
    assert state(spec, 1).dtypes == ("bfloat16", "bfloat16")


def test_jamba_mamba1_state() -> None:
    spec = read(model_type="jamba")
    assert kinds(spec) == [M, M, M, M, F, M, M, M]
    mamba = state(spec, 0)
    assert mamba.mamba_type is MambaType.MAMBA1
    assert mamba.shapes == ((3, 8192), (8192, 16))
    assert mamba.state_bytes == (3 * 8192 + 8192 * 16) * 2


def test_bamba_mamba2_state_and_group_replication_under_tp() -> None:
    spec = read(model_type="bamba")
    assert kinds(spec) == [M, M, F, M]
    mamba = state(spec, 0)
    assert mamba.mamba_type is MambaType.MAMBA2
    assert mamba.shapes == ((3, 8192 + 2 * 1 * 128), (128, 64, 128))  # head dim "auto" = 8192 // 128
    tp4 = state(read(model_type="bamba", options=SpecOptions(tp_size=4)), 0)
    assert tp4.shapes == ((3, 8192 // 4 + 2 * 128), (32, 64, 128))  # the one group is copied to every rank


def test_granitemoehybrid_legacy_layer_type_names() -> None:
    spec = read(model_type="granitemoehybrid", **FAMILY["bamba"], layer_types=["mamba", "attention", "mamba", "mamba"])
    assert kinds(spec) == [M, F, M, M]
    assert kinds(read(model_type="granitemoehybrid", **FAMILY["bamba"])) == [M, M, M, M]


def test_falcon_h1_every_layer_has_attention_and_state() -> None:
    spec = read(model_type="falcon_h1")
    assert (spec.num_layers, spec.num_decoder_layers) == (4, 2)
    assert kinds(spec) == [F, F, M, M]
    assert spec.decoder_layer_of == {2: 0, 3: 1}
    assert state(spec, 2).shapes == ((3, 1024 + 2 * 64), (16, 64, 64))  # mamba_d_ssm, not expand * hidden
    assert attention(spec, 0).head_dim == 128


def test_falcon_h1_plans_attention_and_state_slots() -> None:
    spec = read(model_type="falcon_h1")
    config = build_kv_cache_config(spec, PlannerOptions(memory_bytes=1 << 30, max_model_len=4096))
    grouped = sorted(layer for group in config.groups for layer in group.layer_indices)
    assert grouped == [0, 1, 2, 3]


def test_nemotron_h_pattern_and_float32_state_default() -> None:
    spec = read(model_type="nemotron_h")
    assert kinds(spec) == [M, None, M, F, None, None]
    assert spec.cacheless_layers == (1, 4, 5)
    mamba = state(spec, 0)
    assert mamba.shapes == ((3, 128 * 64 + 2 * 8 * 128), (128, 64, 128))
    assert mamba.dtypes == ("bfloat16", "float32")
    assert state(read(model_type="nemotron_h", mamba_ssm_cache_dtype="bfloat16"), 0).dtypes == ("bfloat16",) * 2
    saved_form = read(model_type="nemotron_h", hybrid_override_pattern=None,
                      layers_block_type=["linear_attention", "mlp", "full_attention", "moe"])
    assert kinds(saved_form) == [M, None, F, None]
    older_hub_form = read(model_type="nemotron_h", head_dim=None, attention_head_dim=64)
    assert attention(older_hub_form, 3).head_dim == 64
    with pytest.raises(ConfigError, match=r"nemotron_h config: required field 'n_groups' is missing"):
        read(model_type="nemotron_h", n_groups=None)


def test_zamba2_hybrid_layers_get_attention_and_state() -> None:
    spec = read(model_type="zamba2")
    assert kinds(spec) == [M, F, M, M]
    assert spec.decoder_layer_of == {3: 1}
    assert state(spec, 3) == state(spec, 0)
    assert state(spec, 0).shapes == ((3, 5120 + 2 * 64), (80, 64, 64))  # head dim 2 * 2560 // 80
    assert attention(spec, 1).head_dim == 2 * 2560 // 32  # reads concat(hidden, embeddings)


def test_conv_state_grows_with_speculative_tokens() -> None:
    spec = read(model_type="jamba", options=SpecOptions(num_speculative_tokens=3))
    assert state(spec, 0).shapes[0] == (3 + 3, 8192)


# --- errors --------------------------------------------------------------------------------

def test_supported_model_types() -> None:
    types = supported_model_types()
    assert types == sorted(types)
    for expected in ("llama", "gemma3", "gemma4_text", "llama4", "qwen3_5_moe", "falcon_h1", "zamba2"):
        assert expected in types


def test_unknown_model_type_lists_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match=r"model_type 'bert' is not supported") as info:
        model_spec_from_config({"model_type": "bert"}, name="b")
    assert isinstance(info.value, KeyError)
    for model_type in supported_model_types():
        assert model_type in str(info.value)


@pytest.mark.parametrize(("config", "message"), [
    ({"num_hidden_layers": 2, "hidden_size": 64}, r"config has no 'model_type' field; expected one of: .*llama"),
    (make_config(model_type="llama", num_hidden_layers=None),
     r"llama config: required field 'num_hidden_layers' is missing; expected an integer >= 1"),
    (make_config(model_type="llama", max_position_embeddings=None), r"'max_position_embeddings' is missing"),
    (make_config(model_type="llama", num_key_value_heads=True), r"'num_key_value_heads' must be a positive integer"),
    (make_config(model_type="llama", dtype="int4"), r"llama config: dtype 'int4' is not a known dtype"),
    (make_config(model_type="llama", num_hidden_layers=-1),
     r"llama config: field 'num_hidden_layers' must be a positive integer, got -1"),
    (make_config(model_type="qwen3_5_text", linear_num_value_heads=None), r"'linear_num_value_heads' is missing"),
    (make_config(model_type="gemma2", head_dim=256, layer_types=["sliding_attention", "mamba"]),
     r"layer_types\[1\] = 'mamba' is not a layer type of this model; expected one of"),
    (make_config(model_type="gemma2", head_dim=256, layer_types=["full_attention"]),
     r"'layer_types' has 1 entries, expected num_hidden_layers = 2"),
    (make_config(model_type="gemma2", head_dim=256), r"needs 'sliding_window', which is missing"),
    (make_config(model_type="gemma3n_text", head_dim=256, sliding_window=512, num_kv_shared_layers=2),
     r"num_kv_shared_layers = 2 must be smaller than num_hidden_layers = 2"),
    (make_config(model_type="gemma3n_text", num_hidden_layers=4, head_dim=256, sliding_window=512,
                 num_kv_shared_layers=1, layer_types=["sliding_attention"] * 3 + ["full_attention"]),
     r"layer 3 \(full_attention\) shares KV, but none of layers 0..2 is full_attention"),
    (make_config(model_type="jamba", attn_layer_offset=8), r"attn_layer_offset = 8 must be smaller"),
    (make_config(model_type="nemotron_h", hybrid_override_pattern="M*X"), r"unknown symbols \['X'\]"),
    (make_config(model_type="nemotron_h", hybrid_override_pattern=None), r"needs 'layers_block_type'"),
    (make_config(model_type="zamba2", layers_block_type=None), r"'layers_block_type' is missing"),
    (make_config(model_type="bamba", mamba_d_head=32), r"mamba_n_heads \* mamba_d_head = 128 \* 32 must equal"),
    ({"model_type": "gemma3", "text_config": [1, 2]}, r"'text_config' must be an object"),
])
def test_bad_configs_say_what_and_where(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        model_spec_from_config(config, name="m")


def test_mamba_splits_must_divide_tp() -> None:
    with pytest.raises(ConfigError, match=r"jamba config: mamba intermediate size = 8192 is not divisible by the "
                                          r"tensor-parallel size 3"):
        read(model_type="jamba", options=SpecOptions(tp_size=3))
    with pytest.raises(ConfigError, match=r"n_groups = 3 is neither a divisor nor a multiple of the tensor-parallel "
                                          r"size 2"):
        read(model_type="bamba", mamba_n_groups=3, options=SpecOptions(tp_size=2))


@pytest.mark.parametrize("kwargs", [{"tp_size": 0}, {"tp_size": True}, {"num_speculative_tokens": -1},
                                    {"dtype": "int8"}, {"kv_cache_dtype": "fp8"}])
def test_spec_options_validate(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SpecOptions(**kwargs)


def test_decoder_layer_of_must_name_trailing_slots() -> None:
    full = AttentionSpec(kind=SpecKind.FULL, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    common: dict[str, Any] = {"name": "m", "model_type": "t", "dtype": "bfloat16", "layers": (full, full),
                              "kv_shared_from": {}, "max_position_embeddings": 8}
    assert ModelSpec(**common, decoder_layer_of={1: 0}).num_decoder_layers == 1
    with pytest.raises(ConfigError, match="extra cache slot 0 of decoder layer 1 is invalid"):
        ModelSpec(**common, decoder_layer_of={0: 1})


# --- load_config ---------------------------------------------------------------------------

def test_load_config_from_file_and_directory(tmp_path: Path) -> None:
    config = make_config(model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert load_config(tmp_path) == config
    assert load_config(str(tmp_path / "config.json")) == config


def test_load_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config.json at .*missing"):
        load_config(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"no config.json at"):
        load_config(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama",\n  oops}', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.json is not valid JSON: .* at line 2, column 3"):
        load_config(bad)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"must hold a JSON object, got a JSON list"):
        load_config(listing)
