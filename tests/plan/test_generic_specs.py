"""The generic reader on hand-written config.json files: hub forms, vLLM's window rules, bad input.

Expected values are computed by hand from the fields (and, where vLLM and transformers differ, from
the vLLM 0.32 model code named in each test).
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import SpecOptions, model_spec_from_config
from hybridkv.plan.specs import AttentionSpec, MambaSpec, MambaType, MLASpec, SpecKind

BASE: dict[str, Any] = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                        "max_position_embeddings": 4096}


def attention_layers(config: dict[str, Any]) -> list[AttentionSpec]:
    spec = model_spec_from_config(config, name="m")
    layers = [layer for layer in spec.layers if isinstance(layer, AttentionSpec)]
    assert len(layers) == len(spec.layers)
    return layers


def test_layer_types_give_each_layer_its_kind_and_window() -> None:
    layers = attention_layers({**BASE, "model_type": "olmo3", "sliding_window": 64,
                               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                               "full_attention"]})
    assert [(layer.kind, layer.window_tokens) for layer in layers] == [(SpecKind.SLIDING_WINDOW, 64)] * 3 + [
        (SpecKind.FULL, 0)]
    assert {(layer.num_kv_heads, layer.head_dim) for layer in layers} == {(2, 32)}  # 256 / 8
    assert layers[3].bytes_per_token == 2 * 2 * 32 * 2  # K and V, 2 heads of 32, bfloat16


def test_unknown_layer_type_is_named() -> None:
    config = {**BASE, "model_type": "olmo3", "sliding_window": 64,
              "layer_types": ["full_attention", "ring_attention", "full_attention", "full_attention"]}
    expected = r"layer_types\[1\] = 'ring_attention' is not a layer type.*'sliding_attention'"
    with pytest.raises(ConfigError, match=expected):
        model_spec_from_config(config, name="m")


@pytest.mark.parametrize(("fields", "kind"), [
    # no layer list: every layer slides (vLLM's CacheConfig.sliding_window)
    ({"sliding_window": 128}, SpecKind.SLIDING_WINDOW),
    ({"sliding_window": 0}, SpecKind.FULL),  # vLLM turns 0 into "no window"
    ({"sliding_window": None}, SpecKind.FULL),
    ({"sliding_window": 128, "use_sliding_window": False}, SpecKind.FULL),
    ({"sliding_window": 128, "layer_types": ["full_attention"] * 4}, SpecKind.FULL),  # Laguna, Mellum defaults
])
def test_window_without_layer_types_follows_vllm(fields: dict[str, Any], kind: SpecKind) -> None:
    layers = attention_layers({**BASE, "model_type": "mixtral", **fields})
    assert {layer.kind for layer in layers} == {kind}


@pytest.mark.parametrize(("kv_heads", "heads"), [(12, 8), (3, 8)])
def test_kv_heads_must_divide_query_heads(kv_heads: int, heads: int) -> None:
    for model_type in ("llama", "qwen3_moe", "olmo2"):
        config = {**BASE, "model_type": model_type, "head_dim": 32, "num_key_value_heads": kv_heads,
                  "num_attention_heads": heads}
        with pytest.raises(ConfigError, match=rf"{model_type} config: num_key_value_heads = {kv_heads} must divide "
                                              rf"num_attention_heads = {heads}.*expected a divisor of {heads}"):
            model_spec_from_config(config, name="m")


def test_falcon_kv_heads_as_vllm_builds_them() -> None:
    """vLLM's falcon.py: num_kv_heads with the new decoder architecture, else 1 (multi-query) or all heads."""
    base = {**BASE, "model_type": "falcon", "num_kv_heads": 4}
    del base["num_key_value_heads"]
    heads = [attention_layers({**base, **fields})[0].num_kv_heads for fields in (
        {"new_decoder_architecture": True}, {"multi_query": True}, {"multi_query": False})]
    assert heads == [4, 1, 8]


def test_mimo_v2_flash_hub_form() -> None:
    """The hub config: hybrid_layer_pattern (1 = sliding), sliding_window_size and the swa_* geometry."""
    config = {**BASE, "model_type": "mimo_v2_flash", "head_dim": 192, "v_head_dim": 128, "num_key_value_heads": 4,
              "hybrid_layer_pattern": [0, 1, 1, 0], "sliding_window_size": 128, "swa_num_key_value_heads": 8,
              "swa_num_attention_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128}
    full, swa, _, _ = attention_layers(config)
    assert (full.kind, full.num_kv_heads, full.head_dim, full.value_head_dim) == (SpecKind.FULL, 4, 192, 128)
    assert (swa.kind, swa.window_tokens, swa.num_kv_heads) == (SpecKind.SLIDING_WINDOW, 128, 8)
    assert swa.bytes_per_token == 8 * (192 + 128) * 2


def test_step3p5_hub_form_sliding_layers_own_heads() -> None:
    """vLLM's step3p5.py: KV heads are num_attention_groups; attention_other_setting gives the sliding layers'
    heads; without layer_types the even layers slide."""
    config = {**BASE, "model_type": "step3p5", "num_attention_groups": 2, "head_dim": 128, "sliding_window": 512,
              "attention_other_setting": {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                          "num_attention_groups": 4, "head_dim": 64}}
    del config["num_key_value_heads"]
    layers = attention_layers(config)
    assert [(layer.kind, layer.num_kv_heads, layer.head_dim) for layer in layers] == [
        (SpecKind.SLIDING_WINDOW, 4, 64), (SpecKind.FULL, 2, 128)] * 2


def test_old_field_names_and_defaults() -> None:
    gpt2_config = {"model_type": "gpt2", "n_layer": 2, "n_head": 12, "n_embd": 768, "n_positions": 1024}
    gpt2 = model_spec_from_config(gpt2_config, name="gpt2")
    assert gpt2.max_position_embeddings == 1024
    assert [(s.num_kv_heads, s.head_dim) for s in gpt2.layers if isinstance(s, AttentionSpec)] == [(12, 64)] * 2
    bloom = model_spec_from_config({"model_type": "bloom", "n_layer": 2, "n_head": 8, "hidden_size": 512}, name="b")
    assert bloom.max_position_embeddings == 2048  # ALiBi: vLLM's default length


def test_kimi_linear_hub_form_and_kda_state() -> None:
    """Hub form: linear_attn_config with 1-based kda_layers; KDA keeps one conv state of q, k and v channels and
    a float32 (H, D, D) recurrent state (vLLM's kda_state_shape / kda_state_dtype); full layers are MLA."""
    config = {"model_type": "kimi_linear", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "model_max_length": 1048576,
              "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 32, "head_dim": 128,
                                     "short_conv_kernel_size": 4}}
    spec = model_spec_from_config(config, name="kimi")
    kda = spec.layers[0]
    assert isinstance(kda, MambaSpec) and kda.mamba_type is MambaType.KDA
    assert kda.shapes == ((3, 3 * 32 * 128), (32, 128, 128)) and kda.dtypes == ("bfloat16", "float32")
    assert kda.state_bytes == 3 * 12288 * 2 + 32 * 128 * 128 * 4
    assert spec.layers[1] == spec.layers[2] == kda
    mla = spec.layers[3]
    assert isinstance(mla, MLASpec) and mla.bytes_per_token == (512 + 64) * 2
    assert spec.max_position_embeddings == 1048576  # model_max_length, as vLLM reads it


def test_lfm2_full_attn_idxs_and_short_conv_state() -> None:
    config = {"model_type": "lfm2", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 8, "max_position_embeddings": 128000, "conv_L_cache": 3, "full_attn_idxs": [2]}
    spec = model_spec_from_config(config, name="lfm2")
    conv = spec.layers[0]
    assert isinstance(conv, MambaSpec) and conv.mamba_type is MambaType.SHORT_CONV
    assert conv.shapes == ((2, 1024),) and conv.state_bytes == 2 * 1024 * 2
    assert isinstance(spec.layers[2], AttentionSpec) and spec.layers[2].bytes_per_token == 2 * 8 * 64 * 2
    bad = {**config, "layer_types": ["conv", "conv", "attention", "conv"]}
    with pytest.raises(ConfigError, match=r"'layer_types' must list 4 entries 'full_attention' or 'conv'"):
        model_spec_from_config(bad, name="lfm2")


def test_lfm2_moe_with_empty_layer_types_reads_full_attn_idxs() -> None:
    config = {"model_type": "lfm2_moe", "num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 8, "max_position_embeddings": 128000, "layer_types": [],
              "full_attn_idxs": [1, 3]}
    spec = model_spec_from_config(config, name="lfm2_moe")
    assert [type(layer).__name__ for layer in spec.layers] == ["MambaSpec", "AttentionSpec"] * 2
    with pytest.raises(ConfigError, match="needs 'layer_types'"):
        model_spec_from_config({**config, "full_attn_idxs": None}, name="lfm2_moe")


def test_pure_mamba_families_default_length_and_checks() -> None:
    mamba = model_spec_from_config({"model_type": "mamba", "num_hidden_layers": 2, "hidden_size": 768,
                                    "intermediate_size": 1536, "state_size": 16, "conv_kernel": 4}, name="m")
    assert mamba.max_position_embeddings == 2048  # no length field: vLLM's default
    assert {s.shapes for s in mamba.layers if isinstance(s, MambaSpec)} == {((3, 1536), (1536, 16))}
    with pytest.raises(ConfigError, match=r"num_heads \* head_dim = 8 \* 64 must equal expand \* hidden_size = 1536"):
        model_spec_from_config({"model_type": "mamba2", "num_hidden_layers": 2, "hidden_size": 768, "num_heads": 8,
                                "head_dim": 64}, name="m2")


def test_qwen4_exp_gdn_full_and_ple_short_conv() -> None:
    """vLLM 0.32's qwen4_exp: without indexer_n_heads the "indexed_attention" layers are Qwen3-Next full attention;
    each PLE layer (1-based ple_layer_ids) adds a short-conv state of (K-1) * ngram_size columns over
    hidden_size * hc_count channels (get_ple_mamba_state_shape_from_config), never split by TP."""
    config = {"model_type": "qwen4_exp_text", "num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768,
              "layer_types": ["linear_attention"] * 3 + ["indexed_attention"], "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4, "ple_layer_ids": [1, 3], "ple_conv_kernel_size": 4, "ngram_size": 3,
              "hc_count": 4}
    spec = model_spec_from_config(config, name="q4", options=SpecOptions(tp_size=2))
    gdn, full = spec.layers[0], spec.layers[3]
    assert isinstance(gdn, MambaSpec) and gdn.shapes == ((3, 8192 // 2), (16, 128, 128))
    assert isinstance(full, AttentionSpec) and (full.kind, full.num_kv_heads, full.head_dim) == (SpecKind.FULL, 1, 256)
    assert spec.decoder_layer_of == {4: 0, 5: 2}
    ple = spec.layers[4]
    assert isinstance(ple, MambaSpec) and ple.mamba_type is MambaType.SHORT_CONV and ple.shapes == ((9, 8192),)
    with pytest.raises(ConfigError, match=r"indexer_n_heads = 8 makes the attention layers QSA sparse attention"):
        model_spec_from_config({**config, "indexer_n_heads": 8}, name="q4")


def test_minimax_hub_attn_type_list_and_lightning_state() -> None:
    """MiniMax-Text-01's hub form: attn_type_list (0 = lightning, 1 = softmax); a lightning layer keeps one
    (H, D, D) state in the model dtype (vLLM's linear_attention_state_shape), split over TP by heads."""
    config = {"model_type": "minimax", "num_hidden_layers": 4, "hidden_size": 6144, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 10240000,
              "attn_type_list": [0, 0, 0, 1]}
    spec = model_spec_from_config(config, name="m", options=SpecOptions(tp_size=8))
    state, full = spec.layers[0], spec.layers[3]
    assert isinstance(state, MambaSpec) and state.mamba_type is MambaType.LIGHTNING
    assert state.shapes == ((8, 128, 128),) and state.state_bytes == 8 * 128 * 128 * 2
    assert isinstance(full, AttentionSpec) and full.num_kv_heads == 1
