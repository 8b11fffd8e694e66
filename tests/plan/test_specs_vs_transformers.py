"""model_spec_from_config against the caches transformers really allocates.

For a tiny random model of every supported architecture we run one forward pass over a prompt
longer than every window and chunk, then compare each layer of `past_key_values` with our spec:
K/V per-token shape (kv_heads, head_dim) and how many tokens the layer kept (its kind), and the
Mamba conv / recurrent state shapes. Two known layout differences are accounted for explicitly:
transformers keeps `conv_kernel` conv columns (we keep `conv_kernel - 1`, the vLLM way) and
stores the conv state channels-first; its Gated DeltaNet recurrent state is (heads, k_dim, v_dim)
where vLLM's is (heads, v_dim, k_dim). transformers caches chunked-local layers like sliding ones
(the last chunk - 1 tokens).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.plan.model_specs import model_spec_from_config, supported_model_types  # noqa: E402
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MambaType, ModelSpec, SpecKind  # noqa: E402

PROMPT_TOKENS = 10
WINDOW = 4  # sliding window and local-attention chunk of every tiny model, < PROMPT_TOKENS
TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 128, "max_position_embeddings": 256, "dtype": "float32",
}
_GDN = {"head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_conv_kernel_dim": 3}
_SLIDE_FULL = ["sliding_attention", "full_attention"]
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"num_hidden_layers": 2},
    "mistral": {"num_hidden_layers": 2, "sliding_window": WINDOW},
    "ministral": {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": WINDOW,
                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "qwen2": {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    "qwen3": {"num_hidden_layers": 3, "head_dim": 8, "use_sliding_window": True, "sliding_window": WINDOW,
              "max_window_layers": 1},
    "gemma2": {"num_hidden_layers": 3, "head_dim": 16, "sliding_window": WINDOW},
    "gemma3_text": {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": WINDOW, "sliding_window_pattern": 3},
    "cohere2": {"num_hidden_layers": 4, "sliding_window": WINDOW},
    "gpt_oss": {"num_hidden_layers": 2, "head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 2,
                "num_experts_per_tok": 1},
    "gemma3n_text": {"num_hidden_layers": 6, "head_dim": 16, "sliding_window": WINDOW, "num_kv_shared_layers": 2,
                     "layer_types": _SLIDE_FULL * 3, "hidden_size_per_layer_input": 8,
                     "vocab_size_per_layer_input": 128, "laurel_rank": 4, "altup_num_inputs": 2,
                     "activation_sparsity_pattern": [0.0] * 6},
    "gemma4_text": {"num_hidden_layers": 6, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
                    "attention_k_eq_v": True, "sliding_window": WINDOW, "num_kv_shared_layers": 2,
                    "layer_types": _SLIDE_FULL * 3, "hidden_size_per_layer_input": 8,
                    "vocab_size_per_layer_input": 128},
    "llama4_text": {"num_hidden_layers": 4, "head_dim": 16, "attention_chunk_size": WINDOW,
                    "no_rope_layer_interval": 2, "num_local_experts": 2, "intermediate_size_mlp": 64},
    "qwen3_next": {**_GDN, "num_hidden_layers": 4, "num_experts": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "num_experts_per_tok": 1},
    "qwen3_5_text": {**_GDN, "num_hidden_layers": 4, "full_attention_interval": 2},
    "qwen3_5_moe_text": {**_GDN, "num_hidden_layers": 3, "full_attention_interval": 3, "num_experts": 2,
                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts_per_tok": 1},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 3, "attn_layer_offset": 1, "num_experts": 2,
              "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_expand": 2},
    "bamba": {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_n_groups": 2,
              "mamba_d_state": 8},
    "granitemoehybrid": {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4,
                         "mamba_n_groups": 1, "mamba_d_state": 8, "num_local_experts": 2,
                         "shared_intermediate_size": 32},
    "falcon_h1": {"num_hidden_layers": 2, "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                  "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4},
    "nemotron_h": {"hybrid_override_pattern": "M*-EM", "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "n_groups": 2, "ssm_state_size": 8, "conv_kernel": 4, "n_routed_experts": 2,
                   "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16, "num_experts_per_tok": 1},
    "zamba2": {"num_hidden_layers": 4, "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
               "n_mamba_heads": 4, "mamba_ngroups": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "num_mem_blocks": 1},
}
# Multimodal wrappers: their model_spec is their text model's.
WRAPPERS = {"gemma3": "gemma3_text", "gemma3n": "gemma3n_text", "gemma4": "gemma4_text", "llama4": "llama4_text",
            "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def _config(model_type: str) -> Any:
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **ARCHITECTURES[model_type]})


def _run(model_type: str) -> tuple[ModelSpec, Any]:
    config = _config(model_type)
    spec = model_spec_from_config(config.to_dict(), name=model_type)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    input_ids = torch.randint(0, TINY["vocab_size"], (1, PROMPT_TOKENS))
    with torch.no_grad():
        cache = model(input_ids=input_ids, use_cache=True).past_key_values
    return spec, cache


def _check_attention(layer: Any, spec: AttentionSpec, where: str) -> None:
    kept = {SpecKind.FULL: PROMPT_TOKENS,
            SpecKind.SLIDING_WINDOW: min(PROMPT_TOKENS, spec.window_tokens - 1),
            SpecKind.CHUNKED_LOCAL: min(PROMPT_TOKENS, spec.chunk_tokens - 1)}[spec.kind]
    expected = (1, spec.num_kv_heads, kept, spec.head_dim)
    assert tuple(layer.keys.shape) == expected, where
    assert tuple(layer.values.shape) == expected, where
    assert layer.is_sliding == (spec.kind is not SpecKind.FULL), where
    assert str(layer.keys.dtype) == f"torch.{spec.dtype}", where


def _check_state(layer: Any, spec: MambaSpec, where: str) -> None:
    (conv_columns, conv_dim), recurrent = spec.shapes
    # transformers: (batch, channels, conv_kernel); ours: (conv_kernel - 1, channels).
    assert tuple(layer.conv_states[0].shape) == (1, conv_dim, conv_columns + 1), where
    assert str(layer.conv_states[0].dtype) == f"torch.{spec.dtypes[0]}", where
    theirs = tuple(layer.recurrent_states[0].shape)[1:]
    if spec.mamba_type is MambaType.GATED_DELTANET:
        theirs = (theirs[0], theirs[2], theirs[1])  # (heads, k_dim, v_dim) -> (heads, v_dim, k_dim)
    assert theirs == recurrent, where


def _state_of(spec: ModelSpec, layer: int) -> LayerSpec | None:
    own = spec.layers[layer]
    if isinstance(own, MambaSpec):
        return own
    extra = [slot for slot, owner in spec.decoder_layer_of.items() if owner == layer]
    return spec.layers[extra[0]] if extra else None


def test_every_supported_type_is_covered() -> None:
    from tests.plan.test_deepseek_v4_specs_vs_transformers import V4_ARCHITECTURES
    from tests.plan.test_generic_specs_vs_transformers import ARCHITECTURES as GENERIC
    from tests.plan.test_generic_specs_vs_transformers import MLA_TWICE, NOT_BUILT_BY_TRANSFORMERS
    from tests.plan.test_linear_state_specs_vs_transformers import STATE_ARCHITECTURES
    from tests.plan.test_mla_specs_vs_transformers import MLA_ARCHITECTURES, MLA_WRAPPERS, NOT_IN_TRANSFORMERS

    covered = [*ARCHITECTURES, *WRAPPERS, *MLA_ARCHITECTURES, *MLA_WRAPPERS, *NOT_IN_TRANSFORMERS, *V4_ARCHITECTURES,
               *GENERIC, *MLA_TWICE, *NOT_BUILT_BY_TRANSFORMERS, *STATE_ARCHITECTURES,
               "minimax", "recurrent_gemma", "zamba"]
    assert sorted(covered) == supported_model_types()


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_cache_shapes_match_transformers(model_type: str) -> None:
    spec, cache = _run(model_type)
    assert len(cache.layers) == spec.num_decoder_layers
    for i, layer in enumerate(cache.layers):
        where = f"{model_type} layer {i}"
        own, state = spec.layers[i], _state_of(spec, i)
        if own is None or i in spec.kv_shared_from:
            assert type(layer).__name__ == "DummyLayer", where
            continue
        if isinstance(own, AttentionSpec):
            _check_attention(layer, own, where)
        else:
            assert getattr(layer, "keys", None) is None, where
        if state is None:
            assert not hasattr(layer, "conv_states"), where
        else:
            assert isinstance(state, MambaSpec)
            _check_state(layer, state, where)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_wrapper_config_reads_its_text_config(wrapper: str) -> None:
    text = _config(WRAPPERS[wrapper])
    wrapped = transformers.AutoConfig.for_model(wrapper, text_config=text.to_dict()).to_dict()
    assert isinstance(wrapped["text_config"], dict)
    spec = model_spec_from_config(wrapped, name="m")
    expected = model_spec_from_config(text.to_dict(), name="m")
    assert spec.model_type == wrapper
    assert (spec.layers, spec.kv_shared_from, spec.dtype) == (expected.layers, expected.kv_shared_from, expected.dtype)


_DERIVED = sorted(mt for mt, fields in ARCHITECTURES.items() if "layer_types" not in fields)


@pytest.mark.parametrize("model_type", _DERIVED)
def test_layer_kinds_derived_from_pattern_fields_match_transformers(model_type: str) -> None:
    """Hub configs often lack `layer_types`: our derivation from the pattern fields must agree."""
    saved = _config(model_type).to_dict()
    # to_dict() drops some pattern fields it consumed (full_attention_interval); hub files keep them.
    derived = {key: value for key, value in saved.items() if key not in ("layer_types", "no_rope_layers")}
    derived |= ARCHITECTURES[model_type]
    assert model_spec_from_config(derived, name="m").layers == model_spec_from_config(saved, name="m").layers


def test_gemma4_hub_form_matches_transformers_per_layer_config() -> None:
    """Hub config.json files carry global_head_dim / num_global_key_value_heads, not per_layer_config."""
    saved = _config("gemma4_text").to_dict()
    assert "per_layer_config" in saved
    hub = {key: value for key, value in saved.items() if key != "per_layer_config"}
    fields = ARCHITECTURES["gemma4_text"]
    hub |= {"global_head_dim": fields["global_head_dim"], "num_global_key_value_heads": 1}
    assert model_spec_from_config(hub, name="m").layers == model_spec_from_config(saved, name="m").layers


_GEMMA3N_DEFAULTED = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "sliding_window", "num_kv_shared_layers", "max_position_embeddings", "layer_types")


@pytest.mark.parametrize("missing", ["all", *_GEMMA3N_DEFAULTED])
def test_gemma3n_missing_fields_mean_transformers_defaults(missing: str) -> None:
    """A gemma3n config.json that omits a field means Gemma3nTextConfig's default for it."""
    full = {"model_type": "gemma3n_text", "num_hidden_layers": 20, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 64, "sliding_window": 128, "num_kv_shared_layers": 5, "max_position_embeddings": 4096,
            "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 4}
    dropped = {"all": _GEMMA3N_DEFAULTED, "num_hidden_layers": ("num_hidden_layers", "layer_types")}.get(
        missing, (missing,))
    config = {key: value for key, value in full.items() if key not in dropped}
    reference = transformers.Gemma3nTextConfig(**{key: value for key, value in config.items() if key != "model_type"})
    spec = model_spec_from_config(config, name="g3n")
    assert spec.num_decoder_layers == reference.num_hidden_layers
    assert spec.max_position_embeddings == reference.max_position_embeddings
    first_shared = reference.num_hidden_layers - reference.num_kv_shared_layers
    assert sorted(spec.kv_shared_from) == list(range(first_shared, reference.num_hidden_layers))
    for i, (layer, layer_type) in enumerate(zip(spec.layers, reference.layer_types, strict=True)):
        assert isinstance(layer, AttentionSpec), i
        assert layer.kind is (SpecKind.SLIDING_WINDOW if layer_type == "sliding_attention" else SpecKind.FULL), i
        assert (layer.num_kv_heads, layer.head_dim) == (reference.num_key_value_heads, reference.head_dim), i
        if layer.kind is SpecKind.SLIDING_WINDOW:
            assert layer.window_tokens == reference.sliding_window, i
