"""Llama, Mistral, Qwen2 and SmolLM3 (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`SmolLM3ForCausalLM`).

One decoder: RMSNorm, halves-layout rope, gated SiLU MLP. They differ only in biases, in which
layers slide and in NoPE layers: Mistral slides every layer when `sliding_window` is set; Qwen2
slides the layers from `max_window_layers` on when `use_sliding_window`; `layer_types` wins when
present (SmolLM3 saves it: with `use_sliding_window` its NoPE layers slide). SmolLM3's
`no_rope_layers[i] == 0` marks a layer that applies no rope.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridkv.engine.models.base import ForwardContext, attend, config_value
from hybridkv.engine.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, GatedMLP, PreNormDecoderLayer, QKVAttention, RMSNorm, RotaryEmbedding


def llama_like_layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per-layer attention type of a Llama/Mistral/Qwen2 config."""
    layers = int(config_value(config, "num_hidden_layers", required=True))
    if config.get("layer_types"):
        return [str(t) for t in config["layer_types"]]
    window = config.get("sliding_window")
    if config.get("model_type") == "qwen2":
        first = int(config.get("max_window_layers", layers)) if config.get("use_sliding_window") else layers
        return [SLIDING if window and i >= first else FULL for i in range(layers)]
    if config.get("model_type") == "mistral" and window:
        return [SLIDING] * layers
    return [FULL] * layers


class LlamaAttention(QKVAttention):
    """Projections (Qwen2: q/k/v biased, o not), halves rope on q and k, scale head_dim ** -0.5."""

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        qwen2 = config.get("model_type") == "qwen2"
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer, qkv_bias=qwen2 or bias, o_bias=not qwen2 and bias)
        uses_rope = config.get("no_rope_layers")  # SmolLM3: 0 = NoPE layer
        self.use_rope = not uses_rope or bool(uses_rope[layer])

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        if self.use_rope:
            q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        return self.o_proj(attend(ctx, self.layer, q, k, v, scale=self.scale))  # type: ignore[no-any-return]


class LlamaLikeForCausalLM(DecoderForCausalLM):
    """Llama / Mistral / Qwen2 / SmolLM3 decoder with full or sliding-window layers (and NoPE layers)."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "SmolLM3ForCausalLM")

    def __init__(self, config: Mapping[str, Any]) -> None:
        layer_types = llama_like_layer_types(config)
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config.get("rms_norm_eps", 1e-6))
        inter, act = int(config["intermediate_size"]), str(config.get("hidden_act", "silu"))
        mlp_bias = bool(config.get("mlp_bias", False))
        layers = [PreNormDecoderLayer(LlamaAttention(config, i), GatedMLP(hidden, inter, act=act, bias=mlp_bias),
                                      hidden=hidden, eps=eps) for i in range(int(config["num_hidden_layers"]))]
        rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=4096)
        super().__init__(config, model=DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps)),
                         layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
