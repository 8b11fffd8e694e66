"""The planner on the cases of vLLM's own unit tests (vLLM's tests/v1/core/test_kv_cache_utils.py), with
their numbers copied by hand; docs/vllm.md lists the cases where hybridkv differs and why.

`test_get_max_concurrency_for_kv_cache_config` (max_model_len 16384, block 16, max_num_batched_tokens
1024, 32 heads x 128, fp16; sliding window 1024): a request needs 16384 / 16 = 1024 full-attention
blocks and cdiv(1023 + 1024, 16) + 1 = 129 sliding-window blocks; with 1536, 387 and 3459 blocks vLLM
reports concurrencies 1.5, 3 and 3 (all blocks over the blocks one request needs).
"""

from __future__ import annotations

import pytest

from hybridkv.plan.planner import PlannerOptions, plan
from hybridkv.plan.specs import AttentionSpec, LayerSpec, ModelSpec, SpecKind

# 32 layers of 16 tokens x 2 (K, V) x 32 heads x 128 x 2 bytes: one block of a 32-layer group
BLOCK_BYTES = 32 * 16 * 2 * 32 * 128 * 2


def layer(kind: SpecKind) -> AttentionSpec:
    return AttentionSpec(kind=kind, num_kv_heads=32, head_dim=128, dtype="float16",
                         window_tokens=1024 if kind is SpecKind.SLIDING_WINDOW else 0)


def model(layers: list[LayerSpec | None]) -> ModelSpec:
    return ModelSpec(name="qwen1.5-7b-like", model_type="toy", dtype="float16", layers=tuple(layers), kv_shared_from={},
                     max_position_embeddings=32768)


@pytest.mark.parametrize(("layers", "num_blocks", "need", "vllm_concurrency"), [
    ([layer(SpecKind.FULL)] * 32, 1536, (1024,), 1.5),
    ([layer(SpecKind.SLIDING_WINDOW)] * 32, 129 * 3, (129,), 3.0),
    ([layer(SpecKind.FULL)] * 32 + [layer(SpecKind.SLIDING_WINDOW)] * 32, (1024 + 129) * 3, (1024, 129), 3.0),
])
def test_max_concurrency_is_vllms(layers: list[LayerSpec | None], num_blocks: int, need: tuple[int, ...],
                                  vllm_concurrency: float) -> None:
    options = PlannerOptions(memory_bytes=num_blocks * BLOCK_BYTES, max_model_len=16384,
                             max_num_batched_tokens=1024, block_size=16)
    result = plan(model(layers), options)
    assert result.config.num_blocks == num_blocks
    assert sorted(result.blocks_per_request, reverse=True) == list(need)
    assert result.vllm_max_concurrency == vllm_concurrency
    # (hybridkv's own figure leaves the null block out: no request can ever hold it)
    assert result.max_concurrency == (num_blocks - 1) / sum(need)


def test_pages_that_do_not_divide_keep_the_block_and_pad_the_smaller_page() -> None:
    """`test_get_kv_cache_config_one_worker`'s case: a full layer of 2 x 64 (16,384-byte pages of 16 tokens,
    fp32) next to a sliding layer of 2 x 96 (24,576 bytes) with 1,048,576 bytes. 24,576 is no multiple of
    16,384, so vLLM 0.32 keeps block 16 for both and pads the full page to 24,576: 42 blocks (run on vLLM
    0.32's `get_kv_cache_configs`: 42 blocks, both groups block 16, page 24,576)."""
    full = AttentionSpec(kind=SpecKind.FULL, num_kv_heads=2, head_dim=64, dtype="float32")
    sliding = AttentionSpec(kind=SpecKind.SLIDING_WINDOW, num_kv_heads=2, head_dim=96, dtype="float32",
                            window_tokens=1)
    result = plan(ModelSpec(name="toy", model_type="toy", dtype="float32", layers=(full, sliding), kv_shared_from={},
                            max_position_embeddings=64),
                  PlannerOptions(memory_bytes=16 * 2 * 64 * 4 * 2 * 2 * 32, max_model_len=16, block_size=16))
    assert result.config.num_blocks == 42 and result.config.page_size_bytes == 24576
    groups = [(g.kind, g.block_size) for g in result.config.groups]
    assert groups == [(SpecKind.FULL, 16), (SpecKind.SLIDING_WINDOW, 16)]
    assert result.config.groups[0].layer_page_bytes() == (16384,)  # (padded to the 24,576-byte stride)
