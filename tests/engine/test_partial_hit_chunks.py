"""Align-mode chunk stops with partial hits (vLLM 0.32's `_mamba_block_aligned_split`, ported case).

vLLM's test (`tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py`,
`test_mamba_align_split_partial_tail_schedule`): 512-token blocks, a 32-token hash unit, a 10,000
token prompt, a budget of 8,192. vLLM 0.32's split, run on those inputs, cuts 8192, 1536, 256, 16
(the third stops at the prompt's last 32-token boundary, 9984); with partial hits off the last
272 tokens run as one chunk; and a 12,000-token request resumed at 9984 (a partial hit) runs 256
(to the block's end), 1536, 192 (to 11968, its own last boundary), 32. Here the same numbers come
from our scheduler over our manager, the resumed request's hit being a real partial hit.
"""

from __future__ import annotations

import torch

from hybridkv.engine.request import Request
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.scheduler import Scheduler
from tests.factories import make_config, make_group

BLOCK, UNIT, BUDGET = 512, 32, 8192


def _scheduler(unit: int | None) -> Scheduler[Request]:
    groups = [make_group(kind="full", block_size=BLOCK), make_group(kind="mamba", block_size=BLOCK)]
    manager = KVCacheManager(make_config(groups=groups, num_blocks=96), max_model_len=16384,
        options=CacheOptions(prefix_match_unit=unit))
    partial = manager.match_unit.hash_unit_tokens if manager.match_unit.partial_hits else 0
    return Scheduler(manager, max_num_batched_tokens=BUDGET, max_num_seqs=4, align_tokens=BLOCK,
                     partial_unit_tokens=partial)


def _request(seq: int, tokens: list[int]) -> Request:
    return Request(kv=KVRequest(request_id=RequestId(f"r{seq}"), token_ids=list(tokens)), arrival_seq=seq,
                   prompt_len=len(tokens), sampling=SamplingParams(max_tokens=1, eos=EosMode.IGNORE),
                   generator=torch.Generator(), arrival_s=float(seq))


def _chunks(scheduler: Scheduler[Request], request: Request) -> list[int]:
    """The request's prefill chunks, run alone to the end."""
    scheduler.add(request)
    chunks = []
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        for work in out.work:
            chunks.append(work.num_tokens)
            if work.samples:
                work.request.append_token(7, now_s=0.0, max_model_len=16384)
        scheduler.finish_step(out.work)
    return chunks


def test_chunks_stop_at_the_prompts_last_unit_boundary_like_vllm() -> None:
    prompt = torch.randint(3, 1000, (12000,), generator=torch.Generator().manual_seed(0)).tolist()
    scheduler = _scheduler(UNIT)
    assert _chunks(scheduler, _request(0, prompt[:10000])) == [8192, 1536, 256, 16]
    resumed = _request(1, prompt)  # shares all 10,000 tokens: the partial checkpoint at 9984 hits
    assert _chunks(scheduler, resumed) == [256, 1536, 192, 32]
    assert resumed.prefix_hit_tokens == 9984
    assert _chunks(_scheduler(None), _request(0, prompt[:10000])) == [8192, 1536, 272]  # partial hits off
