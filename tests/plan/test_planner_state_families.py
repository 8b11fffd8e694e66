"""The new state families' layouts, computed by hand from vLLM's rules (CI pins; test_groups_vs_vllm.py
checks the same against vLLM's code where its venv exists).

    attention block B = A * ceil(M / (A * P1)), A = 16 (128 next to MLA), M = state bytes, P1 = attention
    bytes per token; the state page is padded to B * P1.
"""

from __future__ import annotations

from typing import Any

from hybridkv.plan.kv_cache_config import PlannerOptions
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import build_kv_cache_config
from hybridkv.plan.specs import SpecKind

GIB = 1 << 30


def layout(config: dict[str, Any]) -> list[tuple[SpecKind, int, int, int]]:
    """(kind, layers, block size, page bytes) per group."""
    built = build_kv_cache_config(model_spec_from_config(config, name="m"),
                                  PlannerOptions(memory_bytes=GIB, max_model_len=4096))
    return [(g.spec.kind, len(g.layer_indices), g.block_size, built.page_size_bytes) for g in built.groups]


def test_kimi_linear_mla_next_to_kda_aligns_to_128() -> None:
    """Kimi-Linear-48B: KDA state M = 3 * 12288 * 2 + 32 * 128 * 128 * 4 = 2,170,880 bytes; MLA P1 = 576 * 2;
    B = 128 * ceil(2170880 / (128 * 1152)) = 128 * 15 = 1920; page 1920 * 1152 = 2,211,840."""
    config = {"model_type": "kimi_linear", "num_hidden_layers": 8, "hidden_size": 2304, "num_attention_heads": 32,
              "kv_lora_rank": 512, "qk_rope_head_dim": 64, "max_position_embeddings": 8192,
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
              "linear_num_heads": 32, "linear_head_dim": 128, "linear_conv_kernel_dim": 4}
    assert layout(config) == [(SpecKind.MAMBA, 2, 1920, 2211840)] * 3 + [(SpecKind.FULL, 2, 1920, 2211840)]


def test_olmo_hybrid_gated_deltanet_block() -> None:
    """M = 3 * (2*30*96 + 30*192) * 2 + 30 * 192 * 96 * 2 = 1,175,040; P1 = 2 * 30 * 128 * 2 = 15,360;
    B = 16 * ceil(1175040 / 245760) = 80; page 80 * 15360 = 1,228,800."""
    config = {"model_type": "olmo_hybrid", "num_hidden_layers": 4, "hidden_size": 3840, "num_attention_heads": 30,
              "max_position_embeddings": 65536, "linear_num_key_heads": 30, "linear_num_value_heads": 30,
              "linear_key_head_dim": 96, "linear_value_head_dim": 192, "linear_conv_kernel_dim": 4,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    assert layout(config) == [(SpecKind.MAMBA, 1, 80, 1228800)] * 3 + [(SpecKind.FULL, 1, 80, 1228800)]


def test_lfm2_short_conv_state_fits_a_16_token_page() -> None:
    """LFM2-1.2B: conv state (2, 2048) bf16 = 8,192 bytes <= one 16-token attention page (16 * 2*8*64*2 = 32,768):
    block 16 stays, the state page is padded to 32,768."""
    config = {"model_type": "lfm2", "num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 128000, "conv_L_cache": 3,
              "full_attn_idxs": [2, 5, 8, 10, 12, 14]}
    assert layout(config) == [(SpecKind.MAMBA, 5, 16, 32768)] * 2 + [(SpecKind.FULL, 6, 16, 32768)]
