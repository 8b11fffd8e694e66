"""Queue-aware retention: with value-aware eviction every waiting request's cached prefix is
evicted last, not only the prefix of the queue's head (no model, the simulator's request)."""

from __future__ import annotations

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions, EvictionPolicyName
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.scheduler import RequestStatus, Scheduler
from hybridkv.simulate.simulator import SimRequest
from tests.factories import make_config


def sim_request(seq: int, tokens: list[int], output_tokens: int = 1) -> SimRequest:
    return SimRequest(kv=KVRequest(request_id=RequestId(f"r{seq}"), token_ids=list(tokens)), arrival_seq=seq,
                      prompt_len=len(tokens), output_tokens=output_tokens)


def run_step(scheduler: Scheduler[SimRequest]) -> None:
    out = scheduler.schedule()
    for work in out.work:
        if work.samples:
            request = work.request
            request.kv.token_ids.append(90_000 + request.arrival_seq)
            if request.num_tokens - request.prompt_len >= request.output_tokens:
                request.status = RequestStatus.FINISHED
    scheduler.finish_step(out.work)


def test_every_waiting_prefix_is_evicted_after_the_unwanted_ones() -> None:
    # one full-attention group, block 16, 15 usable blocks, one running request at a time. Three
    # 33-token prompts finish in turn (2 full blocks cached each, released in the order p1, p2, p3);
    # then a long request runs while two requests wait: one extends p1, one p2. LRU order would
    # evict p1, p2, p3; queue-aware retention keeps both waiting prefixes: p3 goes first.
    manager = KVCacheManager(make_config(num_blocks=16), max_model_len=256,
        options=CacheOptions(eviction=EvictionPolicyName.VALUE))
    scheduler: Scheduler[SimRequest] = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=1)
    prompts = [[1000 * p + i for i in range(33)] for p in (1, 2, 3)]
    for seq, prompt in enumerate(prompts):
        request = sim_request(seq, prompt)
        scheduler.add(request)
        run_step(scheduler)
        assert request.status is RequestStatus.FINISHED
    cached = manager.policies.eviction_order(cached_only=True)  # (the eviction order is what is tested)
    assert len(cached) == 6  # p1's two blocks, p2's, p3's: in release order
    p1, p2, p3 = cached[:2], cached[2:4], cached[4:]
    scheduler.add(sim_request(3, list(range(5, 25)), output_tokens=50))
    run_step(scheduler)
    scheduler.add(sim_request(4, [*prompts[0][:32], 7, 7, 7]))
    scheduler.add(sim_request(5, [*prompts[1][:32], 8, 8, 8]))
    run_step(scheduler)
    assert [r.arrival_seq for r in scheduler.waiting] == [4, 5]
    order = manager.policies.eviction_order(cached_only=True)
    assert order[:2] == p3  # no one waits for it
    assert sorted(order[2:]) == sorted(p1 + p2)


def test_waiting_hits_keeps_a_queued_prefix_from_a_new_request_before_it() -> None:
    # one full-attention group, block 16, 6 usable blocks, FCFS. P (32 tokens) is cached (2 free FULL
    # blocks); R runs (2 blocks). A (40 fresh tokens: 3 blocks) is queued just before B, which
    # extends P. Free: P's 2 + 2 empty = 4 = A's 3 + 1 headroom for R: next_block admits A and its
    # blocks evict P, so B hits nothing; waiting_hits keeps P's 2 blocks free too, A waits for R to
    # finish, and B hits all of P.
    from hybridkv.kvcache.manager import AdmissionHeadroom

    hits = {}
    for mode in (AdmissionHeadroom.NEXT_BLOCK, AdmissionHeadroom.WAITING_HITS):
        manager = KVCacheManager(make_config(num_blocks=7), max_model_len=256,
            options=CacheOptions(eviction=EvictionPolicyName.VALUE, admission_headroom=mode))
        scheduler: Scheduler[SimRequest] = Scheduler(manager, max_num_batched_tokens=64, max_num_seqs=4)
        prefix = [2000 + i for i in range(32)]
        first = sim_request(0, [*prefix, 1, 1])
        scheduler.add(first)
        run_step(scheduler)
        assert first.status is RequestStatus.FINISHED
        scheduler.add(sim_request(1, list(range(5, 21)), output_tokens=12))
        run_step(scheduler)
        a, b = sim_request(2, list(range(300, 340))), sim_request(3, [*prefix, 9, 9])
        scheduler.add(a)
        scheduler.add(b)
        while scheduler.has_unfinished:
            run_step(scheduler)
        hits[mode] = (a.prefix_hit_tokens, b.prefix_hit_tokens)
    assert hits == {AdmissionHeadroom.NEXT_BLOCK: (0, 0), AdmissionHeadroom.WAITING_HITS: (0, 32)}
