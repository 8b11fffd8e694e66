"""MLA, DSA indexer and MiniMax-M3 caches: page bytes, groups and block sizes computed by hand.

Facts (vLLM 0.32): an MLA latent is kv_lora_rank + qk_rope_head_dim values (576 for DeepSeek-V3:
1152 B in bf16, 576 in fp8, 656 in fp8_ds_mla, 352 in nvfp4_ds_mla); the DSA indexer stores
index_head_dim + index_head_dim // 128 * 4 bytes (132); MiniMax-M3's indexer sparse_index_dim bf16
values (256 B). Layers of one attention type form one group whose block is the sum of every
layer's page; sparse MLA forces block 64, MiniMax-M3 128.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridkv.catalog import find
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import KVCacheDType, SpecOptions, model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, build_kv_cache_config, plan
from hybridkv.plan.specs import IndexerSpec, MLAFormat, MLASpec, ModelSpec, SpecKind

MLA_BF16, MLA_FP8_DS, INDEXER = 576 * 2, 656, 128 + 4


def tiny(model_type: str = "deepseek_v32", *, layers: int = 4, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type, "num_hidden_layers": layers, "kv_lora_rank": 512,
                              "qk_rope_head_dim": 64, "max_position_embeddings": 8192, "dtype": "bfloat16"}
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        config |= {"index_head_dim": 128, "index_n_heads": 4, "index_topk": 16}
    return config | extra


def spec_of(config: dict[str, Any], **options: Any) -> ModelSpec:
    return model_spec_from_config(config, name="tiny", options=SpecOptions(**options))


def indexer_owners(spec: ModelSpec) -> list[int]:
    return sorted(spec.decoder_layer_of.values())


def test_mla_bytes_by_hand() -> None:
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16")
    assert mla.bytes_per_token == 1152 and mla.page_size_bytes(64) == 64 * 1152
    assert MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="fp8").bytes_per_token == 576
    packed = {f: MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", cache_format=f).bytes_per_token
              for f in (MLAFormat.FP8_DS_MLA, MLAFormat.NVFP4_DS_MLA)}
    assert packed == {MLAFormat.FP8_DS_MLA: 512 + 4 * 4 + 64 * 2, MLAFormat.NVFP4_DS_MLA: 352}
    assert IndexerSpec(entry_size=132, dtype="uint8").page_size_bytes(64) == 64 * 132
    with pytest.raises(ConfigError, match=r"fp8_ds_mla MLA format stores kv_lora_rank 512 \+ qk_rope_head_dim 64"):
        MLASpec(kv_lora_rank=256, qk_rope_head_dim=64, dtype="bfloat16", cache_format=MLAFormat.FP8_DS_MLA)


def test_dense_mla_is_one_group_of_identical_pages_and_ignores_tp() -> None:
    spec = spec_of(tiny("deepseek_v3", layers=3), tp_size=8)
    assert spec.layers == (MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16"),) * 3
    assert spec.kernel_block_size is None and not spec.decoder_layer_of
    config = build_kv_cache_config(spec, PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert [g.layer_indices for g in config.groups] == [(0, 1, 2)] and config.groups[0].block_size == 16
    assert config.page_size_bytes == 16 * MLA_BF16 and config.group_size == 3 and not config.groups[0].mixed_pages
    assert spec_of(tiny("kimi_k2", layers=1), kv_cache_dtype=KVCacheDType.FP8).layers[0] == MLASpec(
        kv_lora_rank=512, qk_rope_head_dim=64, dtype="fp8")


def test_sparse_mla_one_group_of_mixed_pages_block_64() -> None:
    spec = spec_of(tiny())
    assert indexer_owners(spec) == [0, 1, 2, 3] and spec.kernel_block_size == 64
    options = PlannerOptions(memory_bytes=GIB, max_model_len=4096)
    result = plan(spec, options)
    config = result.config
    (group,) = config.groups
    assert group.layer_indices == (0, 1, 2, 3, 4, 5, 6, 7) and group.block_size == 64 and group.kind is SpecKind.FULL
    assert group.layer_page_bytes() == (64 * MLA_BF16,) * 4 + (64 * INDEXER,) * 4
    block = 4 * 64 * (MLA_BF16 + INDEXER)  # 328,704 bytes: nothing padded
    assert config.page_size_bytes == block and config.group_size == 1 and config.bytes_per_block == block
    assert config.num_blocks == GIB // block
    assert [t.size_bytes for t in config.tensors] == [config.num_blocks * p for p in group.layer_page_bytes()]
    assert [t.shared_by for t in config.tensors] == [(i,) for i in range(8)]
    assert result.blocks_per_request == (4096 // 64,)
    assert result.max_concurrency == pytest.approx((config.num_blocks - 1) / 64)
    assert "Setting kv cache block size to 64 for the FLASHMLA_SPARSE backend" in config.block_size_note
    assert result.recommended_chunk_size == 256 and result.uniform.max_concurrency == result.max_concurrency


def test_fp8_maps_to_fp8_ds_mla_on_sparse_models_only() -> None:
    sparse = spec_of(tiny(), kv_cache_dtype=KVCacheDType.FP8)
    assert sparse.layers[0] == MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16",
                                       cache_format=MLAFormat.FP8_DS_MLA)
    assert sparse.layers[4] == IndexerSpec(entry_size=132, dtype="uint8")  # the indexer format never changes
    config = build_kv_cache_config(sparse, PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert config.page_size_bytes == 4 * 64 * (MLA_FP8_DS + INDEXER)
    nvfp4 = spec_of(tiny(), kv_cache_dtype=KVCacheDType.NVFP4_DS_MLA)
    assert nvfp4.layers[0].page_size_bytes(64) == 64 * 352  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"'fp8_ds_mla' is a sparse-MLA cache format.*'deepseek_v3'"):
        spec_of(tiny("deepseek_v3"), kv_cache_dtype=KVCacheDType.FP8_DS_MLA)
    with pytest.raises(ConfigError, match=r"'nvfp4_ds_mla' is a sparse-MLA cache format.*'llama'"):
        spec_of({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 8,
                 "max_position_embeddings": 64}, kv_cache_dtype=KVCacheDType.NVFP4_DS_MLA)


@pytest.mark.parametrize(("extra", "owners"), [
    ({}, [0, 1, 2, 3, 4, 5, 6, 7]),
    # skip = max(i - 2 + 1, 0) % 2 != 0: i=0,1 -> 0; i=2 -> 1 (skip); i=3 -> 2; i=4 -> 3 (skip) ...
    ({"index_topk_freq": 2}, [0, 1, 3, 5, 7]),
    # offset 3, freq 4 (GLM-5.2): max(i - 2, 0) % 4 == 0 -> 0, 1, 2, 6
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, [0, 1, 2, 6]),
    ({"index_topk_pattern": "FSSFFSSS"}, [0, 3, 4]),
    ({"index_topk_freq": 2, "index_topk_pattern": "FFFFFFFS"}, [0, 1, 2, 3, 4, 5, 6]),
    ({"indexer_types": ["full", "shared"] * 4, "index_topk_pattern": "FFFFFFFF"}, [0, 2, 4, 6]),
])
def test_indexer_layer_selection(extra: dict[str, Any], owners: list[int]) -> None:
    spec = spec_of(tiny("glm_moe_dsa", layers=8, **extra))
    assert indexer_owners(spec) == owners
    assert list(spec.decoder_layer_of) == list(range(8, 8 + len(owners)))
    config = build_kv_cache_config(spec, PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert config.page_size_bytes == 64 * (8 * MLA_BF16 + len(owners) * INDEXER)


@pytest.mark.parametrize(("extra", "message"), [
    ({"index_topk_pattern": "FSF"}, r"'index_topk_pattern' must be a string of 8 letters"),
    ({"index_topk_pattern": "FSFSFSFX"}, r"'index_topk_pattern' must be a string of 8 letters"),
    ({"indexer_types": ["full"] * 7 + ["none"]}, r"'indexer_types' must list 8 entries 'full' or 'shared'"),
    ({"index_topk_freq": 0}, r"'index_topk_freq' must be a positive integer, got 0"),
    ({"index_head_dim": None}, r"required field 'index_head_dim' is missing"),
])
def test_bad_indexer_configs(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_of(tiny("glm_moe_dsa", layers=8, **extra))


def minimax(**sparse: Any) -> dict[str, Any]:
    return {"model_type": "minimax_m3_vl", "dtype": "bfloat16", "text_config": {
        "model_type": "minimax_m3_vl_text", "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
        "sparse_attention_config": {"sparse_index_dim": 128, "sparse_attention_freq": [0, 1, 1, 1]} | sparse}}


def test_minimax_m3_gqa_plus_indexer_one_group_block_128() -> None:
    spec = spec_of(minimax())
    assert indexer_owners(spec) == [1, 2, 3] and spec.kernel_block_size == 128
    config = build_kv_cache_config(spec, PlannerOptions(memory_bytes=GIB, max_model_len=4096, block_size=32))
    (group,) = config.groups
    gqa, index = 2 * 4 * 128 * 2, 128 * 2  # K+V of 4 heads x 128 in bf16; 128 bf16 index values
    assert group.block_size == 128 and group.layer_page_bytes() == (128 * gqa,) * 4 + (128 * index,) * 3
    assert config.page_size_bytes == 128 * (4 * gqa + 3 * index)
    assert "to 128 for the MINIMAX_M3_SPARSE backend (asked for 32" in config.block_size_note
    # fp8 K/V halves the GQA pages; the indexer stays bf16. TP 2 splits the 4 KV heads, not the indexer.
    fp8 = build_kv_cache_config(spec_of(minimax(), kv_cache_dtype=KVCacheDType.FP8, tp_size=2),
                                PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert fp8.groups[0].layer_page_bytes() == (128 * 2 * 2 * 128,) * 4 + (128 * index,) * 3
    dense = spec_of(minimax(sparse_attention_freq=[0, 0, 0, 0]))
    assert dense.kernel_block_size is None and not dense.decoder_layer_of
    saved_form = minimax()
    saved_form["text_config"] = {k: v for k, v in saved_form["text_config"].items() if k != "sparse_attention_config"}
    saved_form["text_config"]["layer_types"] = ["full_attention", "minimax_m3_sparse", "full_attention",
                                                "minimax_m3_sparse"]
    assert indexer_owners(spec_of(saved_form)) == [1, 3]


def test_mla_pages_are_never_padded_to_a_foreign_page() -> None:
    mla = MLASpec(kv_lora_rank=512, qk_rope_head_dim=64, dtype="bfloat16", kind=SpecKind.SLIDING_WINDOW,
                  window_tokens=128)
    odd = MLASpec(kv_lora_rank=500, qk_rope_head_dim=64, dtype="bfloat16")  # 1128 B: does not divide 16 * 1152
    model = ModelSpec(name="m", model_type="toy", dtype="bfloat16", layers=(mla, odd), kv_shared_from={},
                      max_position_embeddings=4096)
    with pytest.raises(ConfigError, match=r"an MLA layer has 1128 bytes per token, which does not divide it"):
        build_kv_cache_config(model, PlannerOptions(memory_bytes=GIB, max_model_len=4096))


def catalog_plan(name: str, **options: Any) -> tuple[ModelSpec, Any]:
    entry = find(name)
    assert entry is not None
    spec = model_spec_from_config(entry.config, name=entry.hf_id, options=SpecOptions(**options))
    return spec, plan(spec, PlannerOptions(memory_bytes=16 * GIB, max_model_len=32768))


@pytest.mark.parametrize(("name", "options", "layers", "owners", "block", "mla_bytes", "index_bytes"), [
    ("deepseek-v3", {}, 61, 0, 16, MLA_BF16, 0),
    ("deepseek-v3", {"kv_cache_dtype": KVCacheDType.FP8}, 61, 0, 16, 576, 0),
    ("kimi-k2", {}, 61, 0, 16, MLA_BF16, 0),
    ("deepseek-v3.2", {}, 61, 61, 64, MLA_BF16, INDEXER),
    ("deepseek-v3.2", {"kv_cache_dtype": KVCacheDType.FP8}, 61, 61, 64, MLA_FP8_DS, INDEXER),
    ("glm-5", {}, 78, 78, 64, MLA_BF16, INDEXER),
    ("glm-5", {"kv_cache_dtype": KVCacheDType.FP8}, 78, 78, 64, MLA_FP8_DS, INDEXER),
])
def test_catalog_mla_models_by_hand(name: str, options: dict[str, Any], layers: int, owners: int, block: int,
                                    mla_bytes: int, index_bytes: int) -> None:
    spec, result = catalog_plan(name, **options)
    config = result.config
    assert spec.num_decoder_layers == layers and len(spec.decoder_layer_of) == owners
    (group,) = config.groups
    assert group.block_size == block and len(group.layer_indices) == layers + owners
    block_bytes = block * (layers * mla_bytes + owners * index_bytes)
    assert sum(group.layer_page_bytes()) == block_bytes
    num_blocks = 16 * GIB // block_bytes
    assert config.num_blocks == num_blocks and config.bytes_per_block == block_bytes
    assert result.max_concurrency == pytest.approx((num_blocks - 1) / math.ceil(32768 / block))
    assert result.recommended_chunk_size == 256


def test_catalog_minimax_m3_by_hand() -> None:
    spec, result = catalog_plan("minimax-m3")
    (group,) = result.config.groups
    assert spec.num_decoder_layers == 60 and indexer_owners(spec) == list(range(3, 60))
    block = 128 * (60 * 2 * 4 * 128 * 2 + 57 * 128 * 2)  # 17,596,416 bytes
    assert group.block_size == 128 and result.config.page_size_bytes == block
    assert result.config.num_blocks == 16 * GIB // block
    assert result.max_concurrency == pytest.approx((16 * GIB // block - 1) / 256)
