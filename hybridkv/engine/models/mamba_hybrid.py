"""What the Mamba hybrid model files share: config readers, their attention, a decoder layer, MoE blocks.

    HybridAttention   q/k/v/o, rope on the first `rotary_dim` channels of each head (Bamba: half,
                      Falcon-H1 / Granite: all) or none (Jamba, Nemotron-H, Granite without rope),
                      optional key multiplier (Falcon-H1) and scale (Granite's attention_multiplier)
    MixerDecoderLayer x + mixer(input_layernorm(x)); x + feed_forward(pre_ff_layernorm(x))
                      where the mixer is `mamba` (a state layer) or `self_attn` (Bamba, Jamba names)
    TopKMoE           softmax router over experts, top-k, HF per-expert `experts.<e>.*_proj` modules

A state layer calls its mixer with its cache slot; a decoder layer gets (x, rope, cos_sin, ctx)
like every layer of `decoder.DecoderForCausalLM`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, attend, config_value
from hybridkv.engine.models.layers import CosSin, GatedMLP, QKVAttention, RMSNorm, RotaryEmbedding
from hybridkv.engine.models.mamba2_mixer import Mamba2Dims
from hybridkv.errors import ConfigError


def _number(value: Any, key: str) -> float:
    """A JSON number, or transformers' {"__float__": "Infinity"} / the strings "inf" and "Infinity"."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must hold numbers, got {value!r}") from None


def time_step_limit(config: Mapping[str, Any], key: str = "time_step_limit") -> tuple[float, float]:
    """The dt clamp (low, high); (0, inf) when unset."""
    value = config.get(key)
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError(f"{key} must be a pair [low, high], got {value!r}")
    return (_number(value[0], key), _number(value[1], key))


def prefixed_mamba2_dims(config: Mapping[str, Any], *, intermediate: int | None = None) -> Mamba2Dims:
    """The Mamba2 mixer of Bamba / Granite 4.0-H / Falcon-H1 from their `mamba_*` fields."""
    hidden = int(config_value(config, "hidden_size", required=True))
    inner = intermediate or int(config_value(config, "mamba_expand", 2)) * hidden
    heads = int(config_value(config, "mamba_n_heads", required=True))
    head_dim = config.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError(f"mamba_n_heads * mamba_d_head = {heads} * {head_dim} must equal the mamba intermediate "
                          f"size {inner}")
    return Mamba2Dims(
        hidden=hidden, intermediate=inner, num_heads=heads, head_dim=head_dim,
        n_groups=int(config_value(config, "mamba_n_groups", 1)),
        state_size=int(config_value(config, "mamba_d_state", required=True)),
        conv_kernel=int(config_value(config, "mamba_d_conv", 4)), eps=float(config_value(config, "rms_norm_eps", 1e-5)),
        act=str(config_value(config, "hidden_act", "silu")),
        conv_bias=bool(config_value(config, "mamba_conv_bias", True)),
        proj_bias=bool(config_value(config, "mamba_proj_bias", False)),
        out_bias=bool(config_value(config, "mamba_proj_bias", False)), time_step_limit=time_step_limit(config),
    )


class HybridAttention(QKVAttention):
    """Projections, rope on the first `rotary_dim` channels (0: no rope), optional key multiplier."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, rotary_dim: int, bias: bool = False,
                 key_multiplier: float = 1.0, scale: float | None = None) -> None:
        super().__init__(config, layer, qkv_bias=bias, o_bias=bias)
        self.rotary_dim, self.key_multiplier = rotary_dim, key_multiplier
        if scale is not None:
            self.scale = scale

    def _rotate(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin) -> torch.Tensor:
        if self.rotary_dim == 0:
            return x
        if self.rotary_dim == x.shape[-1]:
            return rope.rotate(x, *cos_sin)
        rotated = rope.rotate(x[..., :self.rotary_dim], *cos_sin)  # [T, H, R]
        return torch.cat([rotated, x[..., self.rotary_dim:]], dim=-1)  # [T, H, D]

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        q, k = self._rotate(q, rope, cos_sin), self._rotate(k * self.key_multiplier, rope, cos_sin)
        return self.o_proj(attend(ctx, self.layer, q, k, v, scale=self.scale))  # type: ignore[no-any-return]


class MixerDecoderLayer(nn.Module):
    """Pre-norm layer whose mixer is a state layer (`mamba`, called with its cache slot) or `self_attn`."""

    narrows_to_sample_rows = True  # see ForwardContext.keep

    def __init__(self, *, mixer: nn.Module, is_state: bool, feed_forward: nn.Module, hidden: int, eps: float,
                 slot: int) -> None:
        super().__init__()
        self.slot = slot
        if is_state:
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.is_state = is_state
        self.feed_forward = feed_forward
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx, self.slot) if self.is_state else self.self_attn(h, rope, cos_sin, ctx)
        x = ctx.keep(x) + ctx.keep(h)
        out: torch.Tensor = x + self.feed_forward(self.pre_ff_layernorm(x))
        return out


class TopKMoE(nn.Module):
    """Jamba's block: router [E, hidden]; softmax over all experts, the top k keep their probabilities."""

    def __init__(self, *, hidden: int, intermediate: int, experts: int, top_k: int, act: str) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, act=act) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [T, E]
        weight, index = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            y = self.experts[expert](x[token])  # [n, hidden]
            out.index_add_(0, token, y * weight[token, slot, None].to(x.dtype))
        return out
