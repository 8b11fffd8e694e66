"""Jamba (`JambaForCausalLM`, model_type jamba): Mamba1 layers, attention every `attn_layer_period`, MoE.

Layer i is attention when `i % attn_layer_period == attn_layer_offset`, else a Mamba1 mixer;
its feed-forward is a top-k MoE when `i % expert_layer_period == expert_layer_offset` (and
`num_experts` > 1), else a gated MLP. Pre-norm layers as Bamba's; attention has no rope.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridkv.engine.models.base import config_value
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import GatedMLP, RMSNorm, RopeLayout, RotaryEmbedding
from hybridkv.engine.models.mamba1_mixer import Mamba1Dims, Mamba1Mixer
from hybridkv.engine.models.mamba_hybrid import HybridAttention, MixerDecoderLayer, TopKMoE
from hybridkv.errors import ConfigError


def _every(config: Mapping[str, Any], period_key: str, offset_key: str, period: int, offset: int) -> tuple[int, int]:
    p, o = int(config_value(config, period_key, period)), int(config_value(config, offset_key, offset))
    if not 0 <= o < p:
        raise ConfigError(f"jamba {offset_key} = {o} must be in [0, {period_key} = {p})")
    return p, o


def mamba1_dims(config: Mapping[str, Any]) -> Mamba1Dims:
    hidden = int(config_value(config, "hidden_size", required=True))
    rank = config.get("mamba_dt_rank", "auto")
    return Mamba1Dims(
        hidden=hidden, intermediate=int(config_value(config, "mamba_expand", 2)) * hidden,
        state_size=int(config_value(config, "mamba_d_state", 16)),
        conv_kernel=int(config_value(config, "mamba_d_conv", 4)),
        dt_rank=-(-hidden // 16) if rank in (None, "auto") else int(rank),
        eps=float(config_value(config, "rms_norm_eps", 1e-6)), act=str(config.get("hidden_act", "silu")),
        conv_bias=bool(config.get("mamba_conv_bias", True)), proj_bias=bool(config.get("mamba_proj_bias", False)),
    )


class JambaForCausalLM(DecoderForCausalLM):
    """Jamba: Mamba1 + attention (no rope), MoE every `expert_layer_period` layers."""

    architectures = ("JambaForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        n = int(config_value(config, "num_hidden_layers", required=True))
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config_value(config, "rms_norm_eps", 1e-6))
        attn_period, attn_offset = _every(config, "attn_layer_period", "attn_layer_offset", 8, 4)
        moe_period, moe_offset = _every(config, "expert_layer_period", "expert_layer_offset", 2, 1)
        experts = int(config_value(config, "num_experts", 16))
        inner = int(config_value(config, "intermediate_size", required=True))
        act = str(config.get("hidden_act", "silu"))
        layer_types = [FULL if i % attn_period == attn_offset else LINEAR for i in range(n)]
        layers = []
        for i, kind in enumerate(layer_types):
            mixer = Mamba1Mixer(mamba1_dims(config)) if kind == LINEAR else HybridAttention(config, i, rotary_dim=0)
            ffn: nn.Module = (TopKMoE(hidden=hidden, intermediate=inner, experts=experts, act=act,
                                      top_k=int(config_value(config, "num_experts_per_tok", 2)))
                              if experts > 1 and i % moe_period == moe_offset else GatedMLP(hidden, inner, act=act))
            layers.append(MixerDecoderLayer(mixer=mixer, is_state=kind == LINEAR, feed_forward=ffn, hidden=hidden,
                                            eps=eps, slot=i))
        model = DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps), norm_name="final_layernorm")
        rope = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, dim=2, max_positions=1,
                               layout=RopeLayout.HALVES)  # unused: Jamba's attention has no rope
        super().__init__(config, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
