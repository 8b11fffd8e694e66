"""Nemotron-H (`NemotronHForCausalLM`, model_type nemotron_h): Mamba2, attention, MLP and MoE blocks.

Every block is x + mixer(norm(x)) with one mixer per layer (`layers_block_type`, or the legacy
`hybrid_override_pattern`: M = Mamba2, * = attention, - = MLP, E = MoE). Only Mamba2 and attention
blocks have a cache. Attention has no rope. MLP: down(relu(up(x))^2). MoE: sigmoid router scores
plus a correction bias choose the experts (within the `topk_group` best of `n_group` groups),
the chosen raw scores weight them (normalised when `norm_topk_prob`, times
`routed_scaling_factor`), plus a shared expert. Weights live under `backbone.*`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, config_value
from hybridkv.engine.models.decoder import FULL, LINEAR, MLP, MOE, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, RMSNorm, RopeLayout, RotaryEmbedding, activation
from hybridkv.engine.models.mamba2_mixer import Mamba2Dims, Mamba2Mixer
from hybridkv.engine.models.mamba_hybrid import HybridAttention, time_step_limit
from hybridkv.errors import ConfigError

_PATTERN = {"M": LINEAR, "*": FULL, "-": MLP, "E": MOE}
_TYPES = {"mamba": LINEAR, "linear_attention": LINEAR, "attention": FULL, "full_attention": FULL, "mlp": MLP,
          "moe": MOE}


def nemotron_layer_types(config: Mapping[str, Any]) -> list[str]:
    """Per-layer block type from `layers_block_type` or `hybrid_override_pattern`."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if not types:
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or set(pattern) - set(_PATTERN):
            raise ConfigError(f"nemotron_h needs layers_block_type or a hybrid_override_pattern of "
                              f"{sorted(_PATTERN)}; got {pattern!r}")
        return [_PATTERN[c] for c in pattern]
    bad = sorted({str(t) for t in types} - set(_TYPES))
    if bad:
        raise ConfigError(f"nemotron_h layers_block_type has unknown block types {bad}; expected {sorted(_TYPES)}")
    return [_TYPES[str(t)] for t in types]


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda x: torch.relu(x).square()) if name == "relu2" else activation(name)


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(x))), no gate."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # type: ignore[no-any-return]


class NemotronHRouter(nn.Module):
    def __init__(self, config: Mapping[str, Any], hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts))
        self.top_k = int(config_value(config, "num_experts_per_tok", required=True))
        self.groups = int(config_value(config, "n_group", 1))
        self.top_groups = int(config_value(config, "topk_group", 1))
        self.normalize = bool(config_value(config, "norm_topk_prob", True))
        self.scaling = float(config_value(config, "routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices [T, k], weights [T, k]) for x [T, hidden]."""
        scores = torch.sigmoid(x.float() @ self.weight.float().t())  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        t, e = choice.shape
        per_group = choice.view(t, self.groups, e // self.groups)  # [T, G, E/G]
        group_scores = per_group.topk(min(2, e // self.groups), dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.top_groups, dim=-1).indices, 1.0)
        keep = keep[:, :, None].expand_as(per_group).reshape(t, e).bool()
        index = choice.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1).indices  # [T, k]
        weight = scores.gather(1, index)
        if self.normalize:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return index, weight * self.scaling


class NemotronHMoE(nn.Module):
    """Routed non-gated experts plus a shared expert (`gate`, `experts.<e>`, `shared_experts`)."""

    def __init__(self, config: Mapping[str, Any], hidden: int) -> None:
        super().__init__()
        if config.get("moe_latent_size"):
            raise ConfigError("nemotron_h with moe_latent_size is not supported by the reference engine")
        experts = int(config_value(config, "n_routed_experts", required=True))
        act, bias = str(config_value(config, "mlp_hidden_act", "relu2")), bool(config.get("mlp_bias", False))
        inner = int(config_value(config, "moe_intermediate_size", required=True))
        self.gate = NemotronHRouter(config, hidden, experts)
        self.experts = nn.ModuleList(NemotronHMLP(hidden, inner, act=act, bias=False) for _ in range(experts))
        shared = int(config_value(config, "moe_shared_expert_intermediate_size", required=True))
        self.shared_experts = NemotronHMLP(hidden, shared, act=act, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.gate(x)  # [T, k] each
        out = torch.zeros(x.shape, dtype=torch.float32)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            out.index_add_(0, token, self.experts[expert](x[token]).float() * weight[token, slot, None])
        shared: torch.Tensor = self.shared_experts(x)
        return out.to(x.dtype) + shared


class NemotronHBlock(nn.Module):
    """x + mixer(norm(x)); the mixer is chosen by the block type."""

    def __init__(self, config: Mapping[str, Any], layer: int, kind: str) -> None:
        super().__init__()
        hidden = int(config_value(config, "hidden_size", required=True))
        self.kind, self.slot = kind, layer
        self.norm = RMSNorm(hidden, eps=float(config_value(config, "layer_norm_epsilon", 1e-5)))
        self.mixer: nn.Module
        if kind == LINEAR:
            self.mixer = Mamba2Mixer(nemotron_mamba2_dims(config))
        elif kind == FULL:
            self.mixer = HybridAttention(config, layer, rotary_dim=0, bias=bool(config.get("attention_bias", False)))
        elif kind == MLP:
            self.mixer = NemotronHMLP(hidden, int(config_value(config, "intermediate_size", required=True)),
                                      act=str(config_value(config, "mlp_hidden_act", "relu2")),
                                      bias=bool(config.get("mlp_bias", False)))
        else:
            self.mixer = NemotronHMoE(config, hidden)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h: torch.Tensor = self.norm(x)
        if self.kind == LINEAR:
            h = self.mixer(h, ctx, self.slot)
        elif self.kind == FULL:
            h = self.mixer(h, rope, cos_sin, ctx)
        else:
            h = self.mixer(h)
        return x + h


def nemotron_mamba2_dims(config: Mapping[str, Any]) -> Mamba2Dims:
    heads, head_dim = int(config_value(config, "mamba_num_heads", required=True)), int(config["mamba_head_dim"])
    bias = bool(config.get("use_bias", False))
    return Mamba2Dims(
        hidden=int(config_value(config, "hidden_size", required=True)), intermediate=heads * head_dim,
        num_heads=heads, head_dim=head_dim, n_groups=int(config_value(config, "n_groups", 1)),
        state_size=int(config_value(config, "ssm_state_size", required=True)),
        conv_kernel=int(config_value(config, "conv_kernel", 4)),
        eps=float(config_value(config, "layer_norm_epsilon", 1e-5)), act=str(config.get("mamba_hidden_act", "silu")),
        conv_bias=bool(config.get("use_conv_bias", True)), proj_bias=bias, out_bias=bias,
        time_step_limit=time_step_limit(config),
    )


class NemotronHForCausalLM(DecoderForCausalLM):
    """Nemotron-H: Mamba2 / attention / MLP / MoE blocks under `backbone`."""

    architectures = ("NemotronHForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        layer_types = nemotron_layer_types(config)
        hidden = int(config_value(config, "hidden_size", required=True))
        layers = [NemotronHBlock(config, i, kind) for i, kind in enumerate(layer_types)]
        norm = RMSNorm(hidden, eps=float(config_value(config, "layer_norm_epsilon", 1e-5)))
        model = DecoderModel(config, layers, norm=norm, embed_name="embeddings", norm_name="norm_f")
        rope = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, dim=2, max_positions=1,
                               layout=RopeLayout.HALVES)  # unused: attention blocks have no rope
        super().__init__(config, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)), model_name="backbone")
