"""The contract every model file implements, and the forward context the runner hands it.

A model is a `torch.nn.Module` built from the HF config dict of its checkpoint, with parameter
names equal to the HF weight names (so `load_weights` is a name-for-name copy). The engine calls:

    model = ModelClass(hf_config).to(dtype)                   # placeholder weights
    model.load_weights(named_tensors)                          # HF names -> parameters
    model.layer_kinds(), model.kv_shared_from                  # checked against the KV cache layout
    hidden = model(input_ids [T], positions [T], ctx)          # [N, hidden]: rows ctx.sample_rows
    logits = model.compute_logits(hidden)                      # [N, vocab]

Attention layers read and write the paged KV cache only through `ForwardContext`: the cache view
of their layer (`kv_cache(layer)`), the metadata of their KV cache group (`metadata(layer)`) and
whether they own their K/V or read another layer's (`writes_kv(layer)`, KV sharing). State
layers (Mamba, Gated DeltaNet) use `state_cache(layer)` and `state_metadata(layer)` instead; the
contract is in `engine/state_layers.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.engine.attention import GroupMetadata, paged_attention, write_kv
from hybridkv.engine.state_layers import StateCache, StateMetadata
from hybridkv.errors import ConfigError
from hybridkv.plan.specs import SpecKind


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardContext:
    """What attention layers need for one step; built by the runner.

    `kv_caches[i]` is layer i's view `[num_blocks, 2, block_size, kv_heads, head_dim]` (a KV-shared
    layer gets its target's view); `layer_group[i]` the KV cache group whose metadata layer i uses.
    State layers: `state_caches[i]` their state views, `state_groups[g]` the step's state metadata
    of group g (`groups[g]` is None for a state group).
    `sample_rows` [N]: the rows of the T tokens whose hidden states the step needs (None: all, in
    order). `narrow` is set in the context the decoder hands its last layer only: a layer that
    declares `narrows_to_sample_rows` then keeps just those rows after its token mixer (`keep`),
    so its MLP runs on N rows instead of T.
    """

    positions: torch.Tensor  # [T] int64 absolute positions
    groups: Sequence[GroupMetadata | None]
    kv_caches: Sequence[torch.Tensor]
    layer_group: Sequence[int]
    kv_shared_from: Mapping[int, int]
    state_caches: Sequence[StateCache | None] = ()
    state_groups: Mapping[int, StateMetadata] = field(default_factory=dict)
    sample_rows: torch.Tensor | None = None
    narrow: bool = False

    def sampled(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] -> its `sample_rows` [N, ...] (x itself when every row is needed)."""
        return x if self.sample_rows is None else x[self.sample_rows]

    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """In the last layer's context: `sampled(x)`; elsewhere x unchanged."""
        return self.sampled(x) if self.narrow else x

    def kv_cache(self, layer: int) -> torch.Tensor:
        return self.kv_caches[layer]

    def metadata(self, layer: int) -> GroupMetadata:
        meta = self.groups[self.layer_group[layer]]
        if meta is None:
            raise RuntimeError(f"internal error: layer {layer} is a state layer and has no attention metadata")
        return meta

    def state_cache(self, layer: int) -> StateCache:
        cache = self.state_caches[layer] if layer < len(self.state_caches) else None
        if cache is None:
            raise RuntimeError(f"internal error: layer {layer} has no state cache (not a state layer in the layout)")
        return cache

    def state_metadata(self, layer: int) -> StateMetadata:
        return self.state_groups[self.layer_group[layer]]

    def writes_kv(self, layer: int) -> bool:
        return layer not in self.kv_shared_from


def attend(
    ctx: ForwardContext,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store layer `layer`'s new K/V (unless it reads another layer's) and attend.

    q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads * D].
    """
    cache = ctx.kv_cache(layer)
    meta = ctx.metadata(layer)
    new_kv = None
    if ctx.writes_kv(layer):
        write_kv(cache, meta, k, v)
        new_kv = (k, v)
    out = paged_attention(q, cache, meta, scale=scale, sinks=sinks, softcap=softcap, new_kv=new_kv)  # [T, H, D]
    return out.flatten(1)  # [T, H*D]


def config_value(config: Mapping[str, Any], key: str, default: Any = None, *, required: bool = False) -> Any:
    """`config[key]`, or `default`; raises ConfigError naming the model type if required and missing."""
    if key in config and config[key] is not None:
        return config[key]
    if required:
        raise ConfigError(f"config.json of model type {config.get('model_type')!r} lacks the required field {key!r}")
    return default


def head_dim_of(config: Mapping[str, Any]) -> int:
    """`head_dim`, else hidden_size // num_attention_heads."""
    heads = int(config_value(config, "num_attention_heads", required=True))
    return int(config_value(config, "head_dim", int(config_value(config, "hidden_size", required=True)) // heads))


class CausalLM(nn.Module, ABC):
    """A decoder-only LM over flattened tokens with paged attention.

    Subclasses set `architectures` (the HF `architectures` names they serve) and implement
    `forward`, `compute_logits` and `layer_kinds`. Parameter names must be the HF weight names.
    Most models start from `decoder.DecoderForCausalLM`, which implements all three.
    """

    architectures: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.hf_config = dict(config)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Hidden states after the final norm of the step's T flattened tokens: rows `ctx.sample_rows`
        [N, hidden] (`ctx.sampled`), all [T, hidden] when it is None."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of the given hidden states [N, hidden] (lm head, soft-capping)."""

    @abstractmethod
    def layer_kinds(self) -> Sequence[SpecKind | None]:
        """The cache kind of each cache slot, as this model computes it: one per decoder layer
        (None: a layer without any cache), then the extra state slots of layers holding
        attention and a state (`ModelSpec.decoder_layer_of`, Falcon-H1)."""

    @property
    def kv_shared_from(self) -> dict[int, int]:
        """Layer -> the earlier layer whose K/V it reads (KV sharing, as this model computes it); empty by default."""
        return {}

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the config (an int or a list), possibly empty."""
        eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)

    def ignores_weight(self, name: str) -> bool:
        """True for checkpoint tensors this model does not use (e.g. a tied lm head)."""
        del name
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters; every parameter must be provided once.

        Raises ConfigError listing missing, unexpected or mis-shaped weights.
        """
        params = dict(self.named_parameters())
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if self.ignores_weight(name):
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if tuple(param.shape) != tuple(tensor.shape):
                raise ConfigError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing or unexpected:
            raise ConfigError(
                f"checkpoint does not match {type(self).__name__}: missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, unexpected {sorted(unexpected)[:8]}"
                f"{' ...' if len(unexpected) > 8 else ''}"
            )
