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

from hybridkv.engine.models.base import ForwardContext, attend, config_value, head_dim_of
from hybridkv.engine.models.decoder import FULL, SLIDING, DecoderForCausalLM, DecoderModel, soft_cap
from hybridkv.engine.models.layers import CosSin, GatedMLP, QKVAttention, RMSNorm, RotaryEmbedding
from hybridkv.errors import ConfigError


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


def gemma_ropes(config: Mapping[str, Any], layer_types: list[str], *, head_dim: int,
                default_max_positions: int) -> dict[str, RotaryEmbedding]:
    """One halves-layout rope per layer type; bases default to 10k (sliding) and 1M (full)."""
    return {
        kind: RotaryEmbedding.from_config(config, layer_type=kind, default_theta=1e4 if kind == SLIDING else 1e6,
                                          default_max_positions=default_max_positions, dim=head_dim)
        for kind in sorted(set(layer_types))
    }


class Gemma3Attention(QKVAttention):
    """Projections, q/k RMS norms before rope, scale query_pre_attn_scalar ** -0.5 (no score soft-capping)."""

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, layer, qkv_bias=bias, o_bias=bias)
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps=eps, unit_offset=True)
        self.scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
        # transformers' Gemma 3 (the reference) never applies `attn_logit_softcapping`, and the
        # released checkpoints leave it null; Gemma 2's soft-capping did not carry over.
        self.softcap: float | None = None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.project(x)  # [T, H, D], [T, KVH, D], [T, KVH, D]
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.rotate(q, *cos_sin), rope.rotate(k, *cos_sin)
        out = attend(ctx, self.layer, q, k, v, scale=self.scale, softcap=self.softcap)  # [T, H*D]
        return self.o_proj(out)  # type: ignore[no-any-return]


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: RMS norms before and after both attention and the MLP."""

    narrows_to_sample_rows = True  # see ForwardContext.keep

    def __init__(self, config: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden = int(config["hidden_size"])
        eps = float(config.get("rms_norm_eps", 1e-6))
        self.self_attn = Gemma3Attention(config, layer)
        self.mlp = GatedMLP(hidden, int(config["intermediate_size"]),
                            act=str(config.get("hidden_activation") or "gelu_pytorch_tanh"))
        self.input_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps=eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)
        x = ctx.keep(x) + self.post_attention_layernorm(ctx.keep(h))
        out: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return out


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text decoder: embeddings scaled by sqrt(hidden), a rope per layer type, soft-capped logits."""

    architectures = ("Gemma3ForCausalLM",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        if config.get("use_bidirectional_attention"):
            raise ConfigError("gemma3 with use_bidirectional_attention (an encoder) is not a causal LM; "
                              "the engine runs causal decoders only")
        layer_types = gemma3_layer_types(config)
        config_value(config, "sliding_window", required=SLIDING in layer_types)  # applied via the KV cache layout
        hidden = int(config_value(config, "hidden_size", required=True))
        layers = [Gemma3DecoderLayer(config, i) for i in range(len(layer_types))]
        norm = RMSNorm(hidden, eps=float(config.get("rms_norm_eps", 1e-6)), unit_offset=True)
        ropes = gemma_ropes(config, layer_types, head_dim=head_dim_of(config), default_max_positions=131072)
        super().__init__(config, model=DecoderModel(config, layers, norm=norm), layer_types=layer_types,
                         ropes=ropes, tied=bool(config.get("tie_word_embeddings", True)))
        self.embed_scale = hidden**0.5
        self.final_softcap: float | None = config.get("final_logit_softcapping")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)  # [T, hidden]
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to x's dtype, as transformers does

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden), self.final_softcap)  # [N, vocab]
