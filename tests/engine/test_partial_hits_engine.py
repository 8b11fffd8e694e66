"""Partial (sub-block) prefix hits through the engine: a prefix_match_unit of 4 tokens below the
16-token state blocks of the tiny Mamba2 (Bamba) and Gated DeltaNet (Qwen3.5) hybrids.

The first prompt (70 tokens) runs as chunks of 32, 32, 4 and 2 tokens (budget 40): the third
stops at its last 4-token boundary, 68, whose state becomes a partial checkpoint (moved to a copy
before the fourth chunk overwrites it). The second prompt (78 tokens) shares 69: it hits 68 tokens, its
table takes private copies of the attention block and of the state block it ends in (the engine
copies those pages before the forward), and its tokens equal a run without prefix caching.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from tests.engine.conftest import prompts
from tests.engine.mamba_fixtures import mamba_dir  # noqa: F401 (fixture)

GREEDY = SamplingParams(max_tokens=6, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.01)


def _run(path: Path, batch: list[list[int]], **options: Any) -> tuple[list[list[float]], list[int], LLM]:
    """Per prompt (one after the other: the second hits), the logprob of each greedy token."""
    llm = LLM(str(path), **{**OPTIONS, **options})
    outputs = [llm.generate([prompt], GREEDY)[0] for prompt in batch]
    logprobs = [[row[token] for token, row in zip(o.token_ids, o.logprobs, strict=True)] for o in outputs]
    return logprobs, [o.metrics.prefix_hit_tokens for o in outputs], llm


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(abs(x - y) < 1e-4 for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bamba", "qwen3_5"])
def test_partial_hit_copies_blocks_and_keeps_outputs(kind: str, model_dir: Callable[[str], Path],
                                                    mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    path = mamba_dir(kind) if kind == "bamba" else model_dir(kind)
    first, tail = prompts([70, 9], seed=11)
    second = first[:69] + tail
    assert tail[0] != first[69]
    tokens, hits, llm = _run(path, [first, second], prefix_match_unit=4)
    assert llm.manager.match_unit.partial_hits and {g.block_size for g in llm.plan.config.groups} == {16}
    assert hits == [0, 68]
    # copies: the first request's state at 68 (once per state group); the second request's attention
    # block and state block (once per group); and its own partial checkpoint at 76 (its last 4-token
    # boundary, 76 of 78 tokens: once per state group)
    groups = len(llm.plan.config.groups)
    states = sum(g.kind.value == "mamba" for g in llm.plan.config.groups)
    assert llm.manager_stats().block_copies == states + groups + states
    cold, _, _ = _run(path, [first, second], prefix_caching=PrefixCaching.OFF)
    assert _close(tokens, cold)
    whole, whole_hits, _ = _run(path, [first, second])  # hits on the block: 64 tokens
    assert whole_hits == [0, 64] and _close(whole, cold)


@pytest.mark.slow
def test_a_skipped_copy_would_change_the_outputs(mamba_dir: Callable[[str], Path],  # noqa: F811
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: without the page copies the second request reads blocks that hold other
    content (its private copies were another request's blocks), and its logprobs change."""
    path = mamba_dir("bamba")
    first, tail = prompts([70, 9], seed=11)
    second = first[:69] + tail
    cold, _, _ = _run(path, [first, second], prefix_caching=PrefixCaching.OFF)
    from hybridkv.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "copy_blocks", lambda self, copies: None)
    tokens, hits, _ = _run(path, [first, second], prefix_match_unit=4)
    assert hits == [0, 68] and _close(tokens[:1], cold[:1])
    assert max(abs(x - y) for x, y in zip(tokens[1], cold[1], strict=True)) > 0.01
