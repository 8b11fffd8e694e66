"""`admission_headroom`: what a new request's first allocation leaves free for the running ones, by hand.

Groups: full attention and a Mamba state (align mode), block 4; 9 usable blocks. Request a (8
tokens) holds 2 full blocks and 1 state block: 6 free. A new request of 16 tokens needs 4 full
blocks + 1 state block = 5. NONE (vLLM's) admits it; NEXT_BLOCK keeps one block per group (2) free
for a: 5 + 2 > 6, refused. A 12-token request (3 + 1 = 4, + 2 = 6) fits either way.
"""

from __future__ import annotations

import pytest

from hybridkv.engine.config import EngineConfig
from hybridkv.errors import ConfigError
from hybridkv.kvcache.manager import AdmissionHeadroom, KVCacheManager, MambaCacheMode
from hybridkv.kvcache.options import CacheOptions
from tests.factories import make_config, make_group, make_request

GROUPS = [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)]


def manager(headroom: AdmissionHeadroom) -> KVCacheManager:
    return KVCacheManager(make_config(groups=GROUPS, num_blocks=10), max_model_len=64,
        options=CacheOptions(mamba_cache_mode=MambaCacheMode.ALIGN, admission_headroom=headroom))


@pytest.mark.parametrize(("headroom", "admitted"), [(AdmissionHeadroom.NONE, True),
                                                    (AdmissionHeadroom.NEXT_BLOCK, False),
                                                    (AdmissionHeadroom.WAITING_HITS, False)])
def test_a_new_request_leaves_one_block_per_group_for_each_running_one(headroom: AdmissionHeadroom,
                                                                        admitted: bool) -> None:
    m = manager(headroom)
    m.begin_step()
    a = make_request(request_id="a", token_ids=range(8))
    assert m.allocate(a, 8) is not None
    assert m.group_usage() == (2, 1)  # the hand count above
    b = make_request(request_id="b", token_ids=range(100, 116))
    assert (m.allocate(b, 16) is not None) is admitted
    c = make_request(request_id="c", token_ids=range(200, 212))
    # NONE: 1 block left after b, c is refused; NEXT_BLOCK: c's 4 blocks + 2 of headroom = the 6 free
    assert (m.allocate(c, 12) is not None) is not admitted
    m.check_integrity()


def test_the_headroom_never_stops_a_request_that_runs_alone() -> None:
    m = manager(AdmissionHeadroom.NEXT_BLOCK)
    m.begin_step()
    assert m.allocate(make_request(request_id="b", token_ids=range(32)), 32) is not None  # 8 + 1 of 9


def test_a_running_request_grows_into_the_headroom() -> None:
    m = manager(AdmissionHeadroom.NEXT_BLOCK)
    m.begin_step()
    a = make_request(request_id="a", token_ids=range(8))
    b = make_request(request_id="b", token_ids=range(100, 112))
    assert m.allocate(a, 8) is not None and m.allocate(b, 12) is not None  # 3 + 4 blocks held, 2 free
    a.num_computed_tokens = 8
    a.token_ids.extend(range(8, 12))
    assert m.allocate(a, 4) is not None  # its next block: 1 full block and the state after 12 tokens
    assert m.group_usage() == (2 + 1 + 3, 1 + 1 + 1)  # a keeps its checkpoint at 8 (read) and writes a new one
    m.check_integrity()


def test_the_engine_option_is_checked() -> None:
    config = EngineConfig.from_options({"admission_headroom": "next_block"})
    assert config.cache.admission_headroom is AdmissionHeadroom.NEXT_BLOCK
    with pytest.raises(ConfigError, match="admission_headroom must be one of"):
        EngineConfig.from_options({"admission_headroom": "lots"})  # type: ignore[arg-type]
