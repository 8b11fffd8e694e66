"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type qwen3_next), and the layers Qwen3.5 shares with it.

A hybrid stack: `layer_types` lists "linear_attention" (Gated DeltaNet, a recurrent state) and
"full_attention" (every 4th layer by default). Every layer is

    x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x))     (RMSNorms scale by 1 + w)

Full attention is gated: q_proj yields [T, H, 2*D] = (query | gate) per head; q and k get a
per-head RMSNorm (1 + w) and rope on the first `partial_rotary_factor * D` dims (halves layout);
the attention output is multiplied by sigmoid(gate). The MLP is a sparse MoE (softmax router,
top-k, renormalised when `norm_topk_prob`) plus a shared expert scaled by
sigmoid(shared_expert_gate(x)), on the layers `decoder_sparse_step` picks (outside
`mlp_only_layers`); other layers use a dense gated MLP. Gated DeltaNet uses the fused
projections (`gated_deltanet.FusedProjections`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import ForwardContext, attend, config_value
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.gated_deltanet import FusedProjections, GatedDeltaNet
from hybridkv.engine.models.layers import CosSin, GatedMLP, QKVAttention, RMSNorm, RotaryEmbedding
from hybridkv.errors import ConfigError


def hybrid_layer_types(config: Mapping[str, Any]) -> list[str]:
    """`layer_types`, else linear attention with full attention every `full_attention_interval` layers."""
    layers = int(config_value(config, "num_hidden_layers", required=True))
    if config.get("layer_types"):
        return [str(t) for t in config["layer_types"]]
    interval = int(config.get("full_attention_interval", 4))
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]


def partial_rotary_dim(config: Mapping[str, Any], head_dim: int) -> int:
    """Rotated dims of a head: `partial_rotary_factor` (in `rope_parameters` or top level, default 0.25) * D."""
    params = config.get("rope_parameters")
    factor = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
    factor = factor if factor is not None else config.get("partial_rotary_factor", 0.25)
    return int(head_dim * float(factor))


class GatedAttention(QKVAttention):
    """Full attention with a sigmoid output gate, q/k RMSNorm and partial rope."""

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer, qkv_bias=bias, o_bias=bias)
        hidden = self.q_proj.in_features
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * self.head_dim, bias=bias)  # query | gate per head
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.rotary_dim = partial_rotary_dim(config, self.head_dim)

    def _rotate(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([rope.rotate(x[..., :r], *cos_sin), x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [T, H, D] each
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = self._rotate(self.q_norm(q), rope, cos_sin), self._rotate(self.k_norm(k), rope, cos_sin)
        out = attend(ctx, self.layer, q, k, v, scale=self.scale)  # [T, H*D]
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))  # type: ignore[no-any-return]


class SparseMoeBlock(nn.Module):
    """Routed experts (HF `gate`, `experts.<e>.{gate,up,down}_proj`) plus a gated shared expert."""

    def __init__(self, config: Mapping[str, Any], *, normalize: bool) -> None:
        super().__init__()
        hidden = int(config_value(config, "hidden_size", required=True))
        experts = int(config_value(config, "num_experts", required=True))
        inter = int(config_value(config, "moe_intermediate_size", required=True))
        act = str(config.get("hidden_act", "silu"))
        self.top_k = int(config_value(config, "num_experts_per_tok", required=True))
        self.normalize = normalize
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, inter, act=act) for _ in range(experts))
        shared = int(config_value(config, "shared_expert_intermediate_size", required=True))
        self.shared_expert = GatedMLP(hidden, shared, act=act)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weight, index = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.normalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        weight = weight.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(index).tolist():
            token, slot = torch.nonzero(index == expert, as_tuple=True)  # [n] each
            out.index_add_(0, token, self.experts[expert](x[token]) * weight[token, slot, None])
        shared: torch.Tensor = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + shared


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert names from fused expert tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) as transformers keeps them in memory; per-expert names pass through."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".experts.")
        if leaf == "gate_up_proj":
            for e, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):
                yield f"{prefix}.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}.experts.{e}.up_proj.weight", up
        elif leaf == "down_proj":
            for e, down in enumerate(tensor):
                yield f"{prefix}.experts.{e}.down_proj.weight", down
        else:
            yield name, tensor


class HybridDecoderLayer(nn.Module):
    """`linear_attn` (Gated DeltaNet) or `self_attn` (gated attention), then the MLP; pre-norm, 1 + w norms."""

    narrows_to_sample_rows = True  # see ForwardContext.keep

    def __init__(self, mixer: nn.Module, mlp: nn.Module, *, hidden: int, eps: float) -> None:
        super().__init__()
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, ctx) if hasattr(self, "linear_attn") else self.self_attn(h, rope, cos_sin, ctx)
        x = ctx.keep(x) + ctx.keep(h)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


def build_hybrid_decoder(config: Mapping[str, Any], *, linear: Callable[[Mapping[str, Any], int], GatedDeltaNet],
                         mlp: Callable[[int], nn.Module]) -> tuple[DecoderModel, list[str], RotaryEmbedding]:
    """(model.*, layer types, rope) of a Qwen3-Next / Qwen3.5 text stack; `mlp(i)` builds layer i's MLP."""
    layer_types = hybrid_layer_types(config)
    bad = sorted(set(layer_types) - {FULL, LINEAR})
    if bad:
        raise ConfigError(f"{config.get('model_type')} layer_types has {bad}; expected {FULL!r} or {LINEAR!r}")
    hidden = int(config_value(config, "hidden_size", required=True))
    eps = float(config.get("rms_norm_eps", 1e-6))
    layers = [HybridDecoderLayer(linear(config, i) if kind == LINEAR else GatedAttention(config, i), mlp(i),
                                 hidden=hidden, eps=eps) for i, kind in enumerate(layer_types)]
    head_dim = int(config_value(config, "head_dim", required=True))
    rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=32768,
                                       dim=partial_rotary_dim(config, head_dim))
    model = DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps, unit_offset=True))
    return model, layer_types, rope


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next: Gated DeltaNet (fused projections) + gated full attention, sparse MoE MLPs."""

    architectures = ("Qwen3NextForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        sparse_step = int(config.get("decoder_sparse_step", 1))
        dense_layers = set(config.get("mlp_only_layers") or [])
        experts = int(config.get("num_experts", 0))
        hidden = int(config_value(config, "hidden_size", required=True))
        act = str(config.get("hidden_act", "silu"))

        def mlp(i: int) -> nn.Module:
            if experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0:
                return SparseMoeBlock(config, normalize=bool(config.get("norm_topk_prob", True)))
            return GatedMLP(hidden, int(config_value(config, "intermediate_size", required=True)), act=act)

        model, layer_types, rope = build_hybrid_decoder(config, linear=FusedProjections, mlp=mlp)
        super().__init__(config, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))

    def ignores_weight(self, name: str) -> bool:
        """The tied lm head, and multi-token-prediction weights (`mtp.*`) of released checkpoints."""
        return super().ignores_weight(name) or name.startswith("mtp.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused_experts(weights))
