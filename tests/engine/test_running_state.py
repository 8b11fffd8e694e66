"""One running state per request (`running_state=fixed`) in the engine: the same greedy tokens as vLLM's
moving states and as prefix caching off, with hits on prompt and decode checkpoints actually served.

The tiny models' one-page state block is 16 tokens; the multi-page layout keeps 4-token blocks, so a
decode of 8 tokens crosses block boundaries and leaves checkpoints copied out of the running state.
A hit is copied into the running state before the step's forward: skipping that copy (the negative
control) changes the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import BlockCopy, EvictionPolicyName, PrefixCaching, RunningState
from hybridkv.plan.planner import StateLayout
from tests.engine.conftest import prompts
from tests.engine.mamba_fixtures import mamba_dir, mamba_hf  # noqa: F401 (fixtures)

GREEDY = SamplingParams(max_tokens=8, eos=EosMode.IGNORE, logprobs=1)
OPTIONS: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.02)


def _batch() -> list[list[int]]:
    first, tail, other = prompts([70, 13, 9], seed=7)
    return [first, first[:44] + tail, first + other]  # a sibling at 44 tokens; a resend that goes on


def _serve(llm: LLM, batch: Sequence[list[int]]) -> tuple[list[list[Any]], list[int]]:
    """Each prompt after the previous one finished; the third also extends the first's generated tokens.
    Per prompt its tokens and their logprobs (rounded: equal up to float noise), and its hit."""
    tokens: list[list[int]] = []
    out_tokens, hits = [], []
    for i, prompt in enumerate(batch):
        if i == 2:
            prompt = batch[0] + tokens[0] + prompt[len(batch[0]):]  # a next turn: resumes after the first's answer
        out = llm.generate([prompt], GREEDY)[0]
        tokens.append(out.token_ids)
        out_tokens.append([*out.token_ids, *(round(p[t], 3) for p, t in zip(out.logprobs, out.token_ids, strict=True))])
        hits.append(out.metrics.prefix_hit_tokens)
    return out_tokens, hits


def _check(path: Path) -> None:
    batch = _batch()
    cold, _ = _serve(LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS), batch)
    for layout in StateLayout:
        moving_llm = LLM(str(path), state_layout=layout, **OPTIONS)
        fixed_llm = LLM(str(path), state_layout=layout, running_state=RunningState.FIXED, **OPTIONS)
        moving, moving_hits = _serve(moving_llm, batch)
        fixed, fixed_hits = _serve(fixed_llm, batch)
        assert fixed == moving == cold, layout
        # the sibling hits the first prompt's checkpoint; the next turn one left by the first's decode
        # (multi-page: every 4 tokens, so past the 70-token prompt), in both modes alike
        assert fixed_hits == moving_hits and fixed_hits[1] > 0 and fixed_hits[2] > 0, (layout, fixed_hits)
        if layout is StateLayout.MULTI_PAGE:
            assert fixed_hits[2] > 70, fixed_hits
        stats = fixed_llm.manager.stats()
        assert stats.block_copies > 0 and stats.checkpoint_copies > 0, stats
        together = LLM(str(path), state_layout=layout, running_state=RunningState.FIXED, **OPTIONS)
        assert [o.token_ids for o in together.generate(batch[:2], GREEDY)] == [c[:8] for c in cold[:2]]


@pytest.mark.slow
def test_gated_deltanet_fixed_running_state_gives_the_same_tokens(model_dir: Callable[[str], Path]) -> None:
    _check(model_dir("qwen3_5"))


@pytest.mark.slow
def test_mamba2_fixed_running_state_gives_the_same_tokens(mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    _check(mamba_dir("bamba"))


@pytest.mark.slow
def test_without_the_copy_into_the_running_state_tokens_differ(model_dir: Callable[[str], Path]) -> None:
    """Negative control: a hit whose checkpoint is not copied into the running state before the forward
    starts from whatever that block held, and the tokens change."""
    path = model_dir("qwen3_5")
    batch = _batch()
    expected, _ = _serve(LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS), batch[:2])
    llm = LLM(str(path), state_layout=StateLayout.MULTI_PAGE, running_state=RunningState.FIXED, **OPTIONS)
    take = llm.manager.take_pending_copies
    skipped: list[int] = []

    def drop_copies() -> tuple[BlockCopy, ...]:
        copies = take()  # (taken, so their blocks are released as usual) but never run
        skipped.append(len(copies))
        return ()

    llm.manager.take_pending_copies = drop_copies  # type: ignore[method-assign]
    got, hits = _serve(llm, batch[:2])
    assert hits[1] > 0 and sum(skipped) > 0, (hits, skipped)
    assert got[0] == expected[0] and got[1] != expected[1]



@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_adopt_moves_the_next_turns_hit_and_gives_the_same_tokens(
        family: str, model_dir: Callable[[str], Path], mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    """`running_state=adopt` with value eviction: the next turn's hit on the first request's end becomes
    its running state (no copy: counted in `state_adoptions`), and every token equals prefix caching off."""
    path = model_dir(family) if family == "qwen3_5" else mamba_dir(family)
    batch = _batch()
    cold, _ = _serve(LLM(str(path), prefix_caching=PrefixCaching.OFF, **OPTIONS), batch)
    llm = LLM(str(path), state_layout=StateLayout.MULTI_PAGE, running_state=RunningState.ADOPT,
              eviction=EvictionPolicyName.VALUE, **OPTIONS)
    got, hits = _serve(llm, batch)
    assert got == cold
    assert hits[1] > 0 and hits[2] > 70, hits
    assert llm.manager.stats().state_adoptions >= 1
