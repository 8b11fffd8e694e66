"""MLA and sparse-attention specs against the caches transformers 5.23 really allocates.

transformers caches an MLA layer as its latent: `keys` (1, 1, T, kv_lora_rank) and `values`
(1, 1, T, qk_rope_head_dim), so one token is `kv_lora_rank + qk_rope_head_dim` values of one head,
our `MLASpec.head_dim`. DSA layers that own an indexer add `indexer_keys` (1, T, index_head_dim);
MiniMax-M3 sparse layers add `idx_keys` (1, 1, T, index_head_dim) next to their GQA K/V. Our indexer
spec must sit on exactly those layers; its entry is the head dim (bf16) or, for DSA, the head dim
plus 4 bytes of fp32 scale per 128 fp8 values (vLLM's packed format; 0 extra below 128).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.specs import AttentionSpec, IndexerSpec, MLASpec, ModelSpec  # noqa: E402

T = 10
TINY: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "vocab_size": 128,
                        "max_position_embeddings": 256, "dtype": "float32", "bos_token_id": 0, "eos_token_id": 1}
_MLA = {"kv_lora_rank": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "num_key_value_heads": 4, "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 16,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
_DSA = {**_MLA, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4}
MLA_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deepseek_v2": {**_MLA, "num_hidden_layers": 2, "n_shared_experts": 1},
    "deepseek_v3": {**_MLA, "num_hidden_layers": 2},
    "deepseek_v32": {**_DSA, "num_hidden_layers": 3},
    "glm_moe_dsa": {**_DSA, "num_hidden_layers": 4, "index_topk_freq": 2},
    "hy_v4": {**_DSA, "num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"], "hc_mult": 2,
              "pad_token_id": 0},
    "glm4_moe_lite": {**_MLA, "num_hidden_layers": 2},
    "axk1": {**_MLA, "num_hidden_layers": 2},
    "minicpm3": {**_MLA, "num_hidden_layers": 2},
    "minimax_m3_vl_text": {"num_hidden_layers": 3, "head_dim": 16, "num_key_value_heads": 2, "index_head_dim": 16,
                           "index_n_heads": 2, "index_block_size": 4, "index_topk_blocks": 2, "rotary_dim": 8,
                           "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
                           "num_local_experts": 2, "num_experts_per_tok": 1, "dense_intermediate_size": 32,
                           "shared_intermediate_size": 16},
}
MLA_WRAPPERS = {"minimax_m3_vl": "minimax_m3_vl_text"}
# model types transformers 5.23 does not know, read like the one named (Kimi-K2 is DeepSeek-V3).
NOT_IN_TRANSFORMERS = {"kimi_k2": "deepseek_v3"}


def _config(model_type: str) -> Any:
    return transformers.AutoConfig.for_model(model_type, **{**TINY, **MLA_ARCHITECTURES[model_type]})


def _cache(config: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        return model(input_ids=torch.randint(0, TINY["vocab_size"], (1, T)), use_cache=True).past_key_values


def _indexer_of(spec: ModelSpec, layer: int) -> IndexerSpec | None:
    slots = [slot for slot, owner in spec.decoder_layer_of.items() if owner == layer]
    found = spec.layers[slots[0]] if slots else None
    assert found is None or isinstance(found, IndexerSpec)
    return found


@pytest.mark.parametrize("model_type", sorted(MLA_ARCHITECTURES))
def test_cache_shapes_match_transformers(model_type: str) -> None:
    config = _config(model_type)
    spec = model_spec_from_config(config.to_dict(), name=model_type)
    cache = _cache(config)
    assert len(cache.layers) == spec.num_decoder_layers
    for i, layer in enumerate(cache.layers):
        where, own, indexer = f"{model_type} layer {i}", spec.layers[i], _indexer_of(spec, i)
        if isinstance(own, MLASpec):
            assert layer.keys.shape[:3] == (1, 1, T) and layer.values.shape[:3] == (1, 1, T), where
            assert layer.keys.shape[-1] + layer.values.shape[-1] == own.head_dim, where
            assert layer.keys.shape[-1] == own.kv_lora_rank, where
        else:
            assert isinstance(own, AttentionSpec), where
            assert tuple(layer.keys.shape) == (1, own.num_kv_heads, T, own.head_dim), where
        theirs = getattr(layer, "indexer_keys", None)
        if theirs is None:
            theirs = getattr(layer, "idx_keys", None)
        assert (theirs is None) == (indexer is None), where
        if theirs is not None and indexer is not None:
            assert theirs.shape[-2:] == (T, indexer.entry_size), where


def test_glm_indexer_types_are_what_transformers_derives() -> None:
    config = _config("glm_moe_dsa")
    spec = model_spec_from_config(config.to_dict(), name="glm")
    owners = sorted(spec.decoder_layer_of.values())
    assert owners == [i for i, kind in enumerate(config.indexer_types) if kind == "full"] == [0, 1, 3]
    hub = {k: v for k, v in config.to_dict().items() if k != "indexer_types"} | {"index_topk_freq": 2}
    assert model_spec_from_config(hub, name="glm").layers == spec.layers


def test_minimax_wrapper_and_hub_form_read_like_transformers() -> None:
    text = _config("minimax_m3_vl_text")
    wrapped = transformers.AutoConfig.for_model("minimax_m3_vl", text_config=text.to_dict()).to_dict()
    expected = model_spec_from_config(text.to_dict(), name="m")
    assert model_spec_from_config(wrapped, name="m").layers == expected.layers
    hub = {k: v for k, v in text.to_dict().items() if k not in ("layer_types", "index_head_dim")}
    hub["sparse_attention_config"] = {"sparse_index_dim": 16, "sparse_attention_freq": [0, 1, 1]}
    assert model_spec_from_config(hub, name="m").layers == expected.layers
    legacy = transformers.AutoConfig.for_model("minimax_m3_vl_text", **{**TINY, **{
        k: v for k, v in MLA_ARCHITECTURES["minimax_m3_vl_text"].items() if k != "layer_types"}},
        sparse_attention_config=hub["sparse_attention_config"])
    assert legacy.layer_types == text.layer_types  # transformers reads the Hub form the same way


def test_kimi_k2_reads_like_deepseek_v3() -> None:
    fields = {**TINY, **MLA_ARCHITECTURES["deepseek_v3"]}
    kimi = model_spec_from_config({"model_type": "kimi_k2", **fields}, name="k")
    assert kimi.layers == model_spec_from_config({"model_type": "deepseek_v3", **fields}, name="k").layers
