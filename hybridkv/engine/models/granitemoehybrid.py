"""Granite 4.0-H (`GraniteMoeHybridForCausalLM`, model_type granitemoehybrid): Mamba2 + attention, MoE.

`layer_types` lists "mamba" / "attention" per layer (transformers also writes "linear_attention" /
"full_attention"). Every layer:

    x = x + residual_multiplier * mixer(input_layernorm(x))          mixer: `mamba` or `self_attn`
    h = post_attention_layernorm(x)
    x = x + residual_multiplier * (block_sparse_moe(h) + shared_mlp(h))   (shared_mlp only without experts)

Embeddings are scaled by `embedding_multiplier`, attention by `attention_multiplier` (instead of
head_dim^-0.5), logits divided by `logits_scaling`; rope only when `position_embedding_type` is
"rope". MoE: softmax over the top-k router logits; experts stored as one tensor per projection
(`input_linear.weight` [E, 2I, hidden] = gate | up, `output_linear.weight` [E, hidden, I]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, config_value, head_dim_of
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, RMSNorm, RotaryEmbedding, activation
from hybridkv.engine.models.mamba2_mixer import Mamba2Mixer
from hybridkv.engine.models.mamba_hybrid import HybridAttention, prefixed_mamba2_dims
from hybridkv.errors import ConfigError

_TYPES = {"mamba": LINEAR, "linear_attention": LINEAR, "attention": FULL, "full_attention": FULL}


def granite_layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per-layer LINEAR / FULL from `layer_types` (all Mamba2 when absent)."""
    n = int(config_value(config, "num_hidden_layers", required=True))
    types = config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * n
    bad = sorted({str(t) for t in types} - set(_TYPES))
    if bad or len(types) != n:
        raise ConfigError(f"granitemoehybrid layer_types must list one of {sorted(_TYPES)} per layer "
                          f"({n} layers); got {list(types)}")
    return [_TYPES[str(t)] for t in types]


class GraniteSharedMLP(nn.Module):
    """output_linear(act(gate) * up) with gate | up = input_linear(x)."""

    def __init__(self, hidden: int, intermediate: int, *, act: str) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)  # [T, I] each
        return self.output_linear(self.act(gate) * up)  # type: ignore[no-any-return]


class GraniteRouter(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, experts, bias=False)


class ExpertWeights(nn.Module):
    """One stacked weight [experts, out, in] under the HF name `<module>.weight`."""

    def __init__(self, experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, out_features, in_features))


class GraniteMoE(nn.Module):
    """Top-k experts, softmax over the chosen router logits."""

    def __init__(self, hidden: int, intermediate: int, *, experts: int, top_k: int, act: str) -> None:
        super().__init__()
        self.input_linear = ExpertWeights(experts, 2 * intermediate, hidden)  # gate | up
        self.output_linear = ExpertWeights(experts, hidden, intermediate)
        self.router = GraniteRouter(hidden, experts)
        self.top_k, self.act = top_k, activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        top, index = torch.topk(self.router.layer(x).float(), self.top_k, dim=-1)  # [T, k] each
        weight = torch.softmax(top, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            gate, up = (x[token] @ self.input_linear.weight[expert].t()).chunk(2, dim=-1)  # [n, I] each
            y = (self.act(gate) * up) @ self.output_linear.weight[expert].t()  # [n, hidden]
            out.index_add_(0, token, y * weight[token, slot, None])
        return out


class GraniteMoeHybridLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int, *, is_state: bool) -> None:
        super().__init__()
        hidden = int(config_value(config, "hidden_size", required=True))
        eps, act = float(config_value(config, "rms_norm_eps", 1e-6)), str(config.get("hidden_act", "silu"))
        self.slot, self.is_state = layer, is_state
        if is_state:
            self.mamba = Mamba2Mixer(prefixed_mamba2_dims(config))
        else:
            rope = config.get("position_embedding_type") == "rope"
            self.self_attn = HybridAttention(config, layer, rotary_dim=head_dim_of(config) if rope else 0,
                                             bias=bool(config.get("attention_bias", False)),
                                             scale=float(config_value(config, "attention_multiplier", 1.0)))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        experts = int(config_value(config, "num_local_experts", 0))
        self.block_sparse_moe = GraniteMoE(
            hidden, int(config_value(config, "intermediate_size", required=True)), experts=experts,
            top_k=int(config_value(config, "num_experts_per_tok", 1)), act=act) if experts > 0 else None
        self.shared_mlp = GraniteSharedMLP(hidden, int(config_value(config, "shared_intermediate_size", required=True)),
                                           act=act)
        self.residual_multiplier = float(config_value(config, "residual_multiplier", 1.0))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, ctx, self.slot) if self.is_state else self.self_attn(h, rope, cos_sin, ctx)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        mlp = self.shared_mlp(h) if self.block_sparse_moe is None else self.block_sparse_moe(h) + self.shared_mlp(h)
        out: torch.Tensor = x + mlp * self.residual_multiplier
        return out


class GraniteMoeHybridForCausalLM(DecoderForCausalLM):
    """Granite 4.0-H: Mamba2 + attention, shared MLP with optional MoE, muP multipliers."""

    architectures = ("GraniteMoeHybridForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        layer_types = granite_layer_types(config)
        hidden = int(config_value(config, "hidden_size", required=True))
        layers = [GraniteMoeHybridLayer(config, i, is_state=kind == LINEAR) for i, kind in enumerate(layer_types)]
        norm = RMSNorm(hidden, eps=float(config_value(config, "rms_norm_eps", 1e-6)))
        rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=131072)
        super().__init__(config, model=DecoderModel(config, layers, norm=norm), layer_types=layer_types,
                         ropes=dict.fromkeys(layer_types, rope), tied=bool(config.get("tie_word_embeddings", False)))
        self.embedding_multiplier = float(config_value(config, "embedding_multiplier", 1.0))
        self.logits_scaling = float(config_value(config, "logits_scaling", 1.0))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
