"""Test factories: build specs, groups, KV cache configs and requests with keyword arguments.

    make_group(kind="sliding", block_size=2, window_tokens=4)
    make_config(groups=[make_group(kind="full"), make_group(kind="mamba")], num_blocks=32)
    make_request(request_id="a", token_ids=[1, 2, 3])
    run_and_free(manager, request, chunk=8)   # look up, prefill in steps until full or refused, free

`kind` accepts a `SpecKind` or its value; "sliding" and "chunked" are short for
"sliding_window" and "chunked_local". Group ids are renumbered by position in `make_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.request import KVRequest, MultiModalFeature
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MambaType, SpecKind

_ALIASES = {"sliding": SpecKind.SLIDING_WINDOW, "chunked": SpecKind.CHUNKED_LOCAL}


def spec_kind(kind: str | SpecKind) -> SpecKind:
    if isinstance(kind, SpecKind):
        return kind
    return _ALIASES.get(kind) or SpecKind(kind)


def make_spec(*, kind: str | SpecKind = "full", window_tokens: int = 0, chunk_tokens: int = 0,
              kv_heads: int = 2, head_dim: int = 8, dtype: str = "float16") -> LayerSpec:
    """A layer spec; a Mamba spec gets a small Gated DeltaNet-like state."""
    resolved = spec_kind(kind)
    if resolved is SpecKind.MAMBA:
        return MambaSpec(mamba_type=MambaType.GATED_DELTANET, shapes=((3, 64), (2, 16, 16)),
                         dtypes=(dtype, "float32"))
    return AttentionSpec(kind=resolved, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         window_tokens=window_tokens, chunk_tokens=chunk_tokens)


def make_group(*, kind: str | SpecKind = "full", block_size: int = 16, window_tokens: int = 0,
               chunk_tokens: int = 0, group_id: int = 0, layer_indices: Sequence[int] = (0,)) -> KVCacheGroupSpec:
    """One KV cache group of `kind` (window / chunk only for sliding / chunked groups)."""
    spec = make_spec(kind=kind, window_tokens=window_tokens, chunk_tokens=chunk_tokens)
    return KVCacheGroupSpec(group_id=group_id, spec=spec, layer_indices=tuple(layer_indices), block_size=block_size)


def make_config(*, groups: Sequence[KVCacheGroupSpec] | None = None, num_blocks: int = 64,
                page_size_bytes: int = 4096, model: str = "toy") -> KVCacheConfig:
    """A KV cache config over `groups` (default: one full-attention group of block size 16)."""
    chosen = list(groups) if groups is not None else [make_group()]
    numbered = tuple(
        dataclasses.replace(g, group_id=i, layer_indices=(i,)) for i, g in enumerate(chosen)
    )
    return KVCacheConfig(model=model, num_blocks=num_blocks, page_size_bytes=page_size_bytes,
                         group_size=1, groups=numbered, tensors=())


def make_request(*, request_id: str = "r", token_ids: Sequence[int] = (), num_computed_tokens: int = 0,
                 cache_salt: str | None = None, lora_name: str | None = None,
                 mm_features: Sequence[MultiModalFeature] = (), num_encoder_tokens: int = 0) -> KVRequest:
    return KVRequest(request_id=RequestId(request_id), token_ids=list(token_ids),
                     num_computed_tokens=num_computed_tokens, cache_salt=cache_salt, lora_name=lora_name,
                     mm_features=tuple(mm_features), num_encoder_tokens=num_encoder_tokens)


def run_and_free(manager: KVCacheManager, request: KVRequest, *, chunk: int) -> None:
    """Look `request` up, compute it `chunk` tokens a step (a step each, `begin_step` between) until it is
    done or the pool refuses a step, then free it: what it computed stays cached."""
    manager.begin_step()
    hit = manager.lookup(request)
    done = hit.num_tokens
    while done < request.num_tokens and manager.allocate(
            request, min(chunk, request.num_tokens - done), hit=hit if done == hit.num_tokens else None) is not None:
        done = request.num_computed_tokens = done + min(chunk, request.num_tokens - done)
        manager.begin_step()
    manager.free(request)
