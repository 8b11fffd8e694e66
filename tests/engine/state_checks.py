"""The negative control every state model's prefix-hit test shares: a wrong restored state shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.plan.planner import KVCacheGroupSpec


def assert_corrupted_restore_changes_outputs(path: Path, first: list[int], second: list[int], *,
                                             options: dict[str, Any], params: SamplingParams,
                                             expected_hit: int) -> None:
    """Run `first`, then `second` (a prefix hit of `expected_hit` tokens) with every restored state block
    overwritten by noise (the recurrent state; the conv state of a model without one, LFM2): its first
    token or logprob must differ from an uncached run's, so the equality tests around it can fail."""
    cached = LLM(str(path), **options)
    cached.generate([first], params)
    generator = torch.Generator().manual_seed(0)

    def corrupt(group: KVCacheGroupSpec, blocks: list[int]) -> None:
        for layer in group.layer_indices:
            state = cached.runner.state_caches[layer]
            assert state is not None
            index = torch.tensor(blocks)
            tensor = state.recurrent if state.recurrent.numel() else state.conv
            tensor[index] = torch.randn(tensor[index].shape, generator=generator)

    cached.runner.states.restore_hook = corrupt
    corrupted = cached.generate([second], params)[0]
    assert corrupted.metrics.prefix_hit_tokens == expected_hit
    cold = LLM(str(path), prefix_caching=PrefixCaching.OFF, **options).generate([second], params)[0]
    (token, logprob), = corrupted.logprobs[0].items()
    (cold_token, cold_logprob), = cold.logprobs[0].items()
    assert corrupted.token_ids != cold.token_ids or token != cold_token or abs(logprob - cold_logprob) > 0.1
