"""DeepSeek-V4 specs against the caches transformers 5.23 really keeps for a tiny model.

transformers keeps per layer a sliding window of `sliding_window - 1` shared K=V latents
(`DynamicSlidingWindowLayer`), and on compressed layers the compressed entries, one per
`compress_rate` tokens (`DeepseekV4HCACache`, ratio 128), plus on ratio-4 layers the compressed
indexer keys and an overlapping (two-series) compressor (`DeepseekV4CSACache`). Our specs must put
the same caches on the same layers with the same window, tokens per state and widths.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.specs import CompressedMLASpec, LatentRole, ModelSpec  # noqa: E402

T = 136  # 34 ratio-4 entries, 1 ratio-128 entry
HEAD_DIM, INDEX_DIM, WINDOW = 32, 16, 8
V4_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "deepseek_v4": {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 128,
                    "head_dim": HEAD_DIM, "q_lora_rank": 16, "o_lora_rank": 16, "o_groups": 2, "n_routed_experts": 2,
                    "num_experts_per_tok": 1, "moe_intermediate_size": 16, "index_n_heads": 2,
                    "index_head_dim": INDEX_DIM, "index_topk": 4, "sliding_window": WINDOW,
                    "compress_ratios": [0, 4, 128, 4], "max_position_embeddings": 256, "dtype": "float32",
                    "hc_mult": 2, "num_hash_layers": 0},
}


def _caches(spec: ModelSpec, layer: int) -> dict[LatentRole, CompressedMLASpec]:
    slots = [layer] + [s for s, owner in spec.decoder_layer_of.items() if owner == layer]
    found = {}
    for slot in slots:
        cache = spec.layers[slot]
        assert isinstance(cache, CompressedMLASpec)
        found[cache.role] = cache
    return found


def test_cache_layers_match_transformers() -> None:
    config = transformers.AutoConfig.for_model("deepseek_v4", **V4_ARCHITECTURES["deepseek_v4"])
    spec = model_spec_from_config(config.to_dict(), name="tiny-v4")  # the saved form: layer_types
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 128, (1, T)), use_cache=True).past_key_values
    assert len(cache.layers) == spec.num_decoder_layers == 4
    for i, layer in enumerate(cache.layers):
        ours, where = _caches(spec, i), f"layer {i} ({type(layer).__name__})"
        window = ours[LatentRole.WINDOW]
        assert window.window_tokens == layer.sliding_window == WINDOW, where
        assert layer.keys.shape[-2:] == (WINDOW - 1, HEAD_DIM), where  # W - 1 earlier latents stay cached
        entries = getattr(layer, "compressed_kv", {})
        if not entries:
            assert set(ours) == {LatentRole.WINDOW}, where
            continue
        compressed, compressor = ours[LatentRole.COMPRESSED], ours[LatentRole.COMPRESSOR]
        assert compressed.tokens_per_state == layer.compress_rate, where
        assert entries["compressor"].shape[1:] == (T // layer.compress_rate, HEAD_DIM), where
        overlap = hasattr(layer, "overlap_kv")  # the two-series (Ca, Cb) compressor of ratio-4 layers
        assert compressor.entry_bytes == 2 * (2 if overlap else 1) * HEAD_DIM * 4, where
        if "indexer" not in entries:
            assert set(ours) == {LatentRole.WINDOW, LatentRole.COMPRESSED, LatentRole.COMPRESSOR}, where
            continue
        indexer = ours[LatentRole.INDEXER]
        assert entries["indexer"].shape[1:] == (T // indexer.tokens_per_state, INDEX_DIM), where
        assert indexer.entry_bytes == INDEX_DIM  # fp8 values + 4 B of scale per 128 (none below 128)
        assert ours[LatentRole.INDEXER_COMPRESSOR].entry_bytes == 2 * 2 * INDEX_DIM * 4, where


def test_hub_form_reads_like_the_saved_form() -> None:
    fields = V4_ARCHITECTURES["deepseek_v4"]
    saved = transformers.AutoConfig.for_model("deepseek_v4", **fields).to_dict()
    hub = {"model_type": "deepseek_v4", **fields, "compress_ratios": [*fields["compress_ratios"], 0]}  # + MTP entry
    assert model_spec_from_config(hub, name="v4").layers == model_spec_from_config(saved, name="v4").layers
