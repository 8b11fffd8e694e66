"""vLLM's prefix_cache_retention_interval through the engine: fewer sliding-window blocks cached,
the hits they cost, and never a different token."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from tests.engine.conftest import prompts

GREEDY = SamplingParams(max_tokens=6, eos=EosMode.IGNORE)


def test_retention_zero_keeps_only_the_replay_tail_and_the_same_tokens(model_dir: Callable[[str], Path]) -> None:
    # Gemma 3 toy: window 8, blocks of 4 (2 blocks per window tail). A's prompt is 48 tokens: with retention 0 the
    # sliding groups keep only blocks 9-10 (before its replay boundary 47 -> 44). B extends A's prompt and its
    # 6 generated tokens: dense retention hits A's whole computed sequence floored to a block (52 tokens); with
    # retention 0 the sliding groups can serve only 44, the hit at the replay boundary.
    path = model_dir("gemma3")
    first, tail = prompts([48, 9], seed=5)
    options: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=64, block_size=4,
                                   kv_cache_memory_gib=0.01)
    outputs = {}
    for retention in (None, 0):
        llm = LLM(str(path), prefix_cache_retention_interval=retention, **options)
        a = llm.generate([first], GREEDY)[0]
        b = llm.generate([first + a.token_ids + tail], GREEDY)[0]
        outputs[retention] = (a.token_ids, b.token_ids, b.metrics.prefix_hit_tokens)
    assert outputs[None][2] == 52 and outputs[0][2] == 44
    assert outputs[None][:2] == outputs[0][:2]
