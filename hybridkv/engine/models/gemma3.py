"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text).

Per layer: sandwich norms around attention and MLP, q/k RMS norms, scale
`query_pre_attn_scalar ** -0.5`. Sliding layers (`layer_types`, or every layer but each
`sliding_window_pattern`-th) use a window of `sliding_window` tokens and their own rope base
(`rope_local_base_freq`, default 10k); full layers use `rope_theta` with optional scaling.
Embeddings are multiplied by sqrt(hidden); logits are soft-capped if the config says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.core.errors import ConfigError
from hybridkv.core.specs import SpecKind
from hybridkv.engine.models.base import CausalLM, ForwardContext, attend, config_value, head_dim_of
from hybridkv.engine.models.layers import GatedMLP, RMSNorm, RopeLayout, RotaryEmbedding, rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"


def gemma3_layer_types(config: Mapping[str, Any]) -> list[str]:
    """`layer_types`, or the legacy pattern: every `sliding_window_pattern`-th layer is full."""
    layers = int(config_value(config, "num_hidden_layers", required=True))
    types = config.get("layer_types")
    if types is None:
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    types = list(types)
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if len(types) != layers or bad:
        raise ConfigError(
            f"gemma3 layer_types must list {layers} entries of {SLIDING!r}/{FULL!r}, got {len(types)} "
            f"entries{' with ' + str(bad) if bad else ''}"
        )
    return types


class Gemma3Attention(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int, *, sliding: bool) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.layer = layer
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config_value(config, "num_key_value_heads", self.num_heads))
        self.head_dim = head_dim_of(config)
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
        self.softcap: float | None = config.get("attn_logit_softcapping")
        self.sliding = sliding

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))  # [T, KVH, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        out = attend(ctx, self.layer, q, k, v, scale=self.scale, softcap=self.softcap)  # [T, H*D]
        return self.o_proj(out)  # type: ignore[no-any-return]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer: int, *, sliding: bool) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = Gemma3Attention(config, layer, sliding=sliding)
        self.mlp = GatedMLP(hidden, int(config["intermediate_size"]),
                            act=str(config.get("hidden_activation") or "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx))
        out: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return out


class Gemma3TextModel(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_types: list[str]) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        self.embed_tokens = nn.Embedding(int(config["vocab_size"]), hidden)
        self.embed_scale = hidden**0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, sliding=t == SLIDING) for i, t in enumerate(layer_types)
        )
        self.norm = RMSNorm(hidden, eps=float(config.get("rms_norm_eps", 1e-6)), unit_offset=True)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text decoder with paged attention."""

    architectures = ("Gemma3ForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__(config)
        if config.get("use_bidirectional_attention"):
            raise ConfigError("gemma3 with use_bidirectional_attention (an encoder) is not a causal LM; "
                              "the engine runs causal decoders only")
        self.layer_types = gemma3_layer_types(config)
        self.window = int(config_value(config, "sliding_window", required=SLIDING in self.layer_types) or 0)
        self.model = Gemma3TextModel(config, self.layer_types)
        self.tied = bool(config.get("tie_word_embeddings", True))
        if not self.tied:
            self.lm_head = nn.Linear(int(config["hidden_size"]), int(config["vocab_size"]), bias=False)
        head_dim = head_dim_of(config)
        max_pos = int(config.get("max_position_embeddings", 131072))
        self.ropes = {
            kind: RotaryEmbedding(
                rope_parameters(config, layer_type=kind, default_theta=1e4 if kind == SLIDING else 1e6),
                dim=head_dim, max_positions=max_pos, layout=RopeLayout.HALVES)
            for kind in sorted(set(self.layer_types))
        }
        self.final_softcap: float | None = config.get("final_logit_softcapping")

    def layer_kinds(self) -> list[SpecKind]:
        return [SpecKind.SLIDING_WINDOW if t == SLIDING else SpecKind.FULL for t in self.layer_types]

    def ignores_weight(self, name: str) -> bool:
        return self.tied and name == "lm_head.weight"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        x = x * torch.tensor(self.model.embed_scale, dtype=x.dtype)
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.ropes.items()}
        for layer, kind in zip(self.model.layers, self.layer_types, strict=True):
            x = layer(x, self.ropes[kind], cos_sin[kind], ctx)
        return self.model.norm(x)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = hidden @ weight.t()  # [N, vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
