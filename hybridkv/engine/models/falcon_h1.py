"""Falcon-H1 (`FalconH1ForCausalLM`, model_type falcon_h1): attention and Mamba2 side by side in every layer.

    h = input_layernorm(x)
    x = x + ssm_out_multiplier * mamba(h) + attention_out_multiplier * self_attn(attention_in_multiplier * h)
    x = x + feed_forward(pre_ff_layernorm(x))       feed_forward: down(up(x) * act(gate_mult * gate(x))) * down_mult

The Mamba2 input is scaled by `ssm_in_multiplier` and its projection channel-wise by the muP
vector of `ssm_multipliers` (z | x | B | C | dt); keys by `key_multiplier`; embeddings by
`embedding_multiplier`, logits by `lm_head_multiplier`. The gated RMSNorm is optional
(`mamba_rms_norm`) and may gate after the norm (`mamba_norm_before_gate`).

Cache slots: layer i's attention is slot i, its Mamba2 state the extra slot `num_layers + i`
(`ModelSpec.decoder_layer_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, config_value, head_dim_of
from hybridkv.engine.models.decoder import FULL, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, RMSNorm, RotaryEmbedding, activation
from hybridkv.engine.models.mamba2_mixer import Mamba2Dims, Mamba2Mixer
from hybridkv.engine.models.mamba_hybrid import HybridAttention, prefixed_mamba2_dims
from hybridkv.errors import ConfigError
from hybridkv.plan.specs import SpecKind


def _floats(config: Mapping[str, Any], key: str, count: int) -> list[float]:
    values = config.get(key)
    if values is None:
        return [1.0] * count
    if not isinstance(values, list | tuple) or len(values) != count:
        raise ConfigError(f"falcon_h1 {key} must list {count} numbers, got {values!r}")
    return [float(v) for v in values]


class FalconH1Mixer(Mamba2Mixer):
    """Mamba2 with the input multiplier and the muP vector on its projection."""

    def __init__(self, dims: Mamba2Dims, config: Mapping[str, Any]) -> None:
        super().__init__(dims)
        self.ssm_in_multiplier = float(config_value(config, "ssm_in_multiplier", 1.0))
        z, x, b, c, dt = _floats(config, "ssm_multipliers", 5)
        gn = dims.n_groups * dims.state_size
        self.mup = torch.cat([torch.full((n,), m) for n, m in
                              ((dims.intermediate, z), (dims.intermediate, x), (gn, b), (gn, c), (dims.num_heads, dt))])

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.in_proj(x * self.ssm_in_multiplier) * self.mup.to(x.dtype)  # type: ignore[no-any-return]


class FalconH1MLP(nn.Module):
    def __init__(self, config: Mapping[str, Any], hidden: int) -> None:
        super().__init__()
        inner, bias = int(config_value(config, "intermediate_size", required=True)), bool(config.get("mlp_bias", False))
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = activation(str(config.get("hidden_act", "silu")))
        self.gate_multiplier, self.down_multiplier = _floats(config, "mlp_multipliers", 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_multiplier)
        return self.down_proj(y) * self.down_multiplier  # type: ignore[no-any-return]


class FalconH1Layer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int, *, state_slot: int) -> None:
        super().__init__()
        hidden = int(config_value(config, "hidden_size", required=True))
        eps = float(config_value(config, "rms_norm_eps", 1e-5))
        inner = config.get("mamba_d_ssm")
        dims = replace(prefixed_mamba2_dims(config, intermediate=None if inner is None else int(inner)),
                       out_bias=bool(config.get("projectors_bias", False)),
                       gated_norm=bool(config.get("mamba_rms_norm", False)),
                       norm_before_gate=bool(config.get("mamba_norm_before_gate", True)))
        self.state_slot = state_slot
        self.mamba = FalconH1Mixer(dims, config)
        self.self_attn = HybridAttention(config, layer, rotary_dim=head_dim_of(config),
                                         bias=bool(config.get("attention_bias", False)),
                                         key_multiplier=float(config_value(config, "key_multiplier", 1.0)))
        self.feed_forward = FalconH1MLP(config, hidden)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps=eps)
        self.attention_in = float(config_value(config, "attention_in_multiplier", 1.0))
        self.attention_out = float(config_value(config, "attention_out_multiplier", 1.0))
        self.ssm_out = float(config_value(config, "ssm_out_multiplier", 1.0))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        mamba = self.mamba(h, ctx, self.state_slot) * self.ssm_out
        attention = self.self_attn(h * self.attention_in, rope, cos_sin, ctx) * self.attention_out
        x = x + mamba + attention
        out: torch.Tensor = x + self.feed_forward(self.pre_ff_layernorm(x))
        return out


class FalconH1ForCausalLM(DecoderForCausalLM):
    """Falcon-H1: parallel attention + Mamba2 in every layer, muP multipliers."""

    architectures = ("FalconH1ForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        n = int(config_value(config, "num_hidden_layers", required=True))
        hidden = int(config_value(config, "hidden_size", required=True))
        layers = [FalconH1Layer(config, i, state_slot=n + i) for i in range(n)]
        norm = RMSNorm(hidden, eps=float(config_value(config, "rms_norm_eps", 1e-5)))
        model = DecoderModel(config, layers, norm=norm, norm_name="final_layernorm")
        rope = RotaryEmbedding.from_config(config, default_theta=100000.0, default_max_positions=16384)
        super().__init__(config, model=model, layer_types=[FULL] * n, ropes={FULL: rope},
                         tied=bool(config.get("tie_word_embeddings", False)))
        self.embedding_multiplier = float(config_value(config, "embedding_multiplier", 1.0))
        self.lm_head_multiplier = float(config_value(config, "lm_head_multiplier", 1.0))

    def layer_kinds(self) -> Sequence[SpecKind | None]:
        n = len(self.layer_types)
        return [SpecKind.FULL] * n + [SpecKind.MAMBA] * n  # attention slots, then the state slots

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier
