"""Our engine's greedy outputs equal transformers' for every supported architecture.

Prompts are longer than the window (8) and the chunk (16), of different lengths, run in one
batch with chunked prefill (a 40-token budget splits the longer prompts and exercises query
tiles), and the log-probabilities of the top tokens agree within 2e-3. The Gated DeltaNet
hybrids (16-token state blocks) run the same batch: prefill chunks cross several blocks, end on
block boundaries (align mode), and decodes share steps with prefills.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from tests.engine.conftest import ARCHITECTURES, STATE_ARCHITECTURES, hf_greedy, prompts

NEW_TOKENS = 12
TOLERANCE = 2e-3


@pytest.mark.parametrize("kind", [*ARCHITECTURES, *STATE_ARCHITECTURES])
def test_greedy_batch_with_chunked_prefill_matches_transformers(
    kind: str, model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]
) -> None:
    path = model_dir(kind)
    batch = prompts([57, 23, 41, 30])
    llm = LLM(str(path), max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.01)
    outputs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE, logprobs=5))
    assert llm.stats.steps > NEW_TOKENS + 1  # the 57-token prompt needed more than one prefill step
    for prompt, output in zip(batch, outputs, strict=True):
        expected, reference = hf_greedy(hf_model(path), prompt, NEW_TOKENS)
        assert output.token_ids == expected
        for step, top in enumerate(output.logprobs):
            for token, logprob in top.items():
                assert abs(logprob - float(reference[step, token])) < TOLERANCE, (kind, step, token)


@pytest.mark.parametrize(("kind", "field"), [("mistral", "sliding_window"), ("llama4", "attention_chunk_size"),
                                           ("smollm3", "sliding_window")])
def test_window_and_chunk_are_narrow_enough_to_matter(
    kind: str, field: str, model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Guards the comparison above: widening the window/chunk changes the outputs visibly."""
    wide = tmp_path / "wide"
    shutil.copytree(model_dir(kind), wide)
    config = json.loads((wide / "config.json").read_text())
    config[field] = 512
    (wide / "config.json").write_text(json.dumps(config))
    prompt = prompts([40])[0]
    params = SamplingParams(max_tokens=1, logprobs=1)
    narrow_top = LLM(str(model_dir(kind)), max_model_len=256, kv_cache_memory_gib=0.01).generate([prompt], params)
    wide_top = LLM(str(wide), max_model_len=256, kv_cache_memory_gib=0.01).generate([prompt], params)
    (narrow_token, narrow_lp), = narrow_top[0].logprobs[0].items()
    (wide_token, wide_lp), = wide_top[0].logprobs[0].items()
    assert narrow_token != wide_token or abs(narrow_lp - wide_lp) > 100 * TOLERANCE


def test_gemma3_attn_logit_softcapping_is_ignored_as_in_transformers(
    model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any], tmp_path: Path
) -> None:
    """transformers' Gemma 3 never applies `attn_logit_softcapping`; with a cap of 0.5 on the scores
    (which would flatten attention completely) both still produce the same tokens and logprobs."""
    capped = tmp_path / "capped"
    shutil.copytree(model_dir("gemma3"), capped)
    config = json.loads((capped / "config.json").read_text())
    config["attn_logit_softcapping"] = 0.5
    (capped / "config.json").write_text(json.dumps(config))
    prompt = prompts([30])[0]
    llm = LLM(str(capped), max_model_len=256, block_size=4, kv_cache_memory_gib=0.01)
    output = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, eos=EosMode.IGNORE, logprobs=3))[0]
    expected, reference = hf_greedy(hf_model(capped), prompt, NEW_TOKENS)
    assert output.token_ids == expected
    for step, top in enumerate(output.logprobs):
        for token, logprob in top.items():
            assert abs(logprob - float(reference[step, token])) < TOLERANCE, (step, token)
