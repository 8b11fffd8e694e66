"""Scheduler policy against the real KV cache manager (no model): budget, chunking, decode first,
preemption by recompute, and the capacity error."""

from __future__ import annotations

import pytest
import torch

from hybridkv.core.errors import CapacityError
from hybridkv.core.ids import RequestId
from hybridkv.core.kv_cache_manager import KVCacheManager
from hybridkv.core.model_specs import SpecOptions, model_spec_from_config
from hybridkv.core.planner import PlannerOptions, build_kv_cache_config
from hybridkv.core.request import KVRequest
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.engine.scheduler import Scheduler, SchedulerOutput

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
    scheduler = make_scheduler(blocks=64, budget=8)
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
    with pytest.raises(CapacityError, match="cannot get KV cache blocks"):
        scheduler.schedule()
