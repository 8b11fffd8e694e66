"""Seeded synthetic traces for `hybridkv simulate --generate KIND`.

Each generator draws lengths from a log-normal around a mean (sigma 0.6: a long right tail, as
request-length distributions of public chat and agent traces have) and token ids uniformly from
a 32k vocabulary, and is a pure function of its seed. A system prompt's and a tool spec's end is a
request's `turn_ends` (the message boundary a chat template reports). The means are defaults to edit, not facts
about any one service.

    chat            sessions of several turns; each turn extends the previous turn and its answer
    system-prompt   single-turn requests that open with one of a few long system prompts
                    (popularity Zipf-like: the first prompt is the most common)
    agentic         tool loops: a long tool-spec prefix, then many short steps, each appending a
                    tool result to the whole history
    branching       a conversation tree: each request extends a random earlier one (regenerations,
                    edits of an earlier turn, forks)
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from hybridkv.errors import ConfigError
from hybridkv.simulate.sessions import sessions
from hybridkv.simulate.trace import TraceRequest

VOCAB = 32_000
DEFAULT_OUTPUT_TOKENS = 128
#: the Mooncake FAST'25 trace's average output length (sessions.py)
SESSION_OUTPUT_TOKENS = 182


class Generator(Enum):
    CHAT = "chat"
    SYSTEM_PROMPT = "system-prompt"
    AGENTIC = "agentic"
    BRANCHING = "branching"
    SESSIONS = "sessions"


#: the four short synthetic workloads (`SESSIONS` is the production-like one)
SHORT = (Generator.CHAT, Generator.SYSTEM_PROMPT, Generator.AGENTIC, Generator.BRANCHING)


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratorOptions:
    """What every generator reads: `num_requests` in all, arriving `gap_ms` apart on average."""

    num_requests: int = 100
    seed: int = 0
    gap_ms: float = 100.0
    mean_prompt_tokens: int = 1024
    mean_output_tokens: int = DEFAULT_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.mean_prompt_tokens < 1 or self.mean_output_tokens < 1 or self.gap_ms < 0:
            raise ConfigError(f"generator options must be positive (gap >= 0), got {self}")


class _Draw:
    def __init__(self, options: GeneratorOptions) -> None:
        self.rng = random.Random(options.seed)
        self.options = options
        self.clock_ms = 0.0

    def length(self, mean: float) -> int:
        sigma = 0.6
        return max(1, round(self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))

    def tokens(self, mean: float) -> tuple[int, ...]:
        return tuple(self.rng.randrange(1, VOCAB) for _ in range(self.length(mean)))

    def arrival(self) -> float:
        self.clock_ms += self.rng.expovariate(1 / self.options.gap_ms) if self.options.gap_ms else 0.0
        return self.clock_ms

    def output(self) -> int:
        return self.length(self.options.mean_output_tokens)


def chat(options: GeneratorOptions) -> list[TraceRequest]:
    """Sessions of 1..8 turns (mean ~4); a turn's new text is ~1/4 of the prompt mean."""
    d = _Draw(options)
    out: list[TraceRequest] = []
    live: list[tuple[int, int]] = []  # (last request index, turns left)
    while len(out) < options.num_requests:
        if live and d.rng.random() < 0.7:
            k = d.rng.randrange(len(live))
            last, left = live[k]
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=d.tokens(options.mean_prompt_tokens / 4),
                                    output_tokens=d.output(), parent=last))
            live[k] = (len(out) - 1, left - 1)
            if left <= 1:
                live.pop(k)
        else:
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=d.tokens(options.mean_prompt_tokens),
                                    output_tokens=d.output()))
            live.append((len(out) - 1, d.rng.randint(0, 7)))
    return out


def system_prompt(options: GeneratorOptions) -> list[TraceRequest]:
    """Eight system prompts (~mean tokens each), weights 1/rank; a unique question (~1/8) after it."""
    d = _Draw(options)
    prompts = [d.tokens(options.mean_prompt_tokens) for _ in range(8)]
    weights = [1 / (rank + 1) for rank in range(len(prompts))]
    out = []
    for _ in range(options.num_requests):
        arrival, output = d.arrival(), d.output()
        system = d.rng.choices(prompts, weights)[0]
        out.append(TraceRequest(arrival_ms=arrival, output_tokens=output, turn_ends=(len(system),),
                                new_tokens=system + d.tokens(options.mean_prompt_tokens / 8)))
    return out


def agentic(options: GeneratorOptions) -> list[TraceRequest]:
    """Agents of 5..20 steps over a shared tool spec (~2x the prompt mean); each step adds a tool
    result (~1/8) and asks for a short action (~1/4 of the output mean)."""
    d = _Draw(options)
    spec = d.tokens(2 * options.mean_prompt_tokens)
    out: list[TraceRequest] = []
    live: list[tuple[int, int]] = []
    while len(out) < options.num_requests:
        action = max(1, d.output() // 4)
        if live and d.rng.random() < 0.85:
            k = d.rng.randrange(len(live))
            last, left = live[k]
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=d.tokens(options.mean_prompt_tokens / 8),
                                    output_tokens=action, parent=last))
            live[k] = (len(out) - 1, left - 1)
            if left <= 1:
                live.pop(k)
        else:
            task = spec + d.tokens(options.mean_prompt_tokens / 4)
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=task, output_tokens=action,
                                    turn_ends=(len(spec),)))
            live.append((len(out) - 1, d.rng.randint(5, 20)))
    return out


def branching(options: GeneratorOptions) -> list[TraceRequest]:
    """A tree: 10% of requests start a conversation; the rest extend a random earlier request."""
    d = _Draw(options)
    out: list[TraceRequest] = []
    for _ in range(options.num_requests):
        if not out or d.rng.random() < 0.1:
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=d.tokens(options.mean_prompt_tokens),
                                    output_tokens=d.output()))
        else:
            parent = d.rng.randrange(len(out))
            out.append(TraceRequest(arrival_ms=d.arrival(), new_tokens=d.tokens(options.mean_prompt_tokens / 4),
                                    output_tokens=d.output(), parent=parent))
    return out


def production_sessions(options: GeneratorOptions) -> list[TraceRequest]:
    """`sessions.sessions` with these options (a session starts `gap_ms` after the previous on
    average; the mean output is the Mooncake trace's 182 tokens unless `mean_output_tokens` was
    changed)."""
    output = options.mean_output_tokens
    output = SESSION_OUTPUT_TOKENS if output == DEFAULT_OUTPUT_TOKENS else output
    return sessions(options.num_requests, seed=options.seed, gap_ms=options.gap_ms, mean_output_tokens=output)


GENERATORS: dict[Generator, Callable[[GeneratorOptions], list[TraceRequest]]] = {
    Generator.CHAT: chat,
    Generator.SYSTEM_PROMPT: system_prompt,
    Generator.AGENTIC: agentic,
    Generator.BRANCHING: branching,
    Generator.SESSIONS: production_sessions,
}


def generate(kind: Generator, options: GeneratorOptions) -> list[TraceRequest]:
    return GENERATORS[kind](options)
