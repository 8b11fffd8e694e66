"""Sampling parameters and the sampler: greedy, or temperature / top-k / top-p with a seed.

Each request draws from its own `torch.Generator`, so its tokens do not depend on which other
requests share its batch (or on preemptions that recompute it).
"""

from __future__ import annotations

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

    `top_k == 0` and `top_p == 1.0` turn those filters off. `seed` fixes the request's draws
    (default: the engine seed plus the request's index). `logprobs > 0` returns that many top
    log-probabilities (of the unfiltered distribution) per generated token, and the generated
    token's own when it is not among them.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    eos: EosMode = EosMode.STOP
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("top_k", "logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.logprobs < 0:
            raise ConfigError(f"logprobs must be >= 0 (0 = none), got {self.logprobs}")
        if not isinstance(self.eos, EosMode):
            raise ConfigError(f"eos must be an EosMode ({[m.value for m in EosMode]}), got {self.eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with everything outside top-k / top-p set to -inf."""
    logits = logits / params.temperature
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
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32), row i under params[i] / generators[i]."""
    tokens = torch.argmax(logits, dim=-1).tolist()  # greedy for every row; random rows overwrite
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filtered_logits(logits[i], p), dim=-1)  # [V]
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
