"""`KVCacheManager(prefix_match_unit=...)`: hits land where vLLM 0.32 lands them.

Where vLLM keeps hits on the scheduler block (a sliding-window group beside full attention: its
manager cannot look up inside a block), a finer unit changes no hit: the same requests hit the
same tokens as with the option off (hand-derived below; the trace-level comparison with vLLM's
own manager is `benchmarks/bench_hits.py`'s prefix_match_unit runs, recorded in
vllm_fixtures/simulate_hits.json). A unit below a state group's block in align mode makes hits land
inside blocks (partial hits, `test_partial_hits.py`).
"""

from __future__ import annotations

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group, make_request

FULL16 = make_group(kind="full", block_size=16)
SLIDING16 = make_group(kind="sliding", block_size=16, window_tokens=32)


def _hits(unit: int | None) -> list[int]:
    m = KVCacheManager(make_config(groups=[FULL16, SLIDING16], num_blocks=64), max_model_len=256,
        options=CacheOptions(prefix_match_unit=unit))
    hits = []
    prompts = [list(range(40)), [*range(37), 99, 99], [*range(24), 5, 5, 5], list(range(41))]
    for i, tokens in enumerate(prompts):
        request: KVRequest = make_request(request_id=f"r{i}", token_ids=tokens)
        hit = m.lookup(request)
        assert m.allocate(request, request.num_tokens - hit.num_tokens, hit=hit) is not None
        request.num_computed_tokens = request.num_tokens
        m.check_integrity()
        hits.append(hit.num_tokens)
    return hits


def test_finer_keys_beside_a_sliding_window_leave_hits_on_the_block() -> None:
    # 37 shared tokens -> 32 (two 16-token blocks), 24 -> 16, 40 of 41 -> 32: never a multiple of 8 only
    assert _hits(None) == [0, 32, 16, 32]
    assert _hits(8) == _hits(None)
    m = KVCacheManager(make_config(groups=[FULL16, SLIDING16]), max_model_len=256,
        options=CacheOptions(prefix_match_unit=8))
    assert (m.match_unit.hash_unit_tokens, m.match_unit.hit_alignment_tokens) == (8, 16)


def test_a_unit_below_the_state_block_turns_partial_hits_on() -> None:
    groups = [make_group(kind="full", block_size=64), make_group(kind="mamba", block_size=64)]
    m = KVCacheManager(make_config(groups=groups), max_model_len=256, options=CacheOptions(prefix_match_unit=16))
    assert (m.match_unit.hit_alignment_tokens, m.match_unit.partial_hits) == (16, True)  # (test_partial_hits.py)
    # the state block itself is fine (hits on the block, as with the option off)
    same = KVCacheManager(make_config(groups=groups), max_model_len=256, options=CacheOptions(prefix_match_unit=64))
    assert same.match_unit.hit_alignment_tokens == 64


def test_a_unit_the_blocks_do_not_divide_by_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"prefix_match_unit=8 is invalid: with a single KV cache group"):
        KVCacheManager(make_config(groups=[FULL16]), max_model_len=256, options=CacheOptions(prefix_match_unit=8))
    with pytest.raises(ConfigError, match=r"got group block sizes \[16, 16\]"):
        KVCacheManager(make_config(groups=[FULL16, SLIDING16]), max_model_len=256,
            options=CacheOptions(prefix_match_unit=5))


def test_engine_config_checks_the_option() -> None:
    assert EngineConfig.from_options({"prefix_match_unit": 32}).cache.prefix_match_unit == 32
    with pytest.raises(ConfigError, match="prefix_match_unit must be None or a positive integer"):
        EngineConfig.from_options({"prefix_match_unit": 0})
