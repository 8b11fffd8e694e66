"""`lookup` reports vLLM's shared_prefix_boundary: the longest single-group hit when it is longer
than the hit every group serves (values worked out by hand, as vLLM 0.32's coordinator does)."""

from __future__ import annotations

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.request import KVRequest
from tests.factories import make_config, make_group


def test_the_junction_is_where_full_attention_could_go_on_and_zero_otherwise() -> None:
    groups = [make_group(kind="full"), make_group(kind="mamba")]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=64), max_model_len=1024)
    a = KVRequest(request_id=RequestId("a"), token_ids=list(range(1, 65)))
    manager.begin_step()
    assert manager.allocate(a, 64, hit=manager.lookup(a)) is not None  # one step: the state checkpoint at 64 only
    assert a.shared_prefix_boundary == 0
    a.num_computed_tokens = 64
    manager.free(a)
    manager.begin_step()
    sibling = KVRequest(request_id=RequestId("b"), token_ids=list(range(1, 41)) + [900] * 9)
    assert manager.lookup(sibling).num_tokens == 0 and sibling.shared_prefix_boundary == 32
    resend = KVRequest(request_id=RequestId("c"), token_ids=[*range(1, 65), 7])
    assert manager.lookup(resend).num_tokens == 64 and resend.shared_prefix_boundary == 0
