"""Sampling parameters and the sampler: greedy, or temperature / min-p / top-k / top-p with a seed.

Each request draws from its own `torch.Generator`, so its tokens do not depend on which other
requests share its batch (or on preemptions that recompute it).

One row's logits go through these steps, in vLLM's order (greedy rows stop after step 2):

    1. min_tokens: while fewer than `min_tokens` tokens were generated, the stop tokens
       (`stop_token_ids`, and the EOS ids unless EOS is ignored) are set to -inf
    2. penalties: repetition (every token of the prompt and the output: a positive logit is
       divided by it, a negative one multiplied), then frequency (times the token's count in the
       output) and presence (once per token present in the output), both subtracted
    3. temperature, then min-p (drop tokens below `min_p` times the top probability), top-k, top-p
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from hybridkv.errors import ConfigError


class EosMode(Enum):
    """Whether generation ends at an end-of-sequence token."""

    STOP = "stop"
    IGNORE = "ignore"


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature == 0` is greedy (top-k / top-p unused).

    `top_k == 0`, `top_p == 1.0` and `min_p == 0.0` turn those filters off; the penalties are off
    at `repetition_penalty == 1.0` and `presence_penalty == frequency_penalty == 0.0` (see the
    module docstring for what each does). `min_tokens` tokens are generated before a stop token
    may be drawn. `seed` fixes the request's draws (default: the engine seed plus the request's
    index). `logprobs > 0` returns that many top log-probabilities (of the unprocessed
    distribution) per generated token, and the generated token's own when it is not among them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    eos: EosMode = EosMode.STOP
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("top_k", "logprobs", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}")
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ConfigError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        if self.logprobs < 0:
            raise ConfigError(f"logprobs must be >= 0 (0 = none), got {self.logprobs}")
        if not isinstance(self.eos, EosMode):
            raise ConfigError(f"eos must be an EosMode ({[m.value for m in EosMode]}), got {self.eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """True when the sampler needs the request's tokens (penalties, min_tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenHistory:
    """One request's tokens as the sampler sees them: `token_ids` is prompt then output (the
    request's own list, not a copy) and `eos_token_ids` the model's end-of-sequence ids."""

    token_ids: Sequence[int]
    prompt_len: int
    eos_token_ids: tuple[int, ...] = ()


def processed_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """Steps 1 and 2 of the module docstring on one row of logits [V] (a new tensor when any applies)."""
    output = history.token_ids[history.prompt_len :]
    if len(output) < params.min_tokens:
        stops = params.stop_token_ids + (history.eos_token_ids if params.eos is EosMode.STOP else ())
        banned = [t for t in stops if t < logits.numel()]
        if banned:
            logits = logits.index_fill(0, torch.tensor(banned, dtype=torch.int64), float("-inf"))
    if params.repetition_penalty != 1.0 and history.token_ids:
        seen = torch.tensor(sorted(set(history.token_ids)), dtype=torch.int64)
        values = logits[seen]
        values = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        logits = logits.index_copy(0, seen, values)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = Counter(output)
        ids = torch.tensor(list(counts), dtype=torch.int64)
        penalty = torch.tensor(list(counts.values()), dtype=logits.dtype) * params.frequency_penalty
        logits = logits.index_add(0, ids, -(penalty + params.presence_penalty))
    return logits


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with everything outside min-p / top-k / top-p set to -inf."""
    logits = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # [V] each
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly above each token
        drop = before >= params.top_p  # the first token is never dropped
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
    histories: Sequence[TokenHistory] | None = None,
) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32), row i under params[i] / generators[i]
    and, for penalties and min_tokens, histories[i] (required when a row uses them)."""
    tokens = torch.argmax(logits, dim=-1).tolist()  # greedy for every row; others overwrite
    for i, p in enumerate(params):
        row = logits[i]
        if p.uses_history:
            if histories is None:
                raise ConfigError("sampling params use penalties or min_tokens, but no token history was given")
            row = processed_logits(row, p, histories[i])
            if p.greedy:
                tokens[i] = int(torch.argmax(row))
        if p.greedy:
            continue
        probs = torch.softmax(filtered_logits(row, p), dim=-1)  # [V]
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return [int(t) for t in tokens]


def top_logprobs(logits: torch.Tensor, k: int, *, token: int | None = None) -> dict[int, float]:
    """The k most likely tokens of one row of logits [vocab] with their log-probabilities, plus
    `token` (the sampled one) when it is not among them: k or k + 1 entries, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    values, ids = torch.topk(logprobs, k)
    top = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
    if token is not None and token not in top:
        top[token] = float(logprobs[token])
    return top
