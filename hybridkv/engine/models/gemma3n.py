"""Gemma 3n text (`Gemma3nForCausalLM`, model_type gemma3n_text; or the text half of a `gemma3n` config).

Gemma 3n keeps `altup_num_inputs` (n) copies of the residual stream. Each decoder layer runs on the
active copy only; AltUp predicts the copies before the layer and corrects them after it:

    embeddings --AltUp stack--> h [n, T, hidden]
    per layer:  predict(h) --active copy--> input norm --+--> attention --+--> MLP --> correct(h)
                                                         +--> Laurel -----+        (+ per-layer input
                                                                                    on copies 1..n-1)
    h --AltUp unstack (mean of the n copies)--> final norm --> lm head --> soft-capping

Per-layer inputs: a second embedding table (`embed_tokens_per_layer`, one vector of
`hidden_size_per_layer_input` per layer and token) plus a projection of the embeddings feed every
layer a small gated input. The first layers' MLPs keep only the gate activations above a Gaussian
quantile (`activation_sparsity_pattern`).

KV sharing: the last `num_kv_shared_layers` layers have no K/V projections; each attends over the
cache of the last non-shared layer of its attention type (`kv_shared_from`). The runner checks at
startup that this map equals the layout's (`ModelSpec.kv_shared_from`), hands such a layer its
target's cache view, and `attend` does not write it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridkv.engine.attention import paged_attention
from hybridkv.engine.models.base import CausalLM, ForwardContext, attend, config_value
from hybridkv.engine.models.decoder import FULL, SLIDING, layer_kinds_of, soft_cap
from hybridkv.engine.models.gemma3 import gemma_ropes
from hybridkv.engine.models.gemma3n_layers import Gemma3nAltUp, Gemma3nLaurelBlock, Gemma3nMLP, match_magnitude
from hybridkv.engine.models.layers import CosSin, RMSNorm, RotaryEmbedding, activation
from hybridkv.errors import ConfigError
from hybridkv.plan.specs import SpecKind

# The parts of a multimodal `Gemma3nForConditionalGeneration` checkpoint that the text model does not use.
_WRAPPER_PREFIX = "model.language_model."
_NON_TEXT_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_KV_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


def gemma3n_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text config: `text_config` of a `gemma3n` wrapper (with its eos ids), else `config` itself."""
    text = config.get("text_config")
    if text is None:
        return dict(config)
    if not isinstance(text, Mapping):
        raise ConfigError(f"gemma3n config: field 'text_config' must be an object, got {text!r}")
    out = dict(text)
    if out.get("eos_token_id") is None and config.get("eos_token_id") is not None:
        out["eos_token_id"] = config["eos_token_id"]
    return out


def kv_sharing_targets(layer_types: list[str], num_shared: int) -> dict[int, int]:
    """Layer i >= L - num_shared reads the K/V of the last layer before L - num_shared of its type.

    This is transformers' `Gemma3nTextConfig.kv_sharing_modes` ("reuse" layers read what the
    "store" layer of their type kept). Raises ConfigError when a shared type has no such layer.
    """
    first = len(layer_types) - num_shared
    if num_shared == 0:
        return {}
    if first <= 0:
        raise ConfigError(f"gemma3n num_kv_shared_layers = {num_shared} must be smaller than "
                          f"num_hidden_layers = {len(layer_types)}")
    last_of = {kind: i for i, kind in enumerate(layer_types[:first])}
    missing = sorted(set(layer_types[first:]) - set(last_of))
    if missing:
        raise ConfigError(f"gemma3n layers {first}..{len(layer_types) - 1} share KV of types {missing}, "
                          f"but no layer before {first} has that type")
    return {i: last_of[layer_types[i]] for i in range(first, len(layer_types))}


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemma3nSettings:
    """The config fields the model reads, with transformers' `Gemma3nTextConfig` defaults."""

    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    act: str
    layer_types: list[str]
    intermediate: list[int]
    sparsity: list[float]
    window: int
    num_kv_shared: int
    altup_inputs: int
    altup_active: int
    altup_correct_scale: bool
    laurel_rank: int
    per_layer_hidden: int
    per_layer_vocab: int
    bias: bool
    tied: bool
    final_softcap: float | None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def _per_layer(config: Mapping[str, Any], key: str, default: Any, layers: int) -> list[Any]:
    """A per-layer list field that may be given as one value for all layers."""
    value = config.get(key, default)
    values = list(value) if isinstance(value, list | tuple) else [value] * layers
    if len(values) != layers:
        raise ConfigError(f"gemma3n field {key!r} has {len(values)} entries, expected num_hidden_layers = {layers}")
    return values


def _layer_types(config: Mapping[str, Any], layers: int) -> list[str]:
    """`layer_types`, else transformers' default: every 5th layer full, the others sliding."""
    types = config.get("layer_types") or [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(layers)]
    bad = sorted({t for t in types if t not in (SLIDING, FULL)})
    if len(types) != layers or bad:
        raise ConfigError(f"gemma3n layer_types must list {layers} entries of {SLIDING!r}/{FULL!r}, "
                          f"got {len(types)} entries{' with ' + str(bad) if bad else ''}")
    return list(types)


def read_settings(config: Mapping[str, Any]) -> Gemma3nSettings:
    """Parse a gemma3n_text config dict; raises ConfigError naming a missing or invalid field."""
    layers = int(config_value(config, "num_hidden_layers", 35))
    heads = int(config_value(config, "num_attention_heads", 8))
    sparse_default = [0.95] * 10 + [0.0] * (layers - 10) if layers > 10 else [0.0] * layers
    settings = Gemma3nSettings(
        hidden=int(config_value(config, "hidden_size", required=True)),
        vocab=int(config_value(config, "vocab_size", required=True)),
        heads=heads,
        kv_heads=int(config_value(config, "num_key_value_heads", 2)),
        head_dim=int(config_value(config, "head_dim", 256)),
        eps=float(config_value(config, "rms_norm_eps", 1e-6)),
        act=str(config_value(config, "hidden_activation", "gelu_pytorch_tanh")),
        layer_types=_layer_types(config, layers),
        intermediate=[int(v) for v in _per_layer(config, "intermediate_size", 16384, layers)],
        sparsity=[float(v) for v in _per_layer(config, "activation_sparsity_pattern", sparse_default, layers)],
        window=int(config_value(config, "sliding_window", 512)),
        num_kv_shared=int(config_value(config, "num_kv_shared_layers", 15)),
        altup_inputs=int(config_value(config, "altup_num_inputs", 4)),
        altup_active=int(config_value(config, "altup_active_idx", 0)),
        altup_correct_scale=bool(config_value(config, "altup_correct_scale", True)),
        laurel_rank=int(config_value(config, "laurel_rank", 64)),
        per_layer_hidden=int(config_value(config, "hidden_size_per_layer_input", 256)),
        per_layer_vocab=int(config_value(config, "vocab_size_per_layer_input", 262144)),
        bias=bool(config.get("attention_bias", False)),
        tied=bool(config_value(config, "tie_word_embeddings", True)),
        # An explicit null turns soft-capping off; an absent field means transformers' default 30.
        final_softcap=config.get("final_logit_softcapping", 30.0),
    )
    if not 0 <= settings.altup_active < settings.altup_inputs:
        raise ConfigError(f"gemma3n altup_active_idx = {settings.altup_active} must be in "
                          f"0..altup_num_inputs - 1 = {settings.altup_inputs - 1}")
    return settings


class Gemma3nAttention(nn.Module):
    """q/k/v RMS norms (v without scale), rope after the norms, scale 1.0; no K/V weights when shared."""

    def __init__(self, s: Gemma3nSettings, layer: int, *, shares_kv: bool) -> None:
        super().__init__()
        self.layer = layer
        self.shares_kv = shares_kv
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=s.bias)
        self.q_norm = RMSNorm(s.head_dim, eps=s.eps)
        if not shares_kv:
            self.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
            self.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.bias)
            self.k_norm = RMSNorm(s.head_dim, eps=s.eps)
            self.v_norm = RMSNorm(s.head_dim, eps=s.eps, with_weight=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=s.bias)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (already normed) -> [T, hidden]."""
        t = x.shape[0]
        q = rope.rotate(self.q_norm(self.q_proj(x).view(t, self.heads, self.head_dim)), *cos_sin)  # [T, H, D]
        if self.shares_kv:
            # No K/V of its own: read the target layer's cache view, which the runner hands this layer.
            out = paged_attention(q, ctx.kv_cache(self.layer), ctx.metadata(self.layer), scale=1.0)  # [T, H, D]
            return self.o_proj(out.flatten(1))  # type: ignore[no-any-return]
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim))  # [T, KVH, D]
        k = rope.rotate(k, *cos_sin)
        v = self.v_norm(self.v_proj(x).view(t, self.kv_heads, self.head_dim))  # [T, KVH, D]
        return self.o_proj(attend(ctx, self.layer, q, k, v, scale=1.0))  # type: ignore[no-any-return]


class Gemma3nDecoderLayer(nn.Module):
    """One layer on the active AltUp copy, Laurel beside attention, per-layer input into the other copies."""

    def __init__(self, s: Gemma3nSettings, layer: int, *, shares_kv: bool) -> None:
        super().__init__()
        self.active = s.altup_active
        self.correct_scale = s.altup_correct_scale
        self.self_attn = Gemma3nAttention(s, layer, shares_kv=shares_kv)
        self.mlp = Gemma3nMLP(s.hidden, s.intermediate[layer], act=s.act, sparsity=s.sparsity[layer])
        self.input_layernorm = RMSNorm(s.hidden, eps=s.eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, eps=s.eps)
        self.pre_feedforward_layernorm = RMSNorm(s.hidden, eps=s.eps)
        self.post_feedforward_layernorm = RMSNorm(s.hidden, eps=s.eps)
        self.altup = Gemma3nAltUp(s.hidden, num_inputs=s.altup_inputs, active=s.altup_active, eps=s.eps)
        self.laurel = Gemma3nLaurelBlock(s.hidden, rank=s.laurel_rank, eps=s.eps)
        self.per_layer_input_gate = nn.Linear(s.hidden, s.per_layer_hidden, bias=False)
        self.per_layer_projection = nn.Linear(s.per_layer_hidden, s.hidden, bias=False)
        self.post_per_layer_input_norm = RMSNorm(s.hidden, eps=s.eps)
        self.act = activation(s.act)

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor, rope: RotaryEmbedding, cos_sin: CosSin,
                ctx: ForwardContext) -> torch.Tensor:
        """h [n, T, hidden], per_layer_input [T, per_layer_hidden] -> [n, T, hidden]."""
        predictions = self.altup.predict(h)  # [n, T, hidden]
        active = predictions[self.active]  # [T, hidden]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)  # [T, hidden]
        attn = self.post_attention_layernorm(self.self_attn(normed, rope, cos_sin, ctx))
        x = (active + attn + laurel) / math.sqrt(2)  # [T, hidden]
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        corrected = self.altup.correct(predictions, x)  # [n, T, hidden]
        first = corrected[self.active]  # [T, hidden]
        if self.correct_scale:
            first = self.altup.scale_corrected_output(first)
        gated = self.act(self.per_layer_input_gate(first)) * per_layer_input  # [T, per_layer_hidden]
        update = self.post_per_layer_input_norm(self.per_layer_projection(gated))  # [T, hidden]
        # transformers adds the update to copies 1..n-1 whatever the active index is.
        return torch.cat([corrected[:1], corrected[1:] + update], dim=0)  # [n, T, hidden]


class Gemma3nTextModel(nn.Module):
    """Embeddings, per-layer inputs, AltUp stack/unstack and the decoder layers (HF `model.*` names)."""

    def __init__(self, s: Gemma3nSettings, shared: Mapping[int, int]) -> None:
        super().__init__()
        self.s = s
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.embed_tokens_per_layer = nn.Embedding(s.per_layer_vocab, s.num_layers * s.per_layer_hidden)
        self.per_layer_model_projection = nn.Linear(s.hidden, s.num_layers * s.per_layer_hidden, bias=False)
        self.per_layer_projection_norm = RMSNorm(s.per_layer_hidden, eps=s.eps)
        self.altup_projections = nn.ModuleList(
            nn.Linear(s.hidden, s.hidden, bias=False) for _ in range(1, s.altup_inputs))
        self.altup_unembed_projections = nn.ModuleList(
            nn.Linear(s.hidden, s.hidden, bias=False) for _ in range(1, s.altup_inputs))
        self.layers = nn.ModuleList(
            Gemma3nDecoderLayer(s, i, shares_kv=i in shared) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden, eps=s.eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, hidden] scaled by sqrt(hidden)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        return x * torch.tensor(self.s.hidden**0.5, dtype=x.dtype)  # type: ignore[no-any-return]

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(token's per-layer embedding + projected embedding) / sqrt(2): [T, layers, per_layer_hidden]."""
        s, t = self.s, x.shape[0]
        in_table = (input_ids >= 0) & (input_ids < s.per_layer_vocab)  # ids past the table read row 0
        table: torch.Tensor = self.embed_tokens_per_layer(torch.where(in_table, input_ids, 0))  # [T, L*P]
        table = table * torch.tensor(s.per_layer_hidden**0.5, dtype=x.dtype)
        table = table.view(t, s.num_layers, s.per_layer_hidden)  # [T, L, P]
        proj = self.per_layer_model_projection(x) * torch.tensor(s.hidden**-0.5, dtype=x.dtype)  # [T, L*P]
        proj = proj.view(t, s.num_layers, s.per_layer_hidden)  # [T, L, P]
        normed: torch.Tensor = self.per_layer_projection_norm(proj)  # [T, L, P]
        return (normed + table) * torch.rsqrt(torch.tensor(2.0)).to(x.dtype)  # [T, L, P]

    def altup_stack(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> n copies [n, T, hidden]: x and its projections rescaled to x's RMS."""
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5  # [T, 1]
        copies = [x] + [match_magnitude(proj(x), target) for proj in self.altup_projections]
        return torch.stack(copies, dim=0)  # [n, T, hidden]

    def altup_unstack(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, T, hidden] -> [T, hidden]: mean of copy 0 and the unembedded copies at copy 0's RMS."""
        target = torch.mean(h[0] ** 2, dim=-1, keepdim=True) ** 0.5  # [T, 1]
        copies = [h[0]] + [match_magnitude(proj(h[i + 1]), target)
                           for i, proj in enumerate(self.altup_unembed_projections)]
        return torch.stack(copies, dim=0).mean(dim=0)  # [T, hidden]


class Gemma3nForCausalLM(CausalLM):
    """Gemma 3n text decoder with paged attention and KV sharing."""

    architectures = ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration")

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = gemma3n_text_config(config)
        super().__init__(text)
        self.settings = s = read_settings(text)
        self.wrapped = "text_config" in config
        self._kv_shared_from = kv_sharing_targets(s.layer_types, s.num_kv_shared)
        self.model = Gemma3nTextModel(s, self._kv_shared_from)
        if not s.tied:
            self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)
        self.ropes = gemma_ropes(text, s.layer_types, head_dim=s.head_dim, default_max_positions=32768)

    def layer_kinds(self) -> list[SpecKind | None]:
        return layer_kinds_of(self.settings.layer_types)

    @property
    def kv_shared_from(self) -> dict[int, int]:
        """Shared layer -> the layer whose K/V it reads (transformers' rule, `kv_sharing_targets`)."""
        return dict(self._kv_shared_from)

    def ignores_weight(self, name: str) -> bool:
        """The tied lm head, and K/V weights of shared layers (real checkpoints ship them unused)."""
        if name == "lm_head.weight":
            return self.settings.tied
        parts = name.split(".")  # model.layers.<i>.self_attn.<k_proj|...>.weight
        return (len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in _KV_WEIGHTS and int(parts[2]) in self._kv_shared_from)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Text-only names as is; a multimodal checkpoint's `model.language_model.*` renamed, towers skipped."""

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_NON_TEXT_PREFIXES):
                    continue
                if name.startswith(_WRAPPER_PREFIX):
                    name = "model." + name[len(_WRAPPER_PREFIX):]
                yield name, tensor

        super().load_weights(text_weights())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m = self.model
        x = m.embed(input_ids)  # [T, hidden]
        per_layer = m.per_layer_inputs(input_ids, x)  # [T, L, P]
        h = m.altup_stack(x)  # [n, T, hidden]
        cos_sin = {kind: rope.cos_sin(positions) for kind, rope in self.ropes.items()}
        for i, (layer, kind) in enumerate(zip(m.layers, self.settings.layer_types, strict=True)):
            h = layer(h, per_layer[:, i], self.ropes[kind], cos_sin[kind], ctx)
        return m.norm(ctx.sampled(m.altup_unstack(h)))  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.settings.tied else self.lm_head.weight
        return soft_cap(hidden @ weight.t(), self.settings.final_softcap)  # [N, vocab]
