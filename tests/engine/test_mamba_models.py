"""The Mamba hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1, Jamba) equal transformers token for token.

One batch of prompts of different lengths runs with a 40-token budget: prefill chunks cross
several 16-token state blocks and end on block boundaries (align mode), later prompts prefill
while earlier ones decode in the same steps, and the log-probabilities of the top tokens agree
with transformers' greedy generate within 2e-3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.plan.specs import SpecKind
from tests.engine.conftest import hf_greedy, prompts
from tests.engine.mamba_fixtures import MAMBA_KINDS, mamba_dir, mamba_hf  # noqa: F401 (fixtures)

NEW_TOKENS = 8
TOLERANCE = 2e-3


@pytest.mark.parametrize("kind", MAMBA_KINDS)
def test_greedy_batch_with_chunked_prefill_matches_transformers(
    kind: str, mamba_dir: Callable[[str], Path], mamba_hf: Callable[[str], Any]  # noqa: F811
) -> None:
    batch = prompts([57, 23, 41])
    llm = LLM(str(mamba_dir(kind)), max_model_len=256, max_num_batched_tokens=40, block_size=4,
              kv_cache_memory_gib=0.01)
    state_groups = [g for g in llm.plan.config.groups if g.kind is SpecKind.MAMBA]
    assert state_groups and all(g.block_size == 16 for g in llm.plan.config.groups)
    outputs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE, logprobs=5))
    for prompt, output in zip(batch, outputs, strict=True):
        expected, reference = hf_greedy(mamba_hf(kind), prompt, NEW_TOKENS)
        assert output.token_ids == expected, kind
        for step, top in enumerate(output.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - float(reference[step, token])) < TOLERANCE, (kind, step, token)


def test_falcon_h1_keeps_its_states_in_the_extra_slots(mamba_dir: Callable[[str], Path]) -> None:  # noqa: F811
    """Falcon-H1's 3 layers cache attention in slots 0-2 and their Mamba2 states in slots 3-5."""
    llm = LLM(str(mamba_dir("falcon_h1")), max_model_len=256, kv_cache_memory_gib=0.01)
    kinds = {g.kind: sorted(g.layer_indices) for g in llm.plan.config.groups}
    assert kinds == {SpecKind.FULL: [0, 1, 2], SpecKind.MAMBA: [3, 4, 5]}
    assert llm.model_spec.decoder_layer_of == {3: 0, 4: 1, 5: 2}
    assert llm.kv_cache_bytes == llm.plan.config.total_bytes  # the engine allocates what the planner planned
    for slot in (3, 4, 5):  # each state slot views its page as conv (K-1, I + 2GN) and recurrent (H, P, N)
        state = llm.runner.state_caches[slot]
        assert state is not None and llm.runner.state_caches[slot - 3] is None
        assert tuple(state.conv.shape[1:]) == (3, 64 + 2 * 2 * 8) and tuple(state.recurrent.shape[1:]) == (4, 16, 8)
        assert state.conv.stride(0) * state.conv.element_size() == llm.plan.config.page_size_bytes
