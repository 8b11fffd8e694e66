"""Bamba (`BambaForCausalLM`, model_type bamba): Mamba2 layers with full attention at `attn_layer_indices`.

Every layer: x + mixer(input_layernorm(x)), then x + feed_forward(pre_ff_layernorm(x)) with a
gated SiLU MLP; the mixer is a Mamba2 mixer (`mamba`) or attention (`self_attn`) whose rope turns
only the first half of each head's channels (`partial_rotary_factor` 0.5). Final norm
`model.final_layernorm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.engine.models.base import config_value, head_dim_of
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from hybridkv.engine.models.mamba2_mixer import Mamba2Mixer
from hybridkv.engine.models.mamba_hybrid import HybridAttention, MixerDecoderLayer, prefixed_mamba2_dims
from hybridkv.errors import ConfigError


def rotary_dim_of(config: Mapping[str, Any], *, default_factor: float = 1.0) -> int:
    """Channels of each head that rope turns: head_dim * partial_rotary_factor (top level or in rope_parameters)."""
    params = config.get("rope_parameters")
    factor = config.get("partial_rotary_factor")
    if factor is None and isinstance(params, Mapping):
        factor = params.get("partial_rotary_factor")
    return int(head_dim_of(config) * float(default_factor if factor is None else factor))


class BambaForCausalLM(DecoderForCausalLM):
    """Bamba: Mamba2 + full attention (partial rope), gated MLPs."""

    architectures = ("BambaForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        num_layers = int(config_value(config, "num_hidden_layers", required=True))
        attention = {int(i) for i in config.get("attn_layer_indices") or ()}
        if any(i >= num_layers for i in attention):
            raise ConfigError(f"attn_layer_indices {sorted(attention)} must be below num_hidden_layers = {num_layers}")
        layer_types = [FULL if i in attention else LINEAR for i in range(num_layers)]
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config_value(config, "rms_norm_eps", 1e-5))
        rotary = rotary_dim_of(config, default_factor=0.5)  # transformers fixes Bamba's factor at 0.5
        dims = prefixed_mamba2_dims(config)
        layers = []
        for i, kind in enumerate(layer_types):
            mixer = (Mamba2Mixer(dims) if kind == LINEAR else
                     HybridAttention(config, i, rotary_dim=rotary, bias=bool(config.get("attention_bias", False))))
            mlp = GatedMLP(hidden, int(config_value(config, "intermediate_size", required=True)),
                           act=str(config.get("hidden_act", "silu")), bias=bool(config.get("mlp_bias", False)))
            layers.append(MixerDecoderLayer(mixer=mixer, is_state=kind == LINEAR, feed_forward=mlp, hidden=hidden,
                                            eps=eps, slot=i))
        rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=262144, dim=rotary)
        model = DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps), norm_name="final_layernorm")
        super().__init__(config, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
