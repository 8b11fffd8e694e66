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

from hybridkv.engine.models.base import ForwardContext, attend, config_value
from hybridkv.engine.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, PreNormDecoderLayer, QKVAttention, RMSNorm, RotaryEmbedding
from hybridkv.errors import ConfigError


class GptOssAttention(QKVAttention):
    """Biased projections, halves rope on q and k, per-head sink logits in the softmax."""

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        bias = bool(config.get("attention_bias", True))
        super().__init__(config, layer, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
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


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss decoder with sinks, alternating sliding/full attention and a top-k MoE."""

    architectures = ("GptOssForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        if config.get("quantization_config"):
            raise ConfigError(
                "gpt-oss checkpoint is quantized (quantization_config present); the reference engine "
                "loads unquantized float weights only"
            )
        num_layers = int(config_value(config, "num_hidden_layers", required=True))
        types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        layer_types = [str(t) for t in types]
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config.get("rms_norm_eps", 1e-5))
        layers = [PreNormDecoderLayer(GptOssAttention(config, i), GptOssMLP(config), hidden=hidden, eps=eps)
                  for i in range(num_layers)]
        rope = RotaryEmbedding.from_config(config, default_theta=150000.0, default_max_positions=131072)
        super().__init__(config, model=DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps)),
                         layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
