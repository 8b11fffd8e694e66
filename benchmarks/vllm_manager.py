"""vLLM 0.32's real KV cache manager, built the way vLLM's scheduler builds it (no model, no GPU).

Imported only inside the vLLM venv (`benchmarks/vllm_manager_venv.sh` builds it) by the scripts that
compare our manager with vLLM's: `vllm_manager_timing.py` (times), `vllm_hits_driver.py` (hits
through `hybridkv simulate`'s loop) and `tests/kvcache/vllm_fixtures/generate_vllm_hits.py`
(recorded hits). The facts it encodes, read in vLLM 0.32's `v1/core/sched/scheduler.py`: the
scheduler block size is the lcm of the groups' block sizes, the hash block size the smallest, and
block hashes are sha256 (vLLM's default `prefix_caching_hash_algo`) computed when the request is
made (the engine core's job, not the manager's). Head sizes and dtypes do not change what the
manager does, so every spec uses one head of one float32 value.
"""

from __future__ import annotations

from math import lcm
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)
_SAMPLING = SamplingParams(max_tokens=1 << 20)
_SAMPLING.update_from_generation_config({}, eos_token_id=-1)  # no token ends a request early
_HASHERS: dict[int, Any] = {}


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)


def sliding(block_size: int, window_tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                             sliding_window=window_tokens)


def state(block_size: int, mamba_cache_mode: str) -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((1, 1),), dtypes=(torch.float32,),
                     mamba_cache_mode=mamba_cache_mode)


def config(specs: list[Any], *, num_blocks: int, retention: int | None = None) -> KVCacheConfig:
    """One KV cache group per spec, in order (group i = specs[i])."""
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=retention)


def hash_block_size(cfg: KVCacheConfig) -> int:
    return min(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)


def manager(cfg: KVCacheConfig, *, max_model_len: int, use_eagle: bool = False,
            hash_block: int | None = None) -> KVCacheManager:
    """vLLM's manager; `hash_block` (vLLM's resolved `prefix_match_unit`, `matched_hash_block_size`)
    defaults to the smallest block size."""
    return KVCacheManager(cfg, max_model_len=max_model_len,
                          scheduler_block_size=lcm(*(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)),
                          hash_block_size=hash_block or hash_block_size(cfg), enable_caching=True,
                          use_eagle=use_eagle)


def matched_hash_block_size(cfg: KVCacheConfig, prefix_match_unit: int | None) -> int:
    """The hash block size vLLM's engine core resolves for `prefix_match_unit` (caching on, no DCP)."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    first = cfg.kv_cache_groups[0].kv_cache_spec.block_size
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=first, prefix_match_unit=prefix_match_unit, enable_prefix_caching=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1), kv_transfer_config=None)
    return int(resolve_kv_cache_block_sizes(cfg, vllm_config)[1])


def request(request_id: str, token_ids: list[int], *, hash_block: int) -> Request:
    """A request whose full prompt blocks are hashed now, as vLLM's engine core does."""
    hasher = _HASHERS.get(hash_block)
    if hasher is None:
        hasher = _HASHERS[hash_block] = get_request_block_hasher(hash_block, HASH_FN)
    return Request(request_id=request_id, prompt_token_ids=list(token_ids), sampling_params=_SAMPLING,
                   pooling_params=None, block_hasher=hasher)
