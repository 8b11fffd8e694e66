"""vLLM's sampling extensions in the sampler (min_p, penalties, min_tokens) against transformers'
logits processors and hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.sampler import EosMode, SamplingParams, TokenHistory, filtered_logits, processed_logits, sample
from hybridkv.errors import ConfigError

procs = pytest.importorskip("transformers.generation.logits_process")


def _logits(seed: int, vocab: int = 30) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers() -> None:
    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        logits = _logits(trial)
        ids = torch.randint(0, 30, (12,), generator=gen).tolist()
        penalty = 0.5 + trial / 25
        ours = processed_logits(logits, SamplingParams(repetition_penalty=penalty),
                                TokenHistory(token_ids=ids, prompt_len=5))
        ref = procs.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]
        assert torch.allclose(ours, ref), trial


def test_frequency_and_presence_penalties_subtract_per_output_token() -> None:
    logits = torch.zeros(6)
    history = TokenHistory(token_ids=[4, 4, 1, 1, 1, 2], prompt_len=2)  # prompt [4, 4] does not count
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    ours = processed_logits(logits, params, history)
    # token 1: three times -> 3 * 0.5 + 0.25; token 2: once -> 0.5 + 0.25; token 4 only in the prompt
    assert ours.tolist() == [0.0, -1.75, -0.75, 0.0, 0.0, 0.0]


def test_min_p_equals_transformers() -> None:
    for trial in range(50):
        logits = _logits(100 + trial)
        temperature, min_p = 0.3 + trial / 40, (trial % 10) / 10
        ours = filtered_logits(logits, SamplingParams(temperature=temperature, min_p=min_p))
        ref = procs.TemperatureLogitsWarper(temperature)(None, logits[None].clone())
        if min_p:
            ref = procs.MinPLogitsWarper(min_p)(None, ref)
        assert torch.equal(ours == float("-inf"), ref[0] == float("-inf")), trial


def test_min_tokens_equals_transformers_and_bans_stop_ids() -> None:
    logits = _logits(7)
    logits[1] = 100.0  # EOS would win
    for generated in range(5):
        ids = [9, 9, 9, *[5] * generated]
        history = TokenHistory(token_ids=ids, prompt_len=3, eos_token_ids=(1,))
        params = SamplingParams(min_tokens=3, stop_token_ids=(4,), max_tokens=8)
        ours = processed_logits(logits, params, history)
        ref = procs.MinNewTokensLengthLogitsProcessor(3, 3, eos_token_id=[1, 4])(torch.tensor([ids]),
                                                                                  logits[None].clone())[0]
        assert torch.equal(ours, ref), generated
        greedy = sample(logits[None], [params], [torch.Generator()], [history])[0]
        assert greedy == (1 if generated >= 3 else int(torch.argmax(ref)))
    ignoring = SamplingParams(min_tokens=3, eos=EosMode.IGNORE, max_tokens=8)  # EOS is no stop: not banned
    assert processed_logits(logits, ignoring, TokenHistory(token_ids=[9], prompt_len=1, eos_token_ids=(1,)))[1] == 100


def test_penalties_need_a_history_and_check_their_ranges() -> None:
    with pytest.raises(ConfigError, match="no token history"):
        sample(_logits(0)[None], [SamplingParams(repetition_penalty=1.2)], [torch.Generator()])
    for bad, message in [({"min_p": 1.5}, "min_p must be in"), ({"repetition_penalty": 0.0}, "must be > 0"),
                         ({"frequency_penalty": -3}, "in [-2, 2]"), ({"min_tokens": 20}, "max_tokens = 16"),
                         ({"stop_token_ids": (-1,)}, "non-negative")]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            SamplingParams(**bad)  # type: ignore[arg-type]
