"""DeepSeek-V4: five caches per compressed layer, five KV cache groups in one packed buffer, by hand.

Facts (vLLM 0.32, fp8_ds_mla layout of its default FlashMLA backend): every page is padded to a
multiple of 576 B. Window latents: block 64, 584 B rows (64 x 584 = 37,376 -> 37,440). Compressed
latents: block 256, one 584 B row per `ratio` tokens (ratio 4: 64 rows -> 37,440; ratio 128: 2 rows
= 1,168 -> 1,728). Compressor state: fp32 kv + score over head_dim 512, doubled with overlap on
ratio 4 (8,192 B per row, block 4: 32,768 -> 32,832; ratio 128: 4,096 B, block 8 -> 32,832).
Indexer keys: 132 B per 4 tokens, block 256 (8,448 -> 8,640); indexer compressor: 2 x 2 x 128 fp32
= 2,048 B, block 4 (8,192 -> 8,640). The groups and their order were checked against vLLM 0.32's
`get_kv_cache_groups` on the same specs (block-outermost layout).
"""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.catalog import find
from hybridkv.errors import ConfigError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager, MambaCacheMode, PrefixCaching
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.model_specs import KVCacheDType, SpecOptions, model_spec_from_config
from hybridkv.plan.packed_layout import approximate_gcd
from hybridkv.plan.planner import GIB, PageLayout, PlannerOptions, plan
from hybridkv.plan.specs import CompressedMLASpec, LatentRole, ModelSpec

SWA = C4 = 37_440
C128 = 1_728
STATE = 32_832
INDEXER = INDEXER_STATE = 8_640


def tiny(ratios: list[int], **extra: Any) -> dict[str, Any]:
    return {"model_type": "deepseek_v4", "num_hidden_layers": len(ratios), "head_dim": 512, "qk_rope_head_dim": 64,
            "sliding_window": 128, "index_head_dim": 128, "max_position_embeddings": 65536,
            "compress_ratios": ratios, **extra}


def spec_of(config: dict[str, Any], **options: Any) -> ModelSpec:
    return model_spec_from_config(config, name="tiny-v4", options=SpecOptions(**options))


def roles(spec: ModelSpec, layer: int) -> list[tuple[str, int]]:
    """(role, page bytes) of every cache of decoder layer `layer`, window first."""
    slots = [layer] + [s for s, d in spec.decoder_layer_of.items() if d == layer]
    out = []
    for slot in slots:
        cache = spec.layers[slot]
        assert isinstance(cache, CompressedMLASpec)
        out.append((cache.role.value, cache.page_size_bytes(cache.block_size)))
    return out


def test_page_bytes_of_each_cache_by_hand() -> None:
    spec = spec_of(tiny([0, 4, 128, 1]))
    assert roles(spec, 0) == roles(spec, 3) == [("swa", SWA)]
    assert roles(spec, 1) == [("swa", SWA), ("indexer", INDEXER), ("indexer-compressor", INDEXER_STATE),
                              ("compressed", C4), ("compressor", STATE)]
    assert roles(spec, 2) == [("swa", SWA), ("compressed", C128), ("compressor", STATE)]
    state4 = spec.layers[spec.num_decoder_layers + 3]
    assert isinstance(state4, CompressedMLASpec) and state4.role is LatentRole.COMPRESSOR
    assert (state4.block_size, state4.window_tokens, state4.entry_bytes) == (4, 8, 2 * 2 * 512 * 4)
    state128 = spec.layers[-1]
    assert isinstance(state128, CompressedMLASpec)
    assert (state128.block_size, state128.window_tokens, state128.entry_bytes) == (8, 128, 2 * 512 * 4)


def test_approximate_gcd_pads_least() -> None:
    # DeepSeek-V4-Flash: window 43 layers, ratio-4 states 21 (2 page sizes: the floor), ratio-128 states 20.
    # d = 21 pads 20 + 0 + 1 = 21; d = 22 pads 1 + 1 + 2 = 4; d = 23 pads 3 + 2 + 3 = 8; ... -> 22
    assert approximate_gcd([43, 21, 20], lower_bound=21) == 22
    assert approximate_gcd([4, 2, 1], lower_bound=2) == 2  # pads 0 + 0 + 1
    assert approximate_gcd([6, 6], lower_bound=1) == 6  # ties prefer the larger d
    assert approximate_gcd([3], lower_bound=5) == 5


def test_tiny_config_groups_as_vllm() -> None:
    spec = spec_of(tiny([0, 4, 128, 4]))
    result = plan(spec, PlannerOptions(memory_bytes=GIB, max_model_len=4096, max_num_batched_tokens=256))
    cfg = result.config
    assert cfg.page_layout is PageLayout.PACKED_BLOCKS and cfg.group_size == 1
    groups = [(g.kind.value, g.block_size, [(spec.decoder_layer_of.get(s, s), p) for s, p in
                                             zip(g.layer_indices, g.layer_page_bytes(), strict=True)])
              for g in cfg.groups]
    assert groups == [
        ("sliding_window", 64, [(0, SWA), (2, SWA)]),
        ("sliding_window", 64, [(1, SWA), (3, SWA)]),
        ("full", 256, [(1, INDEXER), (1, C4), (2, C128), (3, INDEXER), (3, C4)]),
        ("sliding_window", 4, [(1, INDEXER_STATE), (1, STATE), (3, INDEXER_STATE), (3, STATE)]),
        ("sliding_window", 8, [(2, STATE)]),
    ]
    stride = 2 * INDEXER + 2 * C4 + C128  # 93,888: the largest group's block
    assert cfg.page_size_bytes == stride and cfg.num_blocks == GIB // stride
    assert [t.size_bytes for t in cfg.tensors] == [cfg.num_blocks * stride]
    # window 128, 256 tokens in flight: ceil(383 / 64) + 1 = 7; ceil(4096 / 256) = 16;
    # ratio-4 state (window 8, block 4): ceil(263 / 4) + 1 = 67; ratio 128 (block 8): ceil(383 / 8) + 1 = 49
    assert result.blocks_per_request == (7, 7, 16, 67, 49)
    assert result.max_concurrency == pytest.approx((cfg.num_blocks - 1) / (7 + 7 + 16 + 67 + 49))
    assert result.recommended_chunk_size == 256 and not result.uniform.runnable


def test_flash_catalog_five_groups_by_hand() -> None:
    spec = model_spec_from_config(find("deepseek-v4-flash").config, name="flash")
    assert spec.num_decoder_layers == 43 and spec.max_position_embeddings == 1_048_576
    result = plan(spec, PlannerOptions(memory_bytes=16 * GIB, max_model_len=32768))
    cfg = result.config
    decoder = [sorted({spec.decoder_layer_of.get(s, s) for s in g.layer_indices}) for g in cfg.groups]
    even, odd = list(range(2, 43, 2)), list(range(3, 43, 2))
    assert decoder == [[0, *even], [1, *odd], sorted(even + odd), even, odd]
    assert [g.block_size for g in cfg.groups] == [64, 64, 256, 4, 8]
    totals = [sum(g.layer_page_bytes()) for g in cfg.groups]
    assert totals == [22 * SWA, 21 * SWA, 21 * INDEXER + 21 * C4 + 20 * C128, 21 * INDEXER_STATE + 21 * STATE,
                      20 * STATE]
    assert totals == [823_680, 786_240, 1_002_240, 870_912, 656_640]
    assert cfg.page_size_bytes == 1_002_240 and cfg.num_blocks == 16 * GIB // 1_002_240 == 17_141
    # ceil(2175 / 64) + 1 = 35 twice; 32768 / 256 = 128; ceil(2055 / 4) + 1 = 515; ceil(2175 / 8) + 1 = 273
    assert result.blocks_per_request == (35, 35, 128, 515, 273)
    assert round(result.max_concurrency, 2) == 17.38  # vLLM: 17141 / 986 = 17.38 too


def test_fp8_choices_and_bad_ratios() -> None:
    base = spec_of(tiny([0, 4]))
    assert spec_of(tiny([0, 4]), kv_cache_dtype=KVCacheDType.FP8).layers == base.layers
    assert spec_of(tiny([0, 4]), kv_cache_dtype=KVCacheDType.FP8_DS_MLA).layers == base.layers
    with pytest.raises(ConfigError, match="'nvfp4_ds_mla' is not a DeepSeek-V4 cache format"):
        spec_of(tiny([0, 4]), kv_cache_dtype=KVCacheDType.NVFP4_DS_MLA)
    with pytest.raises(ConfigError, match=r"compress_ratios.*each 0 or 1 \(window only\), 4 or 128, got \[0, 8\]"):
        spec_of(tiny([0, 8]))
    with pytest.raises(ConfigError, match="at least 3 integers"):
        spec_of(tiny([0, 4]) | {"num_hidden_layers": 3})
    with pytest.raises(ConfigError, match=r"needs 'compress_ratios' .* or 'layer_types'; got neither"):
        spec_of({k: v for k, v in tiny([0, 4]).items() if k != "compress_ratios"})
    with pytest.raises(ConfigError, match="'layer_types' must list 2 entries"):
        spec_of(tiny([0, 4]) | {"layer_types": ["sliding_attention", "full_attention"]})


def test_manager_serves_the_packed_groups_by_their_kind() -> None:
    spec = spec_of(tiny([0, 4, 128, 4]))
    cfg = plan(spec, PlannerOptions(memory_bytes=GIB, max_model_len=4096)).config
    manager = KVCacheManager(cfg, max_model_len=4096,
        options=CacheOptions(prefix_caching=PrefixCaching.ON, mamba_cache_mode=MambaCacheMode.ALIGN))
    manager.begin_step()
    request = KVRequest(request_id=RequestId("a"), token_ids=list(range(1000)))
    assert manager.allocate(request, 1000, hit=manager.lookup(request)) is not None
    # ceil(1000 / 64) = 16 twice, ceil(1000 / 256) = 4, ceil(1000 / 4) = 250, ceil(1000 / 8) = 125
    assert [len(t) for t in manager.block_ids(request.request_id)] == [16, 16, 4, 250, 125]
    request.num_computed_tokens = 1000
    manager.free(request)
    manager.check_integrity()
    manager.begin_step()
    again = KVRequest(request_id=RequestId("b"), token_ids=[*range(1000), 7])
    assert manager.lookup(again).num_tokens == 768  # whole 256-token blocks (the lcm of 64, 256, 4, 8)
