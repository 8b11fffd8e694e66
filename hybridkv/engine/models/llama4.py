"""Llama 4 text (`Llama4ForCausalLM`, model_type llama4_text).

Layers with RoPE (`no_rope_layers[i] == 1`) use chunked local attention over
`attention_chunk_size` tokens, interleaved-pair rope and, if `use_qk_norm`, a weightless L2 (RMS)
norm of q and k after rope. NoPE layers (`no_rope_layers[i] == 0`) attend to everything and,
with `attn_temperature_tuning`, scale queries by

    log1p(floor((position + 1) / floor_scale)) * attn_scale + 1

MoE layers (`moe_layers`, default every `interleave_moe_layer_step`-th) add a shared expert to
top-k routed experts whose *inputs* are scaled by sigmoid(router logit); others are dense MLPs
of `intermediate_size_mlp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, attend, config_value
from hybridkv.engine.models.decoder import CHUNKED, FULL, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import (
    CosSin,
    GatedMLP,
    QKVAttention,
    RMSNorm,
    RopeLayout,
    RotaryEmbedding,
    activation,
)
from hybridkv.errors import ConfigError


def _rope_flags(config: Mapping[str, Any], layers: int) -> list[bool]:
    flags = config.get("no_rope_layers")
    if not flags:
        interval = int(config.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) < layers:
        raise ConfigError(f"llama4 no_rope_layers lists {len(flags)} layers, expected at least {layers}")
    return [bool(f) for f in flags[:layers]]


def _moe_layers(config: Mapping[str, Any], layers: int) -> set[int]:
    moe = config.get("moe_layers")
    if moe is None:
        step = int(config.get("interleave_moe_layer_step", 1))
        moe = range(step - 1, layers, step)
    return {int(i) for i in moe}


class Llama4Attention(QKVAttention):
    """RoPE layers: interleaved rope, then (use_qk_norm) weightless RMS norm of q and k.
    NoPE layers: no rope; with attn_temperature_tuning, queries scaled by their position."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, use_rope: bool) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer, qkv_bias=bias, o_bias=bias)
        self.use_rope = use_rope
        eps = float(config.get("rms_norm_eps", 1e-5))
        self.qk_norm = RMSNorm(self.head_dim, eps=eps, with_weight=False) if (
            use_rope and config.get("use_qk_norm", True)) else None
        self.temperature_tuning = not use_rope and bool(config.get("attn_temperature_tuning", True))
        self.floor_scale = float(config.get("floor_scale", 8192))
        self.attn_scale = float(config.get("attn_scale", 0.1))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        if self.use_rope:
            q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        if self.temperature_tuning:
            pos = ctx.positions.float()  # [T]
            scales = torch.log1p(torch.floor((pos + 1.0) / self.floor_scale)) * self.attn_scale + 1.0  # [T]
            q = (q * scales[:, None, None]).to(q.dtype)
        out = attend(ctx, self.layer, q, k, v, scale=self.scale)  # [T, H*D]
        return self.o_proj(out)  # type: ignore[no-any-return]


class Llama4Router(nn.Linear):
    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__(hidden, experts, bias=False)
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices [T, k], input scales [T, k] = sigmoid of the chosen logits)."""
        top, index = torch.topk(self(x), self.top_k, dim=-1)  # [T, k] each
        return index, torch.sigmoid(top.float()).to(x.dtype)


class Llama4Experts(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
        experts = int(config["num_local_experts"])
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(experts, inter, hidden))
        self.act = activation(str(config.get("hidden_act", "silu")))

    def forward(self, x: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of expert(x * scale); x [T, hidden], index/scale [T, k]."""
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            routed = x[token] * scale[token, slot, None]  # [n, hidden]
            gate, up = (routed @ self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I] each
            out.index_add_(0, token, (up * self.act(gate)) @ self.down_proj[expert])
        return out


class Llama4Moe(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.router = Llama4Router(hidden, int(config["num_local_experts"]),
                                   int(config.get("num_experts_per_tok", 1)))
        self.experts = Llama4Experts(config)
        self.shared_expert = GatedMLP(hidden, int(config["intermediate_size"]),
                                      act=str(config.get("hidden_act", "silu")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, scale = self.router.route(x)
        return self.shared_expert(x) + self.experts(x, index, scale)  # type: ignore[no-any-return]


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int, *, use_rope: bool, moe: bool) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-5))
        self.self_attn = Llama4Attention(config, layer, use_rope=use_rope)
        self.feed_forward: nn.Module = Llama4Moe(config) if moe else GatedMLP(
            hidden, int(config.get("intermediate_size_mlp", config["intermediate_size"])),
            act=str(config.get("hidden_act", "silu")))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)
        return x + self.feed_forward(self.post_attention_layernorm(x))  # type: ignore[no-any-return]


class Llama4ForCausalLM(DecoderForCausalLM):
    """Llama 4 text decoder: chunked local RoPE layers, global NoPE layers, MoE."""

    architectures = ("Llama4ForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        num_layers = int(config_value(config, "num_hidden_layers", required=True))
        rope_flags = _rope_flags(config, num_layers)
        chunk = int(config.get("attention_chunk_size") or 0)
        types = config.get("layer_types") or [CHUNKED if flag and chunk else FULL for flag in rope_flags]
        layer_types = [str(t) for t in types]
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config.get("rms_norm_eps", 1e-5))
        moe = _moe_layers(config, num_layers)
        layers = [Llama4DecoderLayer(config, i, use_rope=flag, moe=i in moe) for i, flag in enumerate(rope_flags)]
        rope = RotaryEmbedding.from_config(  # NoPE layers get it too and ignore it
            config, default_theta=500000.0, default_max_positions=131072, layout=RopeLayout.INTERLEAVED)
        super().__init__(config, model=DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps)),
                         layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
