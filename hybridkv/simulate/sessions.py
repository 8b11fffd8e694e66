"""Production-like multi-turn sessions (`hybridkv simulate --generate sessions`), seeded.

A session opens with a shared system prompt (one of `system_prompts`, popularity 1/rank), often a
shared document (one of `documents`, popularity 1/rank), then the user's first message; each later
turn extends an earlier turn of its session (usually the last; `branch_probability` of them an
earlier one: a regenerated or edited turn) by whole segments of `segment_tokens` (the last one
partial, as a Mooncake trace's last block); it arrives a think time after the turn it extends.
Sessions start in a bursty stream (Gamma inter-arrival times with shape `burst_shape` < 1: most
gaps short, a few long), so many sessions are open at once and their turns interleave. Prompt
text is whole segments, so the trace is what a Mooncake-format trace describes (`hash_ids` per
512-token block, equal ids = equal content).

Defaults and where they come from (change them with `SessionShape`):

    segment_tokens 512         the hash block of the Mooncake FAST'25 trace format (Qin et al., "Mooncake:
                               A KVCache-centric Disaggregated Architecture for LLM Serving", FAST'25)
    mean prompt ~7.6k tokens   that paper's released trace: average input 7,590 tokens, average output
    mean output 182 tokens     182 tokens (a long-context chat service); `system_segments`, `document_*`
                               and the turn sizes are set so that the mean prompt lands there
    burst_shape 0.5            BurstGPT (Wang et al., 2024: Azure OpenAI GPT traces) fits request
                               inter-arrival times with Gamma distributions and finds them burstier than
                               Poisson; 0.5 (squared coefficient of variation 2) is our pick in that regime
    turns 1..12, mean ~4       our assumption (public chat logs: LMSYS-Chat-1M averages 2 turns per
                               conversation; long-context services see longer sessions)
    think time median 20 s     our assumption (no public trace publishes it); log-normal, sigma 1
    system prompts 8 x 1-4     our assumption (Splitwise, Patel et al. ISCA'24, Azure LLM inference
    segments; documents 16 x   traces: conversation prompts have a median of ~1,020 tokens, coding
    2-16 segments, in 60% of   ~1,500; the shared part of a long-context prompt is mostly documents)
    sessions
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from hybridkv.errors import ConfigError
from hybridkv.simulate.trace import TraceRequest

VOCAB = 32_000


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionShape:
    """The knobs of `sessions` (module docstring: each default and its source)."""

    segment_tokens: int = 512
    system_prompts: int = 8
    system_segments: tuple[int, int] = (1, 4)
    documents: int = 16
    document_segments: tuple[int, int] = (2, 16)
    document_probability: float = 0.6
    #: the first user message and each later one, in segments (log-normal mean, at least 1)
    first_message_segments: float = 4.0
    turn_segments: float = 1.5
    max_turns: int = 12
    mean_turns: float = 4.0
    branch_probability: float = 0.1
    think_median_s: float = 20.0
    burst_shape: float = 0.5

    def __post_init__(self) -> None:
        if self.segment_tokens < 1 or self.system_prompts < 1 or self.documents < 1 or self.max_turns < 1:
            raise ConfigError(f"session shape: sizes and counts must be positive, got {self}")
        for lo, hi in (self.system_segments, self.document_segments):
            if not 1 <= lo <= hi:
                raise ConfigError(f"session shape: segment ranges must be 1 <= low <= high, got {(lo, hi)}")
        if not (0 <= self.document_probability <= 1 and 0 <= self.branch_probability <= 1):
            raise ConfigError(f"session shape: probabilities must be in [0, 1], got {self}")
        if min(self.first_message_segments, self.turn_segments, self.mean_turns, self.think_median_s,
               self.burst_shape) <= 0:
            raise ConfigError(f"session shape: means, think time and burst shape must be > 0, got {self}")


class _Text:
    """Seeded segments of token ids."""

    def __init__(self, rng: random.Random, segment_tokens: int) -> None:
        self.rng = rng
        self.size = segment_tokens

    def segments(self, count: int, *, partial: bool = False) -> tuple[int, ...]:
        """`count` segments; with `partial` the last one cut at a random length (>= 1)."""
        n = count * self.size - (self.rng.randrange(self.size) if partial else 0)
        return tuple(self.rng.randrange(1, VOCAB) for _ in range(n))

    def count(self, mean: float) -> int:
        sigma = 0.6
        return max(1, round(self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def sessions(num_requests: int, *, seed: int, gap_ms: float, mean_output_tokens: float,
             shape: SessionShape | None = None) -> list[TraceRequest]:
    """`num_requests` requests of whole sessions (the last one cut short), in arrival order (module
    docstring); a new session starts a Gamma(`burst_shape`) gap of mean `gap_ms` after the previous."""
    shape = shape or SessionShape()
    rng = random.Random(seed)
    text = _Text(rng, shape.segment_tokens)
    systems = [text.segments(rng.randint(*shape.system_segments)) for _ in range(shape.system_prompts)]
    documents = [text.segments(rng.randint(*shape.document_segments)) for _ in range(shape.documents)]
    popular = [1 / (rank + 1) for rank in range(max(shape.system_prompts, shape.documents))]
    drafts: list[_Draft] = []
    clock = 0.0
    while len(drafts) < num_requests:
        clock += rng.gammavariate(shape.burst_shape, gap_ms / shape.burst_shape) if gap_ms else 0.0
        system = rng.choices(systems, popular[: len(systems)])[0]
        document = (rng.choices(documents, popular[: len(documents)])[0]
                    if rng.random() < shape.document_probability else ())
        message = text.segments(text.count(shape.first_message_segments), partial=True)
        ends = sorted({len(system), len(system) + len(document)} - {0})
        turns = [len(drafts)]
        drafts.append(_Draft(clock, system + document + message, text.count(mean_output_tokens), None, tuple(ends)))
        count = min(shape.max_turns, 1 + int(rng.expovariate(1 / max(shape.mean_turns - 1, 1e-9))))
        at = clock
        for _ in range(min(count, num_requests - len(drafts) + 1) - 1):
            at += 1000.0 * rng.lognormvariate(math.log(shape.think_median_s), 1.0)
            branch = len(turns) > 1 and rng.random() < shape.branch_probability
            parent = rng.choice(turns[:-1]) if branch else turns[-1]
            turns.append(len(drafts))
            drafts.append(_Draft(at, text.segments(text.count(shape.turn_segments), partial=True),
                                 text.count(mean_output_tokens), parent, ()))
    order = sorted(range(len(drafts)), key=lambda i: (drafts[i].arrival_ms, i))  # a parent sorts before its turns
    new_index = {old: new for new, old in enumerate(order)}
    return [TraceRequest(arrival_ms=d.arrival_ms, new_tokens=d.tokens, output_tokens=d.output_tokens,
                         parent=None if d.parent is None else new_index[d.parent], turn_ends=d.turn_ends)
            for d in (drafts[i] for i in order)]


@dataclass(frozen=True, slots=True)
class _Draft:
    arrival_ms: float
    tokens: tuple[int, ...]
    output_tokens: int
    parent: int | None  # index in the drafts
    turn_ends: tuple[int, ...]


