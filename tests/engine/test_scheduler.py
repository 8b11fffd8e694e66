"""Scheduler policy against the real KV cache manager (no model): budget, chunking, decode first,
preemption by recompute, and the capacity error."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.request import FinishReason, Request, RequestStatus
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import CapacityError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.model_specs import SpecOptions, model_spec_from_config
from hybridkv.plan.planner import PlannerOptions, build_kv_cache_config
from hybridkv.scheduling.scheduler import Scheduler, SchedulerOutput

BLOCK = 4
CONFIG = {  # 2 sliding (window 8) + 1 full layer; 1 KiB pages at block size 4
    "model_type": "gemma3_text", "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 16, "hidden_size": 32, "sliding_window": 8, "max_position_embeddings": 256,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
}


def make_scheduler(*, blocks: int, budget: int, max_num_seqs: int = 8) -> Scheduler:
    spec = model_spec_from_config(CONFIG, name="tiny", options=SpecOptions(dtype="float32"))
    page = 2 * BLOCK * 2 * 16 * 4
    kv_config = build_kv_cache_config(spec, PlannerOptions(
        memory_bytes=blocks * page, max_model_len=256, max_num_batched_tokens=budget, block_size=BLOCK))
    manager = KVCacheManager(kv_config, max_model_len=256)
    return Scheduler(manager, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)


def make_request(seq: int, length: int, max_tokens: int = 4) -> Request:
    tokens = torch.randint(3, 100, (length,), generator=torch.Generator().manual_seed(seq)).tolist()
    return Request(kv=KVRequest(request_id=RequestId(f"r{seq}"), token_ids=tokens), arrival_seq=seq,
                   prompt_len=length, sampling=SamplingParams(max_tokens=max_tokens, eos=EosMode.IGNORE),
                   generator=torch.Generator(), arrival_s=float(seq))


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step without a model: sampled requests get token 7."""
    out = scheduler.schedule()
    for work in out.work:
        if work.samples:
            work.request.append_token(7, now_s=0.0, max_model_len=256)
    scheduler.finish_step(out.work)
    return out


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    scheduler = make_scheduler(blocks=64, budget=16)
    request = make_request(0, 50)
    scheduler.add(request)
    chunks = [[(w.start_pos, w.num_tokens) for w in step(scheduler).work] for _ in range(4)]
    assert chunks == [[(0, 16)], [(16, 16)], [(32, 16)], [(48, 2)]]
    assert request.output_ids == [7]


def test_decodes_are_scheduled_before_a_running_prefill() -> None:
    scheduler = make_scheduler(blocks=24, budget=8)
    old, young = make_request(0, 20), make_request(1, 6)
    scheduler.add(young)
    step(scheduler)  # young prefills fully (6 tokens) and samples
    scheduler.add(old)
    step(scheduler)  # young decodes; old takes the remaining 7 tokens of budget
    out = step(scheduler)
    assert [(w.request.request_id, w.num_tokens) for w in out.work] == [("r1", 1), ("r0", 7)]


def test_the_latest_arrived_request_is_preempted_and_recomputed() -> None:
    scheduler = make_scheduler(blocks=20, budget=8)
    first, second = make_request(0, 20, max_tokens=12), make_request(1, 20, max_tokens=12)
    scheduler.add(first)
    scheduler.add(second)
    preempted: list[Request] = []
    while scheduler.has_unfinished:
        preempted.extend(step(scheduler).preempted)
    assert preempted and all(r is second for r in preempted)
    assert second.num_preemptions == len(preempted) and first.num_preemptions == 0
    assert first.status is second.status is RequestStatus.FINISHED
    assert len(second.output_ids) == 12


def test_a_request_that_can_never_fit_raises_capacity_error() -> None:
    scheduler = make_scheduler(blocks=6, budget=64)
    scheduler.add(make_request(0, 60))
    with pytest.raises(CapacityError, match="cannot get KV cache blocks"):  # once the full group fills up
        for _ in range(60):
            step(scheduler)


def run_to_completion(scheduler: Scheduler, max_steps: int = 500) -> list[SchedulerOutput]:
    outs: list[SchedulerOutput] = []
    while scheduler.has_unfinished:
        assert len(outs) < max_steps, "the scheduler did not finish its requests"
        out = step(scheduler)
        assert out.work, "a step scheduled nothing but requests are left"
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        scheduler.manager.check_integrity()
        outs.append(out)
    return outs


def test_a_prompt_whose_budget_sized_chunk_does_not_fit_runs_in_smaller_chunks() -> None:
    # 40 tokens in one chunk need blocks for all 40 in the sliding group too; in 8-token chunks
    # the sliding group holds only its window, so the request fits: no CapacityError.
    assert_fits = make_scheduler(blocks=24, budget=8)
    assert_fits.add(make_request(0, 40))
    run_to_completion(assert_fits)
    scheduler = make_scheduler(blocks=24, budget=64)
    request = make_request(0, 40)
    scheduler.add(request)
    outs = run_to_completion(scheduler)
    assert request.status is RequestStatus.FINISHED and len(request.output_ids) == 4
    chunks = [w.num_tokens for out in outs for w in out.work]
    assert sum(chunks) == 40 + 3 and max(chunks) < 40


def test_a_preempted_victim_returns_its_budget_to_the_request_that_needed_blocks() -> None:
    scheduler = make_scheduler(blocks=20, budget=8)
    old, young = make_request(0, 40, max_tokens=8), make_request(1, 4, max_tokens=8)
    scheduler.add(young)
    step(scheduler)  # young prefills and samples: from now on it decodes, scheduled first
    scheduler.add(old)  # arrived earlier (arrival_seq 0), so young is the preemption victim
    saw_victim = False
    while scheduler.has_unfinished:
        out = step(scheduler)
        scheduler.manager.check_integrity()
        ids = [w.request.request_id for w in out.work]
        assert len(ids) == len(set(ids)) and out.num_tokens <= 8
        if young in out.preempted:
            saw_victim = True
            assert ids == ["r0"]  # the victim's decode was dropped from the step...
            remaining = old.prompt_len - out.work[0].start_pos
            assert out.work[0].num_tokens == min(remaining, 8)  # ...and its token went to the old request
            assert young.status is RequestStatus.WAITING and young.num_computed_tokens == 0
    assert saw_victim
    assert len(old.output_ids) == len(young.output_ids) == 8


def test_max_num_seqs_caps_the_running_requests() -> None:
    scheduler = make_scheduler(blocks=64, budget=64, max_num_seqs=2)
    requests = [make_request(i, 5) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    while scheduler.has_unfinished:
        out = step(scheduler)
        assert len(out.work) <= 2 and len(scheduler.running) <= 2
    assert all(len(r.output_ids) == 4 for r in requests)


def test_a_prompt_fully_in_the_prefix_cache_still_computes_its_last_token() -> None:
    scheduler = make_scheduler(blocks=64, budget=64)
    first = make_request(0, 16, max_tokens=1)
    scheduler.add(first)
    run_to_completion(scheduler)
    again = make_request(1, 16, max_tokens=2)
    again.kv.token_ids[:] = first.kv.token_ids[:16]
    scheduler.add(again)
    (work,) = scheduler.schedule().work
    assert work.start_pos == again.prefix_hit_tokens and 0 < work.start_pos < 16
    assert work.start_pos + work.num_tokens == 16 and work.samples


def test_many_requests_in_a_small_pool_all_finish() -> None:
    scheduler = make_scheduler(blocks=20, budget=16, max_num_seqs=4)
    requests = [make_request(i, 10 + 3 * i, max_tokens=6) for i in range(8)]
    for request in requests:
        scheduler.add(request)
    run_to_completion(scheduler)
    assert all(len(r.output_ids) == 6 for r in requests)


@pytest.mark.parametrize(("sampling", "tokens", "reason", "num_out"), [
    (SamplingParams(max_tokens=5), [9, 1, 9], FinishReason.STOP, 2),  # 1 is the model's EOS
    (SamplingParams(max_tokens=3, eos=EosMode.IGNORE), [1, 1, 1, 1], FinishReason.LENGTH, 3),
    (SamplingParams(max_tokens=5, eos=EosMode.IGNORE, stop_token_ids=(4,)), [1, 4, 9], FinishReason.STOP, 2),
    (SamplingParams(max_tokens=50, eos=EosMode.IGNORE), [9] * 10, FinishReason.MODEL_LENGTH, 4),  # 6 + 4 = 10
])
def test_a_request_stops_at_eos_stop_tokens_max_tokens_or_the_model_length(
    sampling: SamplingParams, tokens: list[int], reason: FinishReason, num_out: int
) -> None:
    request = Request(kv=KVRequest(request_id=RequestId("r"), token_ids=[3] * 6), arrival_seq=0, prompt_len=6,
                      sampling=sampling, generator=torch.Generator(), arrival_s=0.0, eos_token_ids=(1,))
    for token in tokens:
        if request.status is RequestStatus.FINISHED:
            break
        request.append_token(token, now_s=1.0, max_model_len=10)
    assert request.status is RequestStatus.FINISHED and request.finish_reason is reason
    assert len(request.output_ids) == num_out
