"""Kimi-Linear (`KimiLinearForCausalLM`, model_type kimi_linear): KDA layers with MLA full attention.

Every layer: x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)). `self_attn`
is MLA without rope on full-attention layers (the latent cache of `deepseek.MLAttention`, k_rope kept
unrotated, as transformers) or Kimi Delta Attention (KDA) on linear-attention layers:

    q, k, v = silu(causal_conv(q_proj(x) | k_proj(x) | v_proj(x)))       # [T, H, D] each, conv state
    g = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)           # [T, H, D] per-channel decay
    beta = sigmoid(b_proj(x))                                              # [T, H]
    S = S * exp(g)[:, :, None];  S += k (beta (v - k S))                   # S [H, D_k, D_v] float32
    o = o_proj(rmsnorm(q S / sqrt(D)) * sigmoid(g_b_proj(g_a_proj(x))))   # q, k L2-normalised

The recurrence runs token by token (transformers' recurrent form; its chunked form is the same sum).
MoE layers (`mlp_layer_types` "sparse", or from `first_k_dense_replace` on) route as DeepSeek-V3 (sigmoid scores,
correction bias, groups) over experts of w1 / w3 / w2, plus shared experts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.engine.models.base import ForwardContext, config_value
from hybridkv.engine.models.decoder import FULL, LINEAR, DecoderForCausalLM, DecoderModel
from hybridkv.engine.models.deepseek import MLAttention, TopkRouter, mix_experts
from hybridkv.engine.models.layers import CosSin, GatedMLP, RMSNorm, RotaryEmbedding
from hybridkv.engine.models.lfm2 import Lfm2MLP
from hybridkv.engine.state_layers import causal_conv, scan_states
from hybridkv.errors import ConfigError


def kimi_layer_types(config: Mapping[str, Any]) -> list[str]:
    """FULL (MLA) or LINEAR (KDA) per layer, from `layer_types` or the hub's 1-based `kda_layers`."""
    n = int(config_value(config, "num_hidden_layers", required=True))
    names = config.get("layer_types")
    if names is None:
        kda = set((config.get("linear_attn_config") or {}).get("kda_layers") or ())
        return [LINEAR if i + 1 in kda else FULL for i in range(n)]
    if len(names) != n or set(names) - {"full_attention", "linear_attention"}:
        raise ConfigError(f"kimi_linear layer_types must list {n} entries 'full_attention' or 'linear_attention', "
                          f"got {names!r}")
    return [FULL if name == "full_attention" else LINEAR for name in names]


def _kda_field(config: Mapping[str, Any], flat: str, hub: str, default: int | None = None) -> int:
    value = config.get(flat, (config.get("linear_attn_config") or {}).get(hub, default))
    if value is None:
        raise ConfigError(f"kimi_linear config: needs {flat!r} (or linear_attn_config.{hub})")
    return int(value)


def _kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k, v, g [B, H, D], beta [B, H], state [B, H, Dk, Dv] -> o [B, H, Dv]."""
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]  # [B, H, Dv]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def _kda_decodes(inputs: Sequence[torch.Tensor], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every decode: inputs [D, ...], states [D, H, Dk, Dv]."""
    q, k, v, g, beta = inputs
    return _kda_step(q, k, v, g, beta, states)


def _kda_scan(inputs: Sequence[torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment of one sequence: inputs [n, ...], state [H, Dk, Dv] -> (o [n, H, Dv], state)."""
    q, k, v, g, beta = inputs
    outs = []
    for i in range(q.shape[0]):
        o, state = _kda_step(q[i], k[i], v[i], g[i], beta[i], state)
        outs.append(o)
    return torch.stack(outs) if outs else q.new_zeros((0, state.shape[0], state.shape[2])), state


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # FLA's form: + eps inside the root


class KimiDeltaAttention(nn.Module):
    """Checkpoint names: q_proj, k_proj, v_proj, q_conv1d, k_conv1d, v_conv1d (weights [H * D, 1, K]), f_a_proj,
    f_b_proj, dt_bias [H * D], A_log [1, 1, H, 1], b_proj, g_a_proj, g_b_proj, o_norm, o_proj."""

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer = layer
        self.heads = _kda_field(config, "linear_num_heads", "num_heads")
        self.head_dim = _kda_field(config, "linear_head_dim", "head_dim")
        kernel = _kda_field(config, "linear_conv_kernel_dim", "short_conv_kernel_size", 4)
        size = self.heads * self.head_dim
        self.q_proj = nn.Linear(hidden, size, bias=False)
        self.k_proj = nn.Linear(hidden, size, bias=False)
        self.v_proj = nn.Linear(hidden, size, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(size, size, kernel, groups=size, bias=False, padding=kernel - 1) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, size, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(size))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, size, bias=False)
        self.o_norm = RMSNorm(self.head_dim, eps=float(config.get("rms_norm_eps", 1e-6)))
        self.o_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], reading and writing the conv and recurrent states of this layer."""
        t, h, d = x.shape[0], self.heads, self.head_dim
        cache, meta = ctx.state_cache(self.layer), ctx.state_metadata(self.layer)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).float()  # [T, 3HD]
        taps = torch.cat([conv.weight[:, 0] for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).float()
        mixed = causal_conv(mixed, cache.conv, meta, taps, None, act=F.silu)  # [T, 3HD]: one conv state
        q, k, v = (part.reshape(t, h, d) for part in torch.split(mixed, h * d, dim=-1))  # [T, H, D] each
        q, k = _l2norm(q) * d**-0.5, _l2norm(k)
        g, beta = self._decay(x), torch.sigmoid(self.b_proj(x).float())  # [T, H, D], [T, H]
        out = scan_states(meta, cache.recurrent, (q, k, v, g, beta),
                          step=_kda_decodes, scan=_kda_scan)  # [T, H, D]
        gate = self.g_b_proj(self.g_a_proj(x)).float().view(t, h, d)
        out = self.o_norm(out) * torch.sigmoid(gate)  # RMSNorm per head, then the sigmoid gate
        return self.o_proj(out.reshape(t, h * d).to(x.dtype))  # type: ignore[no-any-return]


    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay g [T, H, D] float32: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)."""
        h, d = self.heads, self.head_dim
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, h, d)
        return -self.A_log.float().view(h, 1).exp() * F.softplus(g)


def kimi_sparse_layers(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Which layers have a MoE feed-forward: `mlp_layer_types` "sparse", else (the hub form) every layer from
    `first_k_dense_replace` on when `num_experts` is set."""
    kinds = config.get("mlp_layer_types")
    if kinds is not None:
        if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
            raise ConfigError(f"kimi_linear mlp_layer_types must list {num_layers} entries 'dense' or 'sparse', "
                              f"got {kinds!r}")
        return [kind == "sparse" for kind in kinds]
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    first = int(config.get("first_k_dense_replace") or 0)
    return [bool(experts) and i >= first for i in range(num_layers)]


class KimiMoE(nn.Module):
    """Checkpoint names: `gate` (DeepSeek-V3's sigmoid router with correction bias and groups), `experts.<e>` with
    w1 / w3 / w2, `shared_experts` (gate/up/down_proj)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        if (config.get("moe_router_activation_func") or "sigmoid") != "sigmoid":
            raise ConfigError(f"kimi_linear config: moe_router_activation_func "
                              f"{config.get('moe_router_activation_func')!r} is not supported; "
                              f"the engine runs 'sigmoid'")
        experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
        routing = {**config, "n_routed_experts": experts,
                   "num_experts_per_tok": config.get("num_experts_per_token", config.get("num_experts_per_tok")),
                   "n_group": config.get("num_expert_group", config.get("n_group")),
                   "norm_topk_prob": config.get("moe_renormalize", config.get("norm_topk_prob", True))}
        hidden, width = int(config["hidden_size"]), int(config["moe_intermediate_size"])
        self.gate = TopkRouter(routing)
        self.experts = nn.ModuleList(Lfm2MLP(hidden, width) for _ in range(experts))
        shared = int(config.get("num_shared_experts", config.get("n_shared_experts")) or 0)
        act = str(config.get("hidden_act", "silu"))
        self.shared_experts = GatedMLP(hidden, width * shared, act=act) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        index, weight = self.gate(x)  # [T, k] each
        out = mix_experts(x, index, weight, self.experts)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class KimiDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)) (MLA or KDA), then + block_sparse_moe(post_attention_layernorm(x))."""

    def __init__(self, config: Mapping[str, Any], layer: int, *, kind: str, sparse: bool) -> None:
        super().__init__()
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        self.is_state = kind == LINEAR
        self.self_attn: nn.Module = (KimiDeltaAttention(config, layer) if self.is_state
                                     else MLAttention(config, layer, indexer=None, rope=False))
        # the checkpoint names every layer's feed-forward block_sparse_moe, dense ones too
        self.block_sparse_moe: nn.Module = (KimiMoE(config) if sparse else GatedMLP(
            hidden, int(config["intermediate_size"]), act=str(config.get("hidden_act", "silu"))))
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        del rope
        h = self.input_layernorm(x)
        h = self.self_attn(h, ctx) if self.is_state else self.self_attn(h, cos_sin, ctx, None)[0]
        x = x + h
        out: torch.Tensor = x + self.block_sparse_moe(self.post_attention_layernorm(x))
        return out


class KimiLinearForCausalLM(DecoderForCausalLM):
    """Kimi-Linear: KDA + MLA (no rope), dense and MoE feed-forwards."""

    architectures = ("KimiLinearForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        layer_types = kimi_layer_types(config)
        sparse = kimi_sparse_layers(config, len(layer_types))
        hidden, eps = int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6))
        layers = [KimiDecoderLayer(config, i, kind=kind, sparse=sparse[i]) for i, kind in enumerate(layer_types)]
        rope = RotaryEmbedding.from_config(config, default_theta=10000.0, default_max_positions=4096,
                                           dim=int(config["qk_rope_head_dim"]))
        super().__init__(config, model=DecoderModel(config, layers, norm=RMSNorm(hidden, eps=eps)),
                         layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(config.get("tie_word_embeddings", False)))
