"""`decode_checkpoints`: which state checkpoints a request's decode leaves cached (align mode), by hand.

Block size 4, a 6-token prompt decoded until 20 tokens are computed: the prompt leaves a checkpoint
at 4 (its chunk ends on the last boundary before the end), decode reaches 8, 12, 16 and 20. EVERY
(vLLM's) keeps all of them; LAST keeps the prompt's and the newest decode checkpoint only (20).
"""

from __future__ import annotations

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.kvcache.events import BlockRemoved, BlockStored, KVEvents
from hybridkv.kvcache.manager import (
    DecodeCheckpoints,
    EvictionPolicyName,
    KVCacheManager,
    MambaCacheMode,
)
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group, make_request

GROUPS = [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)]


def manager(decode: DecodeCheckpoints, eviction: EvictionPolicyName = EvictionPolicyName.LRU,
            retention: int | None = None) -> KVCacheManager:
    return KVCacheManager(make_config(groups=GROUPS, num_blocks=64), max_model_len=64,
        options=CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN, decode_checkpoints=decode, eviction=eviction,
                prefix_cache_retention_interval=retention))


def step(m: KVCacheManager, request: KVRequest, num_new: int) -> None:
    m.begin_step()
    assert m.allocate(request, num_new) is not None
    request.num_computed_tokens += num_new
    m.check_integrity()


def serve_and_finish(m: KVCacheManager) -> None:
    """Prompt range(6) in chunks 4 + 2, then decode one token per step up to 20 tokens."""
    a = make_request(request_id="a", token_ids=range(6))
    m.begin_step()
    assert m.lookup(a).num_tokens == 0
    step(m, a, 4)
    step(m, a, 2)
    for token in range(6, 20):
        a.token_ids.append(token)
        step(m, a, 1)
    m.free(a)
    m.check_integrity()


def hit_of(m: KVCacheManager, tokens: list[int]) -> int:
    m.begin_step()
    return m.lookup(make_request(request_id=f"probe{len(tokens)}", token_ids=tokens)).num_tokens


@pytest.mark.parametrize("eviction", list(EvictionPolicyName))
@pytest.mark.parametrize(("decode", "hits"), [
    (DecodeCheckpoints.EVERY, {5: 4, 10: 8, 14: 12, 17: 16, 20: 20}),
    (DecodeCheckpoints.LAST, {5: 4, 10: 4, 14: 4, 17: 4, 20: 20}),
])
def test_decode_checkpoints_left_cached(decode: DecodeCheckpoints, hits: dict[int, int],
                                        eviction: EvictionPolicyName) -> None:
    m = manager(decode, eviction)
    serve_and_finish(m)
    for length, expected in hits.items():  # a probe sharing `length` tokens, then its own token
        assert hit_of(m, [*range(length), 1000]) == expected, (decode, length)


@pytest.mark.parametrize(("decode", "hits"), [
    (DecodeCheckpoints.EVERY, {5: 4, 10: 8, 14: 8, 17: 16, 20: 16}),
    (DecodeCheckpoints.LAST, {5: 4, 10: 4, 14: 4, 17: 16, 20: 16}),
])
def test_with_sparse_retention_the_newest_cached_decode_checkpoint_stays(decode: DecodeCheckpoints,
                                                                        hits: dict[int, int]) -> None:
    """Retention interval 8 caches the checkpoints at 8 and 16 (and the prompt's at 4), not 12 or 20:
    an uncached decode checkpoint must not drop the cached one before it."""
    m = manager(decode, retention=8)
    serve_and_finish(m)
    for length, expected in hits.items():
        assert hit_of(m, [*range(length), 1000]) == expected, (decode, length)


@pytest.mark.parametrize(("decode", "removed"), [(DecodeCheckpoints.EVERY, []), (DecodeCheckpoints.LAST, [8, 12, 16])])
def test_a_dropped_checkpoint_is_reported_removed(decode: DecodeCheckpoints, removed: list[int]) -> None:
    """The state group's BlockRemoved events name exactly the dropped checkpoints (by their stored hash)."""
    m = KVCacheManager(make_config(groups=GROUPS, num_blocks=64), max_model_len=64,
        options=CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN, decode_checkpoints=decode, events=KVEvents.ON))
    serve_and_finish(m)
    events = m.take_events()
    state_hashes = [h for e in events if isinstance(e, BlockStored) and e.group_id == 1 for h in e.block_hashes]
    dropped = [h for e in events if isinstance(e, BlockRemoved) and e.group_id == 1 for h in e.block_hashes]
    assert len(state_hashes) == 5  # checkpoints after 4, 8, 12, 16 and 20 tokens, in that order
    assert [4 * (state_hashes.index(h) + 1) for h in dropped] == removed


def test_the_engine_option_is_checked() -> None:
    assert EngineConfig.from_options({"decode_checkpoints": "last"}).cache.decode_checkpoints is DecodeCheckpoints.LAST
    with pytest.raises(ConfigError, match="decode_checkpoints must be one of"):
        EngineConfig.from_options({"decode_checkpoints": "some"})  # type: ignore[arg-type]
