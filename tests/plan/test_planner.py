"""Planner vectors computed by hand (docs/design.md §3)."""

from __future__ import annotations

import math

import pytest

from hybridkv.errors import CapacityError, ConfigError
from hybridkv.plan.planner import (
    GIB,
    KVCacheGroupSpec,
    PlannerOptions,
    build_kv_cache_config,
    group_layers,
    mamba_block_size,
    plan,
)
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MambaType, ModelSpec, SpecKind


def make_attention(*, kind: str = "full", kv_heads: int = 16, head_dim: int = 128, dtype: str = "bfloat16",
                   window_tokens: int = 0, chunk_tokens: int = 0) -> AttentionSpec:
    return AttentionSpec(kind=SpecKind(kind), num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         window_tokens=window_tokens, chunk_tokens=chunk_tokens)


def make_model(*, layers: list[LayerSpec | None], shared: dict[int, int] | None = None,
               name: str = "toy") -> ModelSpec:
    return ModelSpec(name=name, model_type="toy", dtype="bfloat16", layers=tuple(layers),
                     kv_shared_from=shared or {}, max_position_embeddings=131072)


def pattern(text: str, *, window_tokens: int = 1024) -> list[LayerSpec | None]:
    """'F' = full, 'S' = sliding window, 'C' = chunked local (8192), 'M' = a Qwen3-Next-like GDN state."""
    out: list[LayerSpec | None] = []
    for ch in text:
        if ch == "F":
            out.append(make_attention())
        elif ch == "S":
            out.append(make_attention(kind="sliding_window", window_tokens=window_tokens))
        elif ch == "C":
            out.append(make_attention(kind="chunked_local", chunk_tokens=8192))
        else:
            out.append(GDN)
    return out


# Qwen3-Next-80B-A3B Gated DeltaNet: 16 key heads x 128, 32 value heads x 128, conv kernel 4, bf16.
GDN = MambaSpec(mamba_type=MambaType.GATED_DELTANET, shapes=((3, 2 * 16 * 128 + 32 * 128), (32, 128, 128)),
                dtypes=("bfloat16", "bfloat16"))


def test_attention_page_bytes_by_hand() -> None:
    spec = make_attention(kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.bytes_per_token == 2 * 8 * 128 * 2
    assert spec.page_size_bytes(16) == 65536
    assert make_attention(kv_heads=8, head_dim=64, dtype="fp8").page_size_bytes(32) == 2 * 32 * 8 * 64


def test_mamba_page_bytes_by_hand() -> None:
    assert GDN.state_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2 == 1_097_728
    mixed = MambaSpec(mamba_type=MambaType.MAMBA2, shapes=((3, 10), (2, 4, 5)), dtypes=("bfloat16", "float32"))
    assert mixed.page_size_bytes(16) == mixed.page_size_bytes(4096) == 60 + 160


@pytest.mark.parametrize(
    ("full", "sliding", "group_size", "num_groups", "padding"),
    [(2, 4, 2, 3, 0), (3, 7, 3, 4, 2), (6, 5, 6, 2, 1), (10, 52, 10, 7, 8)],
)
def test_grouping_examples(full: int, sliding: int, group_size: int, num_groups: int, padding: int) -> None:
    full_layers = list(range(full))
    sliding_layers = list(range(full, full + sliding))
    size, groups = group_layers([full_layers, sliding_layers])
    assert size == group_size
    assert len(groups) == num_groups
    assert sum(size - len(g) for g in groups) == padding
    assert sorted(i for g in groups for i in g) == full_layers + sliding_layers


def test_gemma3_27b_split_is_strided() -> None:
    sliding = [i for i in range(62) if i % 6 != 5]
    _, groups = group_layers([[i for i in range(62) if i % 6 == 5], sliding])
    assert [len(g) for g in groups] == [10, 9, 9, 9, 9, 8, 8]
    assert groups[1] == sliding[0::6]


def test_mamba_block_size_formula() -> None:
    # Qwen3-Next: P1 = 2 * 2 kv heads * 256 * 2 bytes = 2048; ceil(1097728 / (16 * 2048)) = 34 -> 544.
    assert mamba_block_size(state_bytes=1_097_728, attn_bytes_per_token=2048, alignment=16) == 544
    assert mamba_block_size(state_bytes=1_097_728, attn_bytes_per_token=2048, alignment=64) == 576


def test_mamba_hybrid_layout_pads_state_to_attention_page() -> None:
    attn = make_attention(kv_heads=2, head_dim=256)
    layers: list[LayerSpec | None] = [GDN, GDN, GDN, attn] * 2
    options = PlannerOptions(memory_bytes=GIB, max_model_len=4096)
    cfg = build_kv_cache_config(make_model(layers=layers), options)
    assert cfg.page_size_bytes == 544 * 2048
    assert {g.block_size for g in cfg.groups} == {544}
    assert cfg.group_size == 2 and len(cfg.groups) == 4  # 6 GDN layers in 3 groups of 2, 2 full in one
    assert cfg.num_blocks == GIB // (544 * 2048) // 2
    assert plan(make_model(layers=layers), options).recommended_chunk_size == 544


def test_gemma3_like_capacity_by_hand() -> None:
    model = make_model(layers=pattern("SSSSSF"))
    options = PlannerOptions(memory_bytes=GIB, max_model_len=8192, max_num_batched_tokens=2048)
    result = plan(model, options)
    cfg = result.config
    # 1 full + 5 sliding layers -> group_size 1, 6 groups, one tensor shared by all 6 layers.
    # Groups follow the first appearance of each spec (vLLM's order): the sliding ones first.
    assert cfg.group_size == 1 and len(cfg.groups) == 6 and len(cfg.tensors) == 1
    assert [g.kind for g in cfg.groups] == [SpecKind.SLIDING_WINDOW] * 5 + [SpecKind.FULL]
    assert cfg.tensors[0].shared_by == (0, 1, 2, 3, 4, 5)
    page = 16 * 2 * 16 * 128 * 2
    assert cfg.page_size_bytes == page and cfg.num_blocks == GIB // page == 8192
    full_need = 8192 // 16
    sliding_need = math.ceil((1023 + 2048) / 16) + 1
    assert result.blocks_per_request == (sliding_need,) * 5 + (full_need,)
    assert result.max_concurrency == pytest.approx(8191 / (512 + 5 * 193))
    uniform_blocks = GIB // (6 * page)
    assert result.uniform.runnable and result.uniform.num_blocks == uniform_blocks
    assert result.uniform.max_concurrency == pytest.approx((uniform_blocks - 1) / 512)
    assert result.kv_capacity_tokens == 45430  # 8191 * 8192 / 1477 = 45430.4 tokens
    # one 8192-token request: 512 full + 5 x 193 sliding blocks of one page each, vs 512 blocks of 6 pages
    assert result.bytes_per_request == (512 + 5 * 193) * page
    assert result.uniform.bytes_per_request == 512 * 6 * page
    assert result.recommended_chunk_size == 256
    assert result.padding_waste_bytes == 0


def test_padding_waste_counts_empty_slots() -> None:
    model = make_model(layers=pattern("FFF" + "S" * 7))
    result = plan(model, PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    cfg = result.config
    assert cfg.group_size == 3 and len(cfg.tensors) == 3
    # Groups: 1 full (need 256 blocks at 4096 tokens) and 3 sliding (need ceil(3071/16)+1 = 193), two of
    # them short by one layer: at full load 2 * 193 of every 256 + 3 * 193 blocks leave one page empty.
    full_need, sliding_need = 256, 193
    share = 2 * sliding_need / (full_need + 3 * sliding_need)
    page = 16 * 2 * 16 * 128 * 2
    assert (cfg.page_size_bytes, cfg.num_blocks) == (page, GIB // page // 3) == (131072, 2730)
    assert result.padding_waste_bytes == pytest.approx(share * 2730 * page, rel=1e-6)
    # tensor 2 is shared by the third layer of each group; the two short sliding groups leave it.
    assert len(cfg.tensors[2].shared_by) == 2


def test_mamba_hybrid_uniform_layout_cannot_run() -> None:
    result = plan(make_model(layers=pattern("MMMF")), PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert not result.uniform.runnable
    assert "Mamba" in result.uniform.reason
    assert math.isinf(result.capacity_ratio)


def test_kv_shared_layers_get_no_memory() -> None:
    layers = pattern("SFSF")
    model = make_model(layers=layers, shared={2: 0, 3: 1})
    cfg = build_kv_cache_config(model, PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    assert sorted(i for g in cfg.groups for i in g.layer_indices) == [0, 1]
    assert cfg.kv_shared_from == {2: 0, 3: 1}  # layer 3 reads layer 1's tensor
    owners = {layer: i for i, tensor in enumerate(cfg.tensors) for layer in tensor.shared_by}
    assert 2 not in owners and 3 not in owners and {0, 1} <= owners.keys()


def test_different_head_dims_get_larger_block_for_smaller_page() -> None:
    layers: list[LayerSpec | None] = [make_attention(kind="sliding_window", window_tokens=512, head_dim=256),
                                      make_attention(head_dim=512)]
    cfg = build_kv_cache_config(make_model(layers=layers), PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    by_kind = {g.kind: g.block_size for g in cfg.groups}
    assert by_kind == {SpecKind.FULL: 16, SpecKind.SLIDING_WINDOW: 32}


def test_impossible_budget_is_a_clear_error() -> None:
    with pytest.raises(CapacityError, match=r"memory budget of 9.31e-07 GiB holds 0 blocks"):
        plan(make_model(layers=pattern("SF")), PlannerOptions(memory_bytes=1000, max_model_len=4096))


def test_bad_options_and_specs_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="max_model_len must be a positive integer, got 0"):
        PlannerOptions(memory_bytes=GIB, max_model_len=0)
    with pytest.raises(ConfigError, match="window_tokens"):
        make_attention(kind="sliding_window")
    with pytest.raises(ConfigError, match="unknown dtype 'float12'"):
        make_attention(dtype="float12")


def test_group_spec_validates_its_fields() -> None:
    spec = make_attention()
    with pytest.raises(ConfigError, match="group 3: block_size must be a positive integer, got 0"):
        KVCacheGroupSpec(group_id=3, spec=spec, layer_indices=(0,), block_size=0)
    with pytest.raises(ConfigError, match="at least one layer"):
        KVCacheGroupSpec(group_id=0, spec=spec, layer_indices=(), block_size=16)
