"""Kimi-Linear (KDA + MLA without rope, MoE layers) in the engine against transformers: greedy tokens, a
prefix hit that restores a KDA checkpoint, and a negative control.

The tiny model's KDA state (conv 3 x 192 + recurrent 4 x 16 x 16 float32 = 6,400 bytes) next to MLA latents
of 160 bytes per token gives 128-token blocks (vLLM's MLA alignment), so prompts run past 128 tokens: a
64-token budget prefills a 210-token prompt in chunks that cross the block boundary, and the checkpoint
after 128 tokens serves the hit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.plan.specs import SpecKind
from tests.engine.conftest import hf_greedy, prompts
from tests.engine.state_checks import assert_corrupted_restore_changes_outputs

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=512, max_num_batched_tokens=64, block_size=4, kv_cache_memory_gib=0.02)


def _prompts() -> tuple[list[int], list[int]]:
    first, tail = prompts([210, 13], seed=11)
    return first, first[:200] + tail


@pytest.mark.slow
def test_prefix_hit_restores_the_kda_checkpoint_and_matches_transformers(
    model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = model_dir("kimi_linear")
    first, second = _prompts()
    cached = LLM(str(path), **OPTIONS)
    assert {g.block_size for g in cached.plan.config.groups} == {128}
    assert [g.kind for g in cached.plan.config.groups].count(SpecKind.MAMBA) == 3
    assert cached.generate([first], GREEDY)[0].token_ids == hf_greedy(hf_model(path), first, 8)[0]
    hit = cached.generate([second], GREEDY)[0]
    assert hit.metrics.prefix_hit_tokens == 128
    cold = LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS).generate([second], GREEDY)[0]
    assert hit.token_ids == cold.token_ids == hf_greedy(hf_model(path), second, 8)[0]


def test_corrupting_the_restored_kda_state_changes_the_outputs(model_dir: Callable[[str], Path]) -> None:
    """Negative control: the comparison above fails when the restored recurrent state is wrong."""
    first, second = _prompts()
    assert_corrupted_restore_changes_outputs(model_dir("kimi_linear"), first, second, options=OPTIONS, params=GREEDY,
                                             expected_hit=128)
