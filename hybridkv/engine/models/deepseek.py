"""DeepSeek-V3 and Kimi-K2 (MLA), DeepSeek-V3.2 and GLM-5 (MLA + DSA sparse attention).

One decoder: RMSNorm, multi-head latent attention, dense gated MLP on the first
`first_k_dense_replace` layers, then a sigmoid-routed MoE with group-limited top-k and shared
experts. Attention caches one latent per token (`kv_lora_rank` normed values + `qk_rope_head_dim`
rotated values, one head) and expands it with `kv_b_proj` on read (see `mla_attention`):

    x --q_a_proj, q_a_layernorm--> q_resid --q_b_proj--> q [T, H, nope + rope]       (or q_proj)
    x --kv_a_proj_with_mqa--> kv_nope [T, rank] (kv_a_layernorm), k_rope [T, rope]   -> latent cache
    DSA: indexer(x, q_resid) -> top-k keys per query over the indexer key cache; attention sees only them

Rope: the main attention rotates interleaved pairs and writes them de-interleaved (transformers'
`apply_rotary_pos_emb_interleave`; DeepSeek-V3 with `rope_interleave: false` uses halves); the
DSA indexer rotates halves (DeepSeek-V3.2) or interleaved pairs (GLM-5). GLM-5's "shared" layers
reuse the previous indexer layer's selection (`indexer_types`). Indexer keys live in the extra cache
slots after the decoder layers, in the same KV cache group as the latents (`model_specs_mla`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.mla_attention import dsa_select, mla_attention, write_latent
from hybridkv.engine.models.base import ForwardContext, config_value
from hybridkv.engine.models.decoder import FULL, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.layers import CosSin, GatedMLP, RMSNorm, RotaryEmbedding, rope_parameters
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import IndexerFormat, SpecOptions, model_spec_from_config
from hybridkv.plan.specs import SpecKind

_DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope as transformers writes it: pairs (2i, 2i+1) rotated, output de-interleaved.

    x [T, H, D], cos/sin [T, 1, D/2] -> [evens * cos - odds * sin | odds * cos + evens * sin].
    """
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Halves rope: pairs (i, i + D/2). x [T, H, D] -> [T, H, D]."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def softmax_scale(config: Mapping[str, Any], qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN (DeepSeek's rule)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config, layer_type=None, default_theta=10000.0)
    mscale_all = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all:
        factor = float(params["factor"])
        m = 1.0 if factor <= 1 else 0.1 * float(mscale_all) * math.log(factor) + 1.0
        scale *= m * m
    return float(scale)


def indexer_owners(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Which layers run their own DSA indexer (the others reuse the previous one's selection): the
    layers the KV cache layout gives an indexer cache (`core.model_specs_mla.dsa_indexer_layers`)."""
    spec = model_spec_from_config(config, name="dsa", options=SpecOptions(indexer=IndexerFormat.UNQUANTIZED))
    owners = set(spec.decoder_layer_of.values())
    return [i in owners for i in range(num_layers)]


class DSAIndexer(nn.Module):
    """DeepSeek-V3.2's Lightning Indexer (HF names wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, config: Mapping[str, Any], *, slot: int, rope_dim: int, interleaved: bool) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.slot = slot  # cache slot of this layer's indexer keys
        self.n_heads, self.head_dim = int(config["index_n_heads"]), int(config["index_head_dim"])
        self.topk, self.rope_dim, self.interleaved = int(config["index_topk"]), rope_dim, interleaved
        self.wq_b = nn.Linear(int(config["q_lora_rank"]), self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos_sin: CosSin) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        rotate = rotate_pairs if self.interleaved else rotate_halves
        return torch.cat([rotate(rot, *cos_sin), rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos_sin: CosSin, ctx: ForwardContext,
                layer: int) -> list[torch.Tensor]:
        """Write this step's indexer keys; return per attention call the keys each query keeps."""
        t = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos_sin)  # [T, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x))[:, None, :], cos_sin)[:, 0]  # [T, Di]
        cache, meta = ctx.kv_cache(self.slot), ctx.metadata(layer)
        write_latent(cache, meta, k)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [T, Hi]
        return dsa_select(q, weights, cache, meta, topk=self.topk, scale=self.head_dim**-0.5)


class MLAttention(nn.Module):
    """Multi-head latent attention (HF names q_a_proj, q_a_layernorm, q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), optionally with a DSA indexer."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, indexer: DSAIndexer | None,
                 rope: bool = True) -> None:
        super().__init__()
        self.use_rope = rope  # Kimi-Linear's MLA keeps its rope channels unrotated
        hidden, bias = int(config["hidden_size"]), bool(config.get("attention_bias", False))
        self.layer, self.heads = layer, int(config["num_attention_heads"])
        self.rank, self.rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
        self.nope, self.v_dim = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
        q_rank = config.get("q_lora_rank")
        qk = self.nope + self.rope
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, self.heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, int(q_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_rank), eps=1e-6)
            self.q_b_proj = nn.Linear(int(q_rank), self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(config, qk)
        self.interleaved = bool(config.get("rope_interleave", True)) or config.get("model_type") in _DSA_TYPES
        self.indexer = indexer

    def forward(self, x: torch.Tensor, cos_sin: CosSin, ctx: ForwardContext,
                shared: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """x [T, hidden] -> ([T, hidden], this layer's DSA selection for the next shared layer)."""
        t = x.shape[0]
        q_resid = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(t, self.heads, self.nope + self.rope)  # [T, H, nope + rope]
        kv_nope, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        if self.use_rope:
            rotate = rotate_pairs if self.interleaved else rotate_halves
            q = torch.cat([q[..., : self.nope], rotate(q[..., self.nope :], *cos_sin)], dim=-1)
            k_rope = rotate(k_rope[:, None, :], *cos_sin)[:, 0]  # [T, rope]
        latent = torch.cat([self.kv_a_layernorm(kv_nope), k_rope], dim=-1)  # [T, rank + rope]
        cache, meta = ctx.kv_cache(self.layer), ctx.metadata(self.layer)
        write_latent(cache, meta, latent)
        selected = shared
        if self.indexer is not None:
            assert q_resid is not None, "a DSA layer always has q_lora_rank (checked at construction)"
            selected = self.indexer(x, q_resid, cos_sin, ctx, self.layer)
        out = mla_attention(q, cache, meta, self.kv_b_proj, kv_lora_rank=self.rank, qk_nope_head_dim=self.nope,
                            v_head_dim=self.v_dim, scale=self.scale, selected=selected)  # [T, H, v]
        return self.o_proj(out.flatten(1)), selected


class TopkRouter(nn.Module):
    """Sigmoid scores + correction bias, top-2-sum group choice, top-k experts (HF `mlp.gate`)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        experts, hidden = int(config["n_routed_experts"]), int(config["hidden_size"])
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.top_k, self.groups = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1)
        self.topk_group = int(config.get("topk_group") or 1)
        self.norm = bool(config.get("norm_topk_prob", True))
        self.scaling = float(config.get("routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert index [T, k], weight [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = choice.view(x.shape[0], self.groups, -1)  # [T, G, E/G]
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool()[:, :, None].expand_as(per_group).reshape_as(choice), float("-inf"))
        index = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weight = scores.gather(1, index)
        if self.norm:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return index, weight * self.scaling


class DeepseekMoE(nn.Module):
    """Routed experts (HF `mlp.experts.<e>.{gate,up,down}_proj`) plus `mlp.shared_experts`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, inter = int(config["hidden_size"]), int(config["moe_intermediate_size"])
        act = str(config.get("hidden_act", "silu"))
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(GatedMLP(hidden, inter, act=act) for _ in range(int(config["n_routed_experts"])))
        shared = int(config.get("n_shared_experts") or 0)
        self.shared_experts = GatedMLP(hidden, inter * shared, act=act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.gate(x)  # [T, k] each
        out = mix_experts(x, index, weight, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


def mix_experts(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """x [T, hidden], chosen experts index [T, k] with their weights [T, k] -> the weighted sum [T, hidden]."""
    out = torch.zeros_like(x)
    for e in torch.unique(index).tolist():
        token, slot = (index == e).nonzero(as_tuple=True)
        out.index_add_(0, token, experts[e](x[token]) * weight[token, slot, None].to(x.dtype))
    return out


class DeepseekDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, indexer: DSAIndexer | None) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = MLAttention(config, layer, indexer=indexer)
        dense = layer < int(config.get("first_k_dense_replace") or 0) or not config.get("n_routed_experts")
        self.mlp: nn.Module = (GatedMLP(hidden, int(config["intermediate_size"]), act=str(config.get("hidden_act",
                               "silu"))) if dense else DeepseekMoE(config))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, ctx: ForwardContext,
                shared: list[torch.Tensor] | None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        attn, selected = self.self_attn(self.input_layernorm(x), cos_sin, ctx, shared)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), selected


class DeepseekForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 / Kimi-K2 MLA and DeepSeek-V3.2 / GLM-5 DSA decoders."""

    architectures = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

    def __init__(self, config: Mapping[str, Any]) -> None:
        n = int(config_value(config, "num_hidden_layers", required=True))
        routing = (config.get("scoring_func", "sigmoid"), config.get("topk_method", "noaux_tc"))
        if routing != ("sigmoid", "noaux_tc"):
            raise ConfigError(f"{config.get('model_type')} config: router {routing} is not supported; the engine "
                              f"runs DeepSeek-V3's ('sigmoid', 'noaux_tc')")
        sparse = config.get("model_type") in _DSA_TYPES or config.get("index_topk") is not None
        if sparse and config.get("q_lora_rank") is None:
            raise ConfigError(f"{config.get('model_type')} config: a DSA model needs 'q_lora_rank' (the indexer "
                              f"reads the query latent)")
        owners = indexer_owners(config, n) if sparse else [False] * n
        if sparse and not owners[0]:
            raise ConfigError(f"{config.get('model_type')} config: layer 0 must own an indexer for later layers "
                              f"to share its selection")
        slots = {layer: n + k for k, layer in enumerate(i for i, own in enumerate(owners) if own)}
        rope_dim = int(config["qk_rope_head_dim"])
        interleaved_indexer = config.get("model_type") == "glm_moe_dsa"
        layers = [DeepseekDecoderLayer(config, i, indexer=DSAIndexer(config, slot=slots[i], rope_dim=rope_dim,
                                                                     interleaved=interleaved_indexer)
                                       if i in slots else None) for i in range(n)]
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=4096, dim=rope_dim)
        super().__init__(config, model=DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps)),
                         layer_types=[FULL] * n, ropes={FULL: rope}, tied=bool(config.get("tie_word_embeddings")))
        self.sparse = sparse
        self.num_indexer_slots = len(slots)

    def ignores_weight(self, name: str) -> bool:
        """The tied LM head, and the multi-token-prediction layers after the decoder (`model.layers.<n>`)."""
        parts = name.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            return int(parts[2]) >= len(self.layer_types)
        return super().ignores_weight(name)

    def layer_kinds(self) -> list[SpecKind]:
        """Full attention on every decoder layer and every indexer key slot after them."""
        return [SpecKind.FULL] * (len(self.layer_types) + self.num_indexer_slots)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        cos_sin = self.ropes[FULL].cos_sin(positions)
        selected: list[torch.Tensor] | None = None
        for layer in self.model.layers:
            x, selected = layer(x, cos_sin, ctx, selected)
        return self.model.norm(ctx.sampled(x))  # type: ignore[no-any-return]
