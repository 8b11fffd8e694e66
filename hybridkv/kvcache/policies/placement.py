"""Checkpoint placement (`CheckpointPlacement`): where align-mode prefill chunks end, i.e. where a
state group (Mamba, Gated DeltaNet) keeps checkpoints and where a later hit can land.

JUNCTION is vLLM 0.32's rule (chunk ends, the prompt's last boundary, the shared-prefix junction)
plus the request's hints (`KVRequest.cache_checkpoints`: an application's positions, or chat-turn
ends). PLACED adds a checkpoint every `checkpoint_interval_tokens` and at the `budget` most frequent
branch depths seen so far (a system prompt's end gets its checkpoint from the first request that
carries it). The manager calls `observe` at each lookup and writes `stops` into the request's
`checkpoint_stops`, which the scheduler reads.
"""

from __future__ import annotations

from collections import Counter

from hybridkv.errors import ConfigError
from hybridkv.kvcache.options import CheckpointPlacement
from hybridkv.kvcache.request import KVRequest

__all__ = ["CheckpointPlacement", "CheckpointPlanner"]


class CheckpointPlanner:
    """Computes a request's checkpoint stops and learns popular branch depths from lookups."""

    def __init__(self, placement: CheckpointPlacement, *, alignment_tokens: int,
                 interval_tokens: int | None = None, budget: int = 8) -> None:
        if interval_tokens is not None and (interval_tokens <= 0 or interval_tokens % alignment_tokens):
            raise ConfigError(f"checkpoint_interval_tokens must be a positive multiple of the alignment "
                              f"{alignment_tokens} tokens, got {interval_tokens}")
        if budget < 0:
            raise ConfigError(f"checkpoint budget must be >= 0, got {budget}")
        self.placement = placement
        self.alignment = alignment_tokens
        self.interval = interval_tokens
        self.budget = budget
        self._depths: Counter[int] = Counter()
        self._popular: list[int] = []

    @property
    def popular(self) -> list[int]:
        """The branch depths (tokens) PLACED puts checkpoints at now."""
        return list(self._popular)

    def observe(self, depth: int) -> None:
        """A lookup's branch depth: how far full attention matched cached content."""
        depth -= depth % self.alignment
        if depth <= 0 or self.placement is not CheckpointPlacement.PLACED:
            return
        self._depths[depth] += 1
        self._popular = sorted(d for d, n in self._depths.most_common(self.budget) if n >= 2)

    def stops(self, request: KVRequest) -> tuple[int, ...]:
        """Where the request's align-mode chunks must end (besides the scheduler's own cuts)."""
        end = request.num_tokens
        stops = {c for c in request.cache_checkpoints if 0 < c < end}
        if self.placement is CheckpointPlacement.PLACED:
            stops.update(d for d in self._popular if d < end)
            if self.interval:
                stops.update(range(self.interval, end, self.interval))
        return tuple(sorted(stops))
