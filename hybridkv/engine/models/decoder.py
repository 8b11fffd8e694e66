"""The decoder-only LM skeleton the model files share: layer types, the `model.*` stack, its loop, the LM head.

A model file builds its decoder layers and rotary embeddings and hands them to `DecoderForCausalLM`,
which owns the rest under the HF weight names `model.embed_tokens`, `model.layers.<i>`,
`model.norm` and `lm_head`:

    input_ids [T] --embed--> x [T, hidden]                                   (Gemma: x sqrt(hidden))
    x --model.layers[i](x, rope, cos_sin, ctx) for i = 0..L-1--> --model.norm--> hidden [N, hidden]
    hidden [N, hidden] @ (lm_head, or embed_tokens when tied).T --> logits [N, vocab]  (Gemma: soft-cap)

Only the step's sampled rows (`ctx.sample_rows`) leave the stack: a last layer that declares
`narrows_to_sample_rows` drops the other rows right after its token mixer (their MLP is never
computed; the mixer still writes every token's K/V or state), otherwise they are dropped after it.
Layer i gets the rotary embedding of its layer type (one rope may serve several types; NoPE
layers ignore theirs); cos/sin are computed once per distinct rope and step.
Used by Gemma 3, gpt-oss, Llama 4, Llama/Mistral/Qwen2, Qwen3-Next and Qwen3.5 (whose Gated
DeltaNet layers ignore their rope); Gemma 3n has its own loop (AltUp).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import CausalLM, ForwardContext, config_value
from hybridkv.engine.models.layers import CosSin, RotaryEmbedding
from hybridkv.errors import ConfigError
from hybridkv.plan.specs import SpecKind

SLIDING = "sliding_attention"
FULL = "full_attention"
CHUNKED = "chunked_attention"
LINEAR = "linear_attention"  # recurrent-state layers (Gated DeltaNet, Mamba), cached as SpecKind.MAMBA
MLP, MOE = "mlp", "moe"  # layers without any cache (Nemotron-H)
LAYER_TYPE_KINDS: dict[str, SpecKind | None] = {
    FULL: SpecKind.FULL, SLIDING: SpecKind.SLIDING_WINDOW, CHUNKED: SpecKind.CHUNKED_LOCAL, LINEAR: SpecKind.MAMBA,
    MLP: None, MOE: None,
}


def layer_kinds_of(layer_types: Sequence[str]) -> list[SpecKind | None]:
    """The cache kind of each HF layer type (None: no cache); raises ConfigError naming unsupported ones."""
    bad = sorted(set(layer_types) - set(LAYER_TYPE_KINDS))
    if bad:
        raise ConfigError(f"unsupported layer types {bad}; the engine runs {', '.join(LAYER_TYPE_KINDS)}")
    return [LAYER_TYPE_KINDS[t] for t in layer_types]


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), or the logits unchanged when `cap` is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class DecoderModel(nn.Module):
    """HF `model.*`: `embed_tokens` [vocab, hidden], the decoder `layers`, the final `norm`.

    Some checkpoints name the embeddings or the final norm differently (Bamba's `final_layernorm`,
    Nemotron-H's `embeddings` and `norm_f`): `embed_name` / `norm_name` register them under those names.
    """

    def __init__(self, config: Mapping[str, Any], layers: Iterable[nn.Module], *, norm: nn.Module,
                 embed_name: str = "embed_tokens", norm_name: str = "norm") -> None:
        super().__init__()
        vocab = int(config_value(config, "vocab_size", required=True))
        self._embed_name, self._norm_name = embed_name, norm_name
        self.add_module(embed_name, nn.Embedding(vocab, int(config_value(config, "hidden_size", required=True))))
        self.layers = nn.ModuleList(layers)
        self.add_module(norm_name, norm)

    @property
    def embed_tokens(self) -> nn.Embedding:
        module = self._modules.get(self._embed_name)
        if not isinstance(module, nn.Embedding):
            raise AttributeError("embed_tokens")  # not registered yet (nn.Module.add_module probes with hasattr)
        return module

    @property
    def norm(self) -> nn.Module:
        module = self._modules.get(self._norm_name)
        if module is None:
            raise AttributeError("norm")
        return module


class DecoderForCausalLM(CausalLM):
    """embed -> decoder layers -> final norm -> LM head, for layers called as (x, rope, cos_sin, ctx).

    Subclasses set `architectures`, build `model` with their layers, give one rotary embedding per
    layer type and say whether the LM head is tied to the embeddings. They override `embed` or
    `compute_logits` only where their math differs (Gemma 3). Raises ConfigError when `layer_types`
    does not list one supported type per layer. `model_name` is the HF prefix of the stack
    (`backbone` for Nemotron-H).
    """

    def __init__(self, config: Mapping[str, Any], *, model: DecoderModel, layer_types: Sequence[str],
                 ropes: Mapping[str, RotaryEmbedding], tied: bool, model_name: str = "model") -> None:
        super().__init__(config)
        if len(layer_types) != len(model.layers):
            raise ConfigError(f"{config.get('model_type')} layer_types lists {len(layer_types)} entries, "
                              f"expected one per layer (num_hidden_layers = {len(model.layers)})")
        layer_kinds_of(layer_types)
        assert set(layer_types) <= set(ropes), "every layer type needs a rotary embedding"
        self.layer_types = list(layer_types)
        self._model_name = model_name
        self.add_module(model_name, model)
        # decided once: the last layer's class declares whether it keeps only the sampled rows itself
        self._narrows = bool(model.layers and getattr(model.layers[-1], "narrows_to_sample_rows", False))
        self.ropes = dict(ropes)  # layer type -> rope (no weights to load or cast)
        self.tied = tied
        if not tied:
            self.lm_head = nn.Linear(model.embed_tokens.embedding_dim, model.embed_tokens.num_embeddings, bias=False)

    @property
    def model(self) -> DecoderModel:
        module = self._modules.get(self._model_name)
        if not isinstance(module, DecoderModel):
            raise AttributeError("model")  # not registered yet (nn.Module.add_module probes with hasattr)
        return module

    def layer_kinds(self) -> Sequence[SpecKind | None]:
        return layer_kinds_of(self.layer_types)

    def ignores_weight(self, name: str) -> bool:
        return self.tied and name == "lm_head.weight"

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden]."""
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        cos_sin: dict[RotaryEmbedding, CosSin] = {rope: rope.cos_sin(positions) for rope in self.ropes.values()}
        layers = self.model.layers
        last = layers[len(layers) - 1]
        narrows = self._narrows and ctx.sample_rows is not None
        for layer, kind in zip(layers, self.layer_types, strict=True):
            rope = self.ropes[kind]
            x = layer(x, rope, cos_sin[rope], replace(ctx, narrow=True) if narrows and layer is last else ctx)
        return self.model.norm(x if narrows else ctx.sampled(x))  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return hidden @ weight.t()  # [N, vocab]
