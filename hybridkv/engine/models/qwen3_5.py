"""Qwen3.5 text, dense and MoE (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`), and the text model of
the multimodal `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`.

The stack is Qwen3-Next's (`qwen3_next.py`: Gated DeltaNet + gated full attention, 1 + w norms)
with two differences: Gated DeltaNet projects with separate `in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a` (`gated_deltanet.SplitProjections`), and every MLP is dense (Qwen3.5)
or every MLP is the sparse MoE with renormalised top-k weights (Qwen3.5-MoE). Rope is
multimodal (mrope) in the checkpoint; for text all three position components are equal, which
makes it the plain partial rope.

A multimodal checkpoint holds the text model under `model.language_model.*` (renamed to
`model.*` on load) beside `model.visual.*` (skipped); its config nests the text config in
`text_config`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.engine.models.base import config_value
from hybridkv.engine.models.decoder import DecoderForCausalLM
from hybridkv.engine.models.gated_deltanet import SplitProjections
from hybridkv.engine.models.layers import GatedMLP
from hybridkv.engine.models.qwen3_next import SparseMoeBlock, build_hybrid_decoder, split_fused_experts
from hybridkv.errors import ConfigError

_WRAPPER_PREFIX = "model.language_model."
_NON_TEXT_PREFIXES = ("model.visual.", "mtp.")


def text_config_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text config: `text_config` of a multimodal wrapper (eos ids and tying inherited), else `config`."""
    text = config.get("text_config")
    if text is None:
        return dict(config)
    if not isinstance(text, Mapping):
        raise ConfigError(f"{config.get('model_type')} config: field 'text_config' must be an object, got {text!r}")
    out = dict(text)
    for key in ("eos_token_id", "tie_word_embeddings"):
        if out.get(key) is None and config.get(key) is not None:
            out[key] = config[key]
    return out


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 text, dense MLPs; also the text model of `Qwen3_5ForConditionalGeneration`."""

    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    moe = False

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = text_config_of(config)
        hidden = int(config_value(text, "hidden_size", required=True))
        act = str(text.get("hidden_act", "silu"))

        def mlp(i: int) -> nn.Module:
            del i
            if self.moe:
                return SparseMoeBlock(text, normalize=True)
            return GatedMLP(hidden, int(config_value(text, "intermediate_size", required=True)), act=act)

        model, layer_types, rope = build_hybrid_decoder(text, linear=SplitProjections, mlp=mlp)
        super().__init__(text, model=model, layer_types=layer_types, ropes=dict.fromkeys(layer_types, rope),
                         tied=bool(text.get("tie_word_embeddings", False)))

    def ignores_weight(self, name: str) -> bool:
        return super().ignores_weight(name) or name.startswith(_NON_TEXT_PREFIXES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Text-only names as is; a multimodal checkpoint's `model.language_model.*` renamed."""

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_WRAPPER_PREFIX):
                    name = "model." + name[len(_WRAPPER_PREFIX):]
                yield name, tensor

        super().load_weights(split_fused_experts(text_weights()))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text: every MLP a sparse MoE with a shared expert."""

    architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    moe = True
