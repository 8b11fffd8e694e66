"""Value-aware eviction and placed checkpoints through the engine: hits may differ, tokens never do."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError
from tests.engine.conftest import prompts

GREEDY = SamplingParams(max_tokens=4, eos=EosMode.IGNORE)
POLICIES: dict[str, dict[str, str]] = {
    "vllm": {"eviction": "lru", "checkpoint_placement": "junction"},
    "value": {"eviction": "value", "checkpoint_placement": "junction"},
    "placed": {"eviction": "value", "checkpoint_placement": "placed"},
    "queue": {"eviction": "lru", "checkpoint_placement": "junction", "queue_order": "cache_aware"},
    "ours": {"eviction": "value", "checkpoint_placement": "placed", "decode_checkpoints": "last",
             "admission_headroom": "next_block", "state_layout": "multi_page", "queue_order": "cache_aware"},
    "ours, fixed state, waiting hits kept": {
        "eviction": "value", "checkpoint_placement": "placed", "decode_checkpoints": "last",
        "admission_headroom": "waiting_hits", "state_layout": "multi_page", "queue_order": "cache_aware",
        "running_state": "fixed"},
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "qwen3_5"])
def test_outputs_are_identical_across_policies(model_dir: Callable[[str], Path], arch: str) -> None:
    # A shared prefix, three branches and a turn extending the first, in a pool small enough to evict.
    shared, *tails = prompts([40, 9, 11, 7, 5], seed=3)
    options: dict[str, Any] = dict(max_model_len=128, max_num_batched_tokens=32, block_size=4,
                                   kv_cache_memory_gib=0.004, max_num_seqs=2)
    outputs = {}
    for name, policy in POLICIES.items():
        llm = LLM(str(model_dir(arch)), **policy, **options)
        first = llm.generate([shared + t for t in tails[:3]], GREEDY, cache_checkpoints=[[40], [], [20, 40]])
        turn = llm.generate([shared + tails[0] + first[0].token_ids + tails[3]], GREEDY)
        outputs[name] = [o.token_ids for o in first + turn]
    assert outputs["value"] == outputs["vllm"]
    assert outputs["placed"] == outputs["vllm"]
    assert outputs["queue"] == outputs["vllm"]
    assert outputs["ours"] == outputs["vllm"]
    assert outputs["ours, fixed state, waiting hits kept"] == outputs["vllm"]
    with pytest.raises(ConfigError, match="cache_checkpoints of prompt 0 must be positive token positions"):
        llm.generate([shared], GREEDY, cache_checkpoints=[[0]])
    with pytest.raises(ConfigError, match="one sequence of positions per prompt"):
        llm.generate([shared], GREEDY, cache_checkpoints=[])


def test_engine_config_names_a_bad_policy() -> None:
    from hybridkv.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="eviction must be one of"):
        EngineConfig.from_options({"eviction": "fifo"})  # type: ignore[arg-type]
    assert EngineConfig.from_options({"eviction": "value"}).cache.eviction.value == "value"  # type: ignore[arg-type]
