"""Mamba hybrids on the paged cache: exact prefix hits in both caching modes, the same-step rule,
a negative control, and preemption.

The tiny models have 16-token state blocks; with a 40-token budget a 70-token prompt runs as
chunks of 32 + 32 + 6 tokens in `align` mode (checkpoints after 32 and 64 tokens) and 40 + 30 in
`all` mode (checkpoints at every boundary: 16, 32, 48, 64).
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
from tests.engine.mamba_fixtures import mamba_dir, mamba_hf  # noqa: F401 (fixtures)
from tests.engine.state_checks import assert_corrupted_restore_changes_outputs

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.01)


def _shared_prefix(prefix_tokens: int) -> tuple[list[int], list[int]]:
    first, tail = prompts([70, 13], seed=7)
    return first, first[:prefix_tokens] + tail


def _cold(path: Path, batch: list[list[int]], **options: Any) -> list[list[int]]:
    llm = LLM(str(path), prefix_caching=PrefixCaching.OFF, **{**OPTIONS, **options})
    return [o.token_ids for o in llm.generate(batch, GREEDY)]


@pytest.mark.parametrize(("kind", "mode", "prefix", "expected_hit"), [
    ("bamba", "align", 40, 32),  # the prefix ends mid-block: the hit is the checkpoint before it
    ("bamba", "align", 56, 32),  # boundary 48 was crossed inside a step: no checkpoint there
    ("bamba", "all", 56, 48),  # all mode kept it
    ("bamba", "all", 64, 64),  # a prefix shared up to a boundary hits there
    ("jamba", "align", 64, 64),  # Mamba1
    ("falcon_h1", "all", 40, 32),  # states in the extra cache slots
])
def test_prefix_hit_restores_the_state_checkpoint(
    kind: str, mode: str, prefix: int, expected_hit: int, mamba_dir: Callable[[str], Path],  # noqa: F811
    mamba_hf: Callable[[str], Any],  # noqa: F811
) -> None:
    path = mamba_dir(kind)
    first, second = _shared_prefix(prefix)
    cached = LLM(str(path), mamba_cache_mode=mode, **OPTIONS)
    cached.generate([first], GREEDY)
    hit = cached.generate([second], GREEDY)[0]
    assert hit.metrics.prefix_hit_tokens == expected_hit
    stats = cached.manager_stats()
    assert any(g.kind is SpecKind.MAMBA for g in cached.plan.config.groups)
    assert all(tokens >= expected_hit for tokens in stats.group_hit_tokens)  # every group, the state's too
    assert hit.token_ids == _cold(path, [second])[0] == hf_greedy(mamba_hf(kind), second, 8)[0]


def test_corrupting_the_restored_state_changes_the_outputs(mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    """Negative control: the comparison above fails when the restored Mamba2 state is wrong."""
    first, second = _shared_prefix(40)
    assert_corrupted_restore_changes_outputs(mamba_dir("bamba"), first, second, options=OPTIONS, params=GREEDY,
                                             expected_hit=32)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_requests_of_one_step_never_restore_a_checkpoint_written_in_that_step(
    mode: str, mamba_dir: Callable[[str], Path],  # noqa: F811
) -> None:
    """Two prompts sharing 35 tokens arrive together: the first's checkpoint after 32 tokens is
    cached in step 1, so the second waits and hits it in step 2 (the runner would raise on a
    restore from a block written in the same step); outputs equal the uncached run."""
    path = mamba_dir("bamba")
    first = prompts([40], seed=11)[0]
    batch = [first, [*first[:35], 5, 6, 7]]
    outputs = LLM(str(path), mamba_cache_mode=mode, **{**OPTIONS, "max_num_batched_tokens": 64}).generate(
        batch, GREEDY)
    assert outputs[1].metrics.prefix_hit_tokens == 32
    assert [o.token_ids for o in outputs] == _cold(path, batch, max_num_batched_tokens=64)


def test_preemption_and_resumption_keep_outputs(
    mamba_dir: Callable[[str], Path], mamba_hf: Callable[[str], Any],  # noqa: F811
) -> None:
    """Nemotron-H (Mamba2, attention, MLP and MoE blocks) under memory pressure."""
    batch = prompts([45, 38, 50, 33], seed=3)
    llm = LLM(str(mamba_dir("nemotron_h")), max_model_len=128, max_num_batched_tokens=24, block_size=4,
              kv_cache_memory_gib=20 * 4096 / 2**30)
    outputs = llm.generate(batch, SamplingParams(max_tokens=10, eos=EosMode.IGNORE))
    assert llm.stats.preemptions > 0
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.token_ids == hf_greedy(mamba_hf("nemotron_h"), prompt, 10)[0]
