"""gpt-oss (`GptOssForCausalLM`, model_type gpt_oss).

Attention: q/k/v/o with biases, YaRN rope (halves layout), learned per-head sink logits that join
the softmax, layers alternating sliding window / full (`layer_types`). MLP: top-k router with bias
(softmax over the chosen logits), experts with interleaved gate/up columns and the clamped SwiGLU

    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)

Only unquantized checkpoints load (the released MXFP4 weights need dequantizing first).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.core.errors import ConfigError
from hybridkv.core.specs import SpecKind
from hybridkv.engine.models.base import CausalLM, ForwardContext, attend, config_value, head_dim_of
from hybridkv.engine.models.layers import RMSNorm, RopeLayout, RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"


class GptOssAttention(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer = layer
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config_value(config, "num_key_value_heads", self.num_heads))
        self.head_dim = head_dim_of(config)
        bias = bool(config.get("attention_bias", True))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        out = attend(ctx, self.layer, q, k, v, scale=self.scale, sinks=self.sinks)  # [T, H*D]
        return self.o_proj(out)  # type: ignore[no-any-return]


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices [T, k], weights [T, k]): softmax over the k largest router logits."""
        logits = torch.nn.functional.linear(x, self.weight, self.bias)  # [T, E]
        top, index = torch.topk(logits, self.top_k, dim=-1)  # [T, k] each
        return index, torch.softmax(top, dim=-1)


class GptOssExperts(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        experts = int(config["num_local_experts"])
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.alpha = float(config.get("swiglu_alpha", 1.702))
        self.limit = float(config.get("swiglu_limit", 7.0))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Weighted sum over each token's chosen experts; x [T, hidden], index/weight [T, k]."""
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            gate_up = x[token] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]  # [n, 2I]
            gate = gate_up[:, 0::2].clamp(max=self.limit)  # [n, I] even columns
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)  # [n, I] odd columns
            act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [n, I]
            y = act @ self.down_proj[expert] + self.down_proj_bias[expert]  # [n, hidden]
            out.index_add_(0, token, y * weight[token, slot, None])
        return out


class GptOssMLP(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.router = GptOssRouter(int(config["hidden_size"]), int(config["num_local_experts"]),
                                   int(config.get("num_experts_per_tok", 4)))
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.router(x)
        return self.experts(x, index, weight)  # type: ignore[no-any-return]


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-5))
        self.self_attn = GptOssAttention(config, layer)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class GptOssModel(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        self.embed_tokens = nn.Embedding(int(config["vocab_size"]), hidden)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, i) for i in range(layers))
        self.norm = RMSNorm(hidden, eps=float(config.get("rms_norm_eps", 1e-5)))


class GptOssForCausalLM(CausalLM):
    """gpt-oss decoder with sinks, alternating sliding/full attention and a top-k MoE."""

    architectures = ("GptOssForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("quantization_config"):
            raise ConfigError(
                "gpt-oss checkpoint is quantized (quantization_config present); the reference engine "
                "loads unquantized float weights only"
            )
        layers = int(config_value(config, "num_hidden_layers", required=True))
        types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
        self.layer_types = [str(t) for t in types]
        self.model = GptOssModel(config)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(int(config["hidden_size"]), int(config["vocab_size"]), bias=False)
        self.rope = RotaryEmbedding(
            rope_parameters(config, layer_type=None, default_theta=150000.0),
            dim=head_dim_of(config),
            max_positions=int(config.get("max_position_embeddings", 131072)), layout=RopeLayout.HALVES)

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
