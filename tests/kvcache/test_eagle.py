"""EAGLE / MTP lookahead in the hit rule (`spec_decode=SpecDecode.EAGLE`, vLLM's `use_eagle`).

Ported from vLLM 0.32's tests/v1/core/test_prefix_caching.py with vLLM's expected values:
`test_eagle_enabled_removes_last_block`, `test_eagle_with_partial_blocks` and the first half of
`test_eagle_with_sliding_window` (its second half pops a hash out of vLLM's map directly). Request by
request equality on whole traces (Gemma 3 and a full-attention model, dense and retention 0) is in
`test_simulate_vs_vllm.py`.
"""

from __future__ import annotations

import pytest

from hybridkv.errors import ConfigError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager, SpecDecode
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group


def hit_after_priming(kind: str, num_tokens: int, **group: int) -> int:
    config = make_config(groups=[make_group(kind=kind, block_size=16, **group)], num_blocks=10)
    manager = KVCacheManager(config, max_model_len=8192, options=CacheOptions(spec_decode=SpecDecode.EAGLE))
    first = KVRequest(request_id=RequestId("prime"), token_ids=[0] * num_tokens)
    assert manager.allocate(first, num_tokens, hit=manager.lookup(first)) is not None
    first.num_computed_tokens = num_tokens
    manager.free(first)
    return manager.lookup(KVRequest(request_id=RequestId("eagle"), token_ids=[0] * num_tokens)).num_tokens


def test_eagle_enabled_removes_last_block() -> None:
    assert hit_after_priming("full", 3 * 16) == 16  # 2 blocks match (the last token is recomputed), 1 dropped


def test_eagle_with_partial_blocks() -> None:
    assert hit_after_priming("full", 2 * 16 + 5) == 16


def test_eagle_with_sliding_window() -> None:
    assert hit_after_priming("sliding_window", 2 * 16 + 5, window_tokens=16) == 16


def test_eagle_with_state_groups_or_mixed_block_sizes_is_refused() -> None:
    groups = [make_group(kind="full", block_size=32), make_group(kind="sliding_window", block_size=16,
                                                                 window_tokens=16)]
    with pytest.raises(ConfigError, match="spec_decode=eagle is modelled for"):
        KVCacheManager(make_config(groups=groups), max_model_len=1024,
            options=CacheOptions(spec_decode=SpecDecode.EAGLE))
    with pytest.raises(ConfigError, match=r"got kinds \['full', 'mamba'\]"):
        KVCacheManager(make_config(groups=[make_group(kind="full"), make_group(kind="mamba")]), max_model_len=1024,
            options=CacheOptions(spec_decode=SpecDecode.EAGLE))
