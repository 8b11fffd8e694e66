"""Llama, Mistral and Qwen2 (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`).

One decoder: RMSNorm, halves-layout rope, gated SiLU MLP. They differ only in biases and in
which layers slide: Mistral slides every layer when `sliding_window` is set; Qwen2 slides the
layers from `max_window_layers` on when `use_sliding_window`; `layer_types` wins when present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.core.specs import SpecKind
from hybridkv.engine.models.base import CausalLM, ForwardContext, attend, config_value, head_dim_of
from hybridkv.engine.models.layers import GatedMLP, RMSNorm, RopeLayout, RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"


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


class LlamaAttention(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer = layer
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config_value(config, "num_key_value_heads", self.num_heads))
        self.head_dim = head_dim_of(config)
        qkv_bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False))
        o_bias = config.get("model_type") != "qwen2" and bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        return self.o_proj(attend(ctx, self.layer, q, k, v, scale=self.scale))  # type: ignore[no-any-return]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = GatedMLP(hidden, int(config["intermediate_size"]), act=str(config.get("hidden_act", "silu")),
                            bias=bool(config.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.embed_tokens = nn.Embedding(int(config["vocab_size"]), hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(int(config["num_hidden_layers"])))
        self.norm = RMSNorm(hidden, eps=float(config.get("rms_norm_eps", 1e-6)))


class LlamaLikeForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 decoder with full or sliding-window layers."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        self.layer_types = llama_like_layer_types(config)
        self.model = LlamaModel(config)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(int(config["hidden_size"]), int(config["vocab_size"]), bias=False)
        self.rope = RotaryEmbedding(
            rope_parameters(config, layer_type=None, default_theta=10000.0),
            dim=head_dim_of(config),
            max_positions=int(config.get("max_position_embeddings", 4096)), layout=RopeLayout.HALVES)

    def layer_kinds(self) -> list[SpecKind]:
        return [SpecKind.SLIDING_WINDOW if t == SLIDING else SpecKind.FULL for t in self.layer_types]

    def ignores_weight(self, name: str) -> bool:
        return self.tied and name == "lm_head.weight"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos_sin = self.rope.cos_sin(positions)
        for layer in self.model.layers:
            x = layer(x, self.rope, cos_sin, ctx)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return hidden @ weight.t()  # [N, vocab]
