"""LFM2 and LFM2-MoE (`Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`): gated short convolutions with full attention at
a few layers.

Every layer: x + operator(operator_norm(x)), then x + feed_forward(ffn_norm(x)); the operator is a
short convolution (`conv`) or attention (`self_attn`: q/k RMSNorm per head, rope, `out_proj`). The
short convolution keeps only a conv state (the last `conv_L_cache - 1` inputs of its depthwise conv):

    B, C, x = in_proj(h).chunk(3)        # [T, hidden] each
    y = out_proj(C * conv(B * x))        # depthwise causal conv over the gated input, no activation

The feed-forward is SwiGLU (`w1`, `w3`, `w2`) whose width transformers adjusts when
`block_auto_adjust_ff_dim` (2/3 of `intermediate_size`, times `block_ffn_dim_multiplier`, rounded up
to `block_multiple_of`; LFM2-MoE's dense layers take `intermediate_size` as it is); LFM2-MoE's layers from
`num_dense_layers` on route to experts instead (`Lfm2MoE`). Final norm `model.embedding_norm`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.models.base import ForwardContext, attend, config_value, head_dim_of
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.deepseek import mix_experts
from hybridkv.engine.models.layers import CosSin, QKVAttention, RMSNorm, RotaryEmbedding
from hybridkv.engine.state_layers import causal_conv
from hybridkv.errors import ConfigError


def lfm2_layer_types(config: Mapping[str, Any]) -> list[str]:
    """FULL for attention layers, LINEAR for short convolutions (`layer_types`, else `full_attn_idxs`)."""
    layers = int(config_value(config, "num_hidden_layers", required=True))
    names = config.get("layer_types")
    if names is None:
        full = set(config.get("full_attn_idxs") or ())
        return [FULL if i in full else LINEAR for i in range(layers)]
    if len(names) != layers or set(names) - {"full_attention", "conv"}:
        raise ConfigError(f"lfm2 layer_types must list {layers} entries 'full_attention' or 'conv', got {names!r}")
    return [FULL if name == "full_attention" else LINEAR for name in names]


def _ff_width(config: Mapping[str, Any]) -> int:
    width = int(config_value(config, "intermediate_size", required=True))
    if config.get("model_type") == "lfm2_moe" or not config.get("block_auto_adjust_ff_dim", True):
        return width  # LFM2-MoE's dense layers take intermediate_size as it is
    width = int(2 * width / 3)
    multiplier = config.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        step = int(config.get("block_multiple_of", 256))
        width = step * ((int(float(multiplier) * width) + step - 1) // step)
    return width


class Lfm2MLP(nn.Module):
    """w2(silu(w1(x)) * w3(x))."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class Lfm2MoE(nn.Module):
    """LFM2-MoE's block (checkpoint names `gate`, `expert_bias`, `experts.<e>.w1/w3/w2`): sigmoid scores, top-k
    chosen on scores + expert_bias (`use_expert_bias`), weights normalised (`norm_topk_prob`, + 1e-6) and scaled."""

    def __init__(self, config: Mapping[str, Any], hidden: int) -> None:
        super().__init__()
        experts = int(config_value(config, "num_experts", required=True))
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        width = int(config_value(config, "moe_intermediate_size", required=True))
        self.experts = nn.ModuleList(Lfm2MLP(hidden, width) for _ in range(experts))
        self.top_k = int(config_value(config, "num_experts_per_tok", required=True))
        self.use_bias = bool(config.get("use_expert_bias", True))
        self.normalize = bool(config.get("norm_topk_prob", True))
        self.scaling = float(config.get("routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        scores = self.gate(x).sigmoid()  # [T, E]
        choice = scores + self.expert_bias if self.use_bias else scores
        index = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weight = scores.gather(1, index)
        if self.normalize:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-6)
        return mix_experts(x, index, weight * self.scaling, self.experts)


class Lfm2Attention(QKVAttention):
    """q/k/v, per-head RMSNorm on q and k before rope, `out_proj`."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, eps: float) -> None:
        super().__init__(config, layer, qkv_bias=False, o_bias=False)
        self.out_proj = self.o_proj
        del self.o_proj
        self.q_layernorm = RMSNorm(self.head_dim, eps=eps)
        self.k_layernorm = RMSNorm(self.head_dim, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        q, k = rope.rotate(self.q_layernorm(q), *cos_sin), rope.rotate(self.k_layernorm(k), *cos_sin)
        return self.out_proj(attend(ctx, self.layer, q, k, v, scale=self.scale))  # type: ignore[no-any-return]


class Lfm2ShortConv(nn.Module):
    """HF names: in_proj [3 * hidden, hidden], conv (weight [hidden, 1, K]), out_proj."""

    def __init__(self, hidden: int, kernel: int, *, bias: bool) -> None:
        super().__init__()
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, bias=bias, padding=kernel - 1)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, slot: int) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], reading and writing the conv states of cache slot `slot`."""
        b, c, h = self.in_proj(x).float().chunk(3, dim=-1)  # [T, hidden] each
        bias = None if self.conv.bias is None else self.conv.bias.float()
        conv = causal_conv(b * h, ctx.state_cache(slot).conv, ctx.state_metadata(slot),
                           self.conv.weight[:, 0].float(), bias, act=_identity)  # [T, hidden]
        return self.out_proj((c * conv).to(x.dtype))  # type: ignore[no-any-return]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class Lfm2DecoderLayer(nn.Module):
    """x + operator(operator_norm(x)); x + feed_forward(ffn_norm(x))."""

    narrows_to_sample_rows = True  # see ForwardContext.keep

    def __init__(self, config: Mapping[str, Any], layer: int, *, kind: str, hidden: int, eps: float) -> None:
        super().__init__()
        self.layer, self.is_state = layer, kind == LINEAR
        if self.is_state:
            self.conv = Lfm2ShortConv(hidden, int(config.get("conv_L_cache", 3)), bias=bool(config.get("conv_bias")))
        else:
            self.self_attn = Lfm2Attention(config, layer, eps=eps)
        sparse = config.get("model_type") == "lfm2_moe" and layer >= int(config.get("num_dense_layers", 2))
        self.feed_forward: nn.Module = Lfm2MoE(config, hidden) if sparse else Lfm2MLP(hidden, _ff_width(config))
        self.operator_norm = RMSNorm(hidden, eps=eps)
        self.ffn_norm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.conv(h, ctx, self.layer) if self.is_state else self.self_attn(h, rope, cos_sin, ctx)
        x = ctx.keep(x) + ctx.keep(h)
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Lfm2ForCausalLM(DecoderForCausalLM):
    """LFM2: short convolutions + full attention, SwiGLU feed-forwards, tied embeddings by default."""

    architectures = ("Lfm2ForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        layer_types = lfm2_layer_types(config)
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config.get("norm_eps", 1e-5))
        head_dim_of(config)  # hidden_size must split into the attention heads
        layers = [Lfm2DecoderLayer(config, i, kind=kind, hidden=hidden, eps=eps) for i, kind in enumerate(layer_types)]
        rope = RotaryEmbedding.from_config(config, default_theta=1000000.0, default_max_positions=128000)
        model = DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps), norm_name="embedding_norm")
        super().__init__(config, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", True)))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE: LFM2 whose feed-forwards from `num_dense_layers` on are sigmoid-routed experts."""

    architectures = ("Lfm2MoeForCausalLM",)
