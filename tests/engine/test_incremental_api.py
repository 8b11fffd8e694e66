"""The incremental API beneath `generate`: add_request / step / abort / has_unfinished.

References: transformers' greedy tokens and log-softmax rows of the same tiny checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.engine.outputs import StepOutput
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError
from tests.engine.conftest import hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=6, eos=EosMode.IGNORE)


def _run(llm: LLM) -> tuple[dict[str, list[int]], dict[str, StepOutput], list[set[str]]]:
    """Step until idle: streamed tokens per id, the finishing StepOutput per id, ids seen per step."""
    streamed: dict[str, list[int]] = {}
    finished: dict[str, StepOutput] = {}
    steps: list[set[str]] = []
    while llm.has_unfinished:
        outs = llm.step()
        steps.append({o.request_id for o in outs})
        for out in outs:
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.done:
                finished[out.request_id] = out
    return streamed, finished, steps


def test_streamed_tokens_of_requests_arriving_mid_run_equal_transformers(
        model_dir: Callable[[str], Path], hf_model: Callable[[Path], Any]) -> None:
    path = model_dir("gemma3")
    llm = LLM(str(path), max_num_batched_tokens=64)
    first, second = prompts([30, 21], seed=5)
    a = llm.add_request(first, GREEDY)
    llm.step()  # a's prefill
    llm.step()
    b = llm.add_request(second, GREEDY)  # arrives while a decodes: joins a's batch
    streamed, finished, steps = _run(llm)
    assert any({a, b} <= ids for ids in steps), "the late request never shared a step with the running one"
    for request_id, prompt in ((a, first), (b, second)):
        expected, _ = hf_greedy(hf_model(path), prompt, GREEDY.max_tokens)
        output = finished[request_id].finished
        assert output is not None
        assert output.token_ids == expected
        # a's first two tokens came before _run started; the rest streamed one per step
        assert streamed[request_id] == (expected[2:] if request_id == a else expected)
    llm.manager.check_integrity()
    assert llm.manager.usage() == 0.0


def test_abort_frees_blocks_and_the_request_is_never_reported_again(model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(model_dir("gemma3")))
    baseline = llm.manager.usage()
    keep = llm.add_request(prompts([25], seed=2)[0], GREEDY)
    drop = llm.add_request(prompts([40], seed=3)[0], SamplingParams(max_tokens=50))
    llm.step()
    llm.step()
    assert llm.manager.usage() > baseline
    assert llm.abort(drop) is True
    assert llm.abort(drop) is False  # already gone
    assert llm.abort("no-such-request") is False
    streamed, finished, _ = _run(llm)
    assert set(finished) == {keep} and drop not in streamed
    llm.manager.check_integrity()
    assert llm.manager.usage() == baseline
    assert not llm.has_unfinished


def test_generate_refuses_to_run_while_incremental_requests_are_unfinished(model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(model_dir("gemma3")))
    pending = llm.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ConfigError, match=r"1 request\(s\) from add_request"):
        llm.generate([[5, 6, 7]], GREEDY)
    llm.abort(pending)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == GREEDY.max_tokens


def test_add_request_validates_before_queueing(model_dir: Callable[[str], Path]) -> None:
    llm = LLM(str(model_dir("gemma3")))
    with pytest.raises(ConfigError, match=r"^prompt is empty"):
        llm.add_request([])
    with pytest.raises(ConfigError, match=r"prompt: token ids must lie in \[0, 160\)"):
        llm.add_request([3, 999])
    assert not llm.has_unfinished


def test_sampled_tokens_carry_their_own_logprob(model_dir: Callable[[str], Path],
                                                hf_model: Callable[[Path], Any]) -> None:
    path = model_dir("gemma3")
    prompt = prompts([12], seed=7)[0]
    hot = SamplingParams(max_tokens=8, temperature=3.0, seed=11, logprobs=1, eos=EosMode.IGNORE)
    output = LLM(str(path)).generate([prompt], hot)[0]
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([prompt + output.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # row i predicts token i
    assert max(len(top) for top in output.logprobs) == 2, "a hot temperature should sample a non-top token"
    for step, (token, top) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
        assert top[token] == pytest.approx(float(reference[step, token]), abs=1e-4)
        best = int(torch.argmax(reference[step]))
        assert top[best] == pytest.approx(float(reference[step, best]), abs=1e-4)
