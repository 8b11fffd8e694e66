"""Short-conv, KDA, pure Mamba and OLMo-Hybrid specs against the caches transformers 5.23 allocates.

Each state layer's conv state is (1, channels, conv_kernel) in transformers and (conv_kernel - 1,
channels) in our spec (vLLM keeps one column less); the recurrent state is compared after the batch
dimension, with Gated DeltaNet's (heads, k_dim, v_dim) read as vLLM's (heads, v_dim, k_dim). LFM2 keeps
no recurrent state. Kimi-Linear's full layers are MLA latents (keys kv_lora_rank, values rope dim).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.specs import AttentionSpec, MambaSpec, MambaType, MLASpec, SpecKind  # noqa: E402
from tests.plan.test_generic_specs_vs_transformers import TINY  # noqa: E402

T = 10
_MIXED = ["linear_attention", "full_attention", "linear_attention"]
_MAMBA1 = {"state_size": 8, "conv_kernel": 4, "expand": 2, "intermediate_size": 128, "time_step_rank": 8}
STATE_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "conv_L_cache": 3, "num_dense_layers": 1},
    "mamba": _MAMBA1,
    "falcon_mamba": _MAMBA1,
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 2, "state_size": 8, "conv_kernel": 4,
               "chunk_size": 4},
    "olmo_hybrid": {"layer_types": _MIXED, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 3},
    "kimi_linear": {"layer_types": _MIXED, "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 3,
                    "kv_lora_rank": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "num_key_value_heads": 4, "mlp_layer_types": ["dense"] * 3},
}


def _layers(model_type: str) -> tuple[Any, list[Any]]:
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **STATE_ARCHITECTURES[model_type]})
    spec = model_spec_from_config(config.to_dict(), name=model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        out = model(input_ids=torch.randint(2, 128, (1, T)), use_cache=True)
    cache = getattr(out, "past_key_values", None) or out.cache_params
    return spec, list(cache.layers)


@pytest.mark.parametrize("model_type", sorted(STATE_ARCHITECTURES))
def test_state_shapes_match_transformers(model_type: str) -> None:
    spec, layers = _layers(model_type)
    assert len(layers) == spec.num_decoder_layers == len(spec.layers)
    for i, (layer, own) in enumerate(zip(layers, spec.layers, strict=True)):
        where = f"{model_type} layer {i}"
        if isinstance(own, AttentionSpec):
            assert tuple(layer.keys.shape) == (1, own.num_kv_heads, T, own.head_dim), where
        elif isinstance(own, MLASpec):
            assert tuple(layer.keys.shape) == (1, 1, T, own.kv_lora_rank), where
            assert layer.values.shape[-1] == own.qk_rope_head_dim, where
        else:
            assert isinstance(own, MambaSpec), where
            (columns, channels), *recurrent = own.shapes
            assert tuple(layer.conv_states[0].shape) == (1, channels, columns + 1), where
            theirs = layer.recurrent_states[0]
            if not recurrent:
                assert own.mamba_type is MambaType.SHORT_CONV and theirs is None, where
                continue
            shape = tuple(theirs.shape)[1:]
            if own.mamba_type is MambaType.GATED_DELTANET:
                shape = (shape[0], shape[2], shape[1])
            assert (shape,) == tuple(recurrent), where


def test_minimax_lightning_states_match_transformers_linear_cache() -> None:
    """MiniMax-Text-01: transformers keeps each lightning layer's (1, H, D, D) state in `linear_cache`
    (model dtype) and K/V only on the softmax layers."""
    fields = {"layer_types": _MIXED, "head_dim": 16, "block_size": 4}
    config = transformers.AutoConfig.for_model("minimax", **{**TINY, **fields})
    spec = model_spec_from_config(config.to_dict(), name="minimax")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(2, 128, (1, T)), use_cache=True).past_key_values
    for i, own in enumerate(spec.layers):
        if isinstance(own, MambaSpec):
            assert own.mamba_type is MambaType.LIGHTNING and len(own.shapes) == 1
            state = cache.linear_cache[i]
            assert (tuple(state.shape)[1:],) == own.shapes and str(state.dtype) == f"torch.{own.dtypes[0]}"
        else:
            assert isinstance(own, AttentionSpec)
            assert tuple(cache.layers[i].keys.shape) == (1, own.num_kv_heads, T, own.head_dim)


def test_recurrent_gemma_states_and_local_attention_match_transformers() -> None:
    """RecurrentGemma keeps its RG-LRU states on the modules (`conv1d_state` (1, W, K-1), `rg_lru.recurrent_states`
    (1, W) float32) and local-attention K/V in the cache (the last window - 1 tokens)."""
    fields = {"num_hidden_layers": 3, "block_types": ["recurrent", "attention"], "attention_window_size": 4,
              "lru_width": 64, "conv1d_width": 3, "head_dim": 16}
    config = transformers.AutoConfig.for_model("recurrent_gemma", **{**TINY, **fields})
    spec = model_spec_from_config(config.to_dict(), name="rg")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache = transformers.DynamicCache(config=config)  # the model does not return the one it makes
    with torch.no_grad():
        model(input_ids=torch.randint(2, 128, (1, T)), use_cache=True, past_key_values=cache)
    kinds = []
    for i, (layer, own) in enumerate(zip(model.model.layers, spec.layers, strict=True)):
        if isinstance(own, MambaSpec):
            (columns, width), recurrent = own.shapes
            block = layer.temporal_block
            assert tuple(block.conv1d_state.shape) == (1, width, columns)
            assert (tuple(block.rg_lru.recurrent_states.shape)[1:],) == (recurrent,) and own.dtypes[1] == "float32"
            kinds.append("recurrent")
        else:
            assert isinstance(own, AttentionSpec) and own.kind is SpecKind.SLIDING_WINDOW
            kept = min(T, own.window_tokens - 1)
            assert tuple(cache.layers[i].keys.shape) == (1, own.num_kv_heads, kept, own.head_dim)
            kinds.append("attention")
    assert kinds == ["recurrent", "attention", "recurrent"]


def test_zamba_mamba_and_hybrid_layers_match_transformers() -> None:
    """Zamba1: transformers caches every layer's multi-head Mamba state and, on the hybrid layers, the shared
    attention's K/V (attention_head_dim = 2 * hidden / heads)."""
    fields = {"num_hidden_layers": 6, "attn_layer_period": 3, "attn_layer_offset": 1, "n_mamba_heads": 2,
              "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}
    config = transformers.AutoConfig.for_model("zamba", **{**TINY, **fields})
    saved = config.to_dict()
    spec = model_spec_from_config(saved, name="zamba")
    derived = model_spec_from_config({k: v for k, v in saved.items() if k != "layers_block_type"}, name="zamba")
    assert derived.layers == spec.layers  # the hub form (period / offset) reads the same layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(2, 128, (1, T)), use_cache=True).past_key_values
    hybrid = sorted(spec.decoder_layer_of.values())
    assert hybrid == [2, 4]
    for i, layer in enumerate(cache.layers):
        own = spec.layers[i]
        second = next((slot for slot, owner in spec.decoder_layer_of.items() if owner == i), None)
        state = own if second is None else spec.layers[second]
        assert isinstance(state, MambaSpec)
        (columns, channels), recurrent = state.shapes
        assert tuple(layer.conv_states[0].shape) == (1, channels, columns + 1)
        assert tuple(layer.recurrent_states[0].shape)[1:] == recurrent
        if i in hybrid:
            assert isinstance(own, AttentionSpec)
            assert tuple(layer.keys.shape) == (1, own.num_kv_heads, T, own.head_dim)
