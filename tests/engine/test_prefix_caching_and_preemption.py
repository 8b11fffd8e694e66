"""Prefix hits, preemption by recompute and the memory layout, checked through the engine's API."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.plan.specs import SpecKind
from tests.engine.conftest import WINDOW, hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE)


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "llama4", "smollm3"])
def test_shared_prefix_hits_every_group_and_keeps_outputs(
    kind: str, model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = model_dir(kind)
    first, tail = prompts([48, 13], seed=7)
    second = first[:40] + tail
    options: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=32, block_size=4,
                                   kv_cache_memory_gib=0.01)
    cached = LLM(str(path), **options)
    cached.generate([first], GREEDY)
    hit_output = cached.generate([second], GREEDY)[0]
    assert hit_output.metrics.prefix_hit_tokens >= 32
    stats = cached.manager_stats()
    assert all(tokens > 0 for tokens in stats.group_hit_tokens), stats
    uncached = LLM(str(path), prefix_caching=PrefixCaching.OFF, **options)
    cold_output = uncached.generate([second], GREEDY)[0]
    assert cold_output.metrics.prefix_hit_tokens == 0
    assert hit_output.token_ids == cold_output.token_ids == hf_greedy(hf_model(path), second, 8)[0]


@pytest.mark.parametrize("kind", ["gemma3", "llama4"])
def test_preemption_under_a_tiny_budget_keeps_outputs(
    kind: str, model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = model_dir(kind)
    batch = prompts([45, 38, 50, 33, 41], seed=3)
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=24, block_size=4,
              kv_cache_memory_gib=48 * 1024 / 2**30)  # ~48 blocks of 1 KiB shared by all groups
    outputs = llm.generate(batch, SamplingParams(max_tokens=10, eos=EosMode.IGNORE))
    assert llm.stats.preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) == llm.stats.preemptions
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == hf_greedy(hf_model(path), prompt, 10)[0]


def test_gemma3_allocates_exactly_the_planned_bytes_and_windows_stay_bounded(
    model_dir: Callable[[str], Path],
) -> None:
    budget, block = 16, 4
    llm = LLM(str(model_dir("gemma3")), max_model_len=256, max_num_batched_tokens=budget, block_size=block,
              kv_cache_memory_gib=0.01)
    config = llm.plan.config
    assert llm.kv_cache_bytes == config.total_bytes
    for tensor in config.tensors:  # every layer of a tensor views the same bytes
        pointers = {llm.runner.kv_caches[layer].data_ptr() for layer in tensor.shared_by}
        assert len(pointers) == 1
    llm.generate(prompts([150])[0:1], SamplingParams(max_tokens=20, eos=EosMode.IGNORE))
    window_bound = math.ceil((WINDOW - 1 + budget) / block) + 1
    for group, peak in zip(config.groups, llm.stats.peak_group_blocks, strict=True):
        if group.kind is SpecKind.SLIDING_WINDOW:
            assert 0 < peak <= window_bound
        else:
            assert peak == math.ceil(169 / block)  # positions 0..168 computed (150 prompt + 19 decodes)
    assert llm.stats.peak_kv_bytes < llm.stats.peak_uniform_kv_bytes
