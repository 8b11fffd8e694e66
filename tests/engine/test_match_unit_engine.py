"""vLLM's prefix_match_unit through the engine: on a layout with a sliding window (Gemma 3 toy:
full + sliding, blocks of 4) a finer unit keys every 2 tokens yet hits still land on the block, as
vLLM 0.32 lands them; tokens never change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from tests.engine.conftest import prompts

GREEDY = SamplingParams(max_tokens=4, eos=EosMode.IGNORE)


@pytest.mark.slow
def test_finer_unit_beside_a_sliding_window_hits_on_the_block(model_dir: Callable[[str], Path]) -> None:
    # B shares A's first 23 tokens, then differs: the hit is 20 (five 4-token blocks), not 22 (the 2-token unit)
    path = model_dir("gemma3")
    first, other = prompts([30, 9], seed=7)
    second = first[:23] + other
    assert other[0] != first[23]
    options: dict[str, Any] = dict(max_model_len=128, max_num_batched_tokens=64, block_size=4,
                                   kv_cache_memory_gib=0.01)
    outputs = {}
    for unit in (None, 2):
        llm = LLM(str(path), prefix_match_unit=unit, **options)
        assert llm.manager.match_unit.hash_unit_tokens == (unit or 4)
        a, b = (llm.generate([p], GREEDY)[0] for p in (first, second))
        outputs[unit] = (a.token_ids, b.token_ids, b.metrics.prefix_hit_tokens)
    assert outputs[2][2] == outputs[None][2] == 20
    assert outputs[2][:2] == outputs[None][:2]
