"""Which full sliding-window blocks and state checkpoints are worth caching (vLLM 0.32's rules, and ours).

A sliding-window hit of length L (a multiple of the alignment, the lcm of the group block sizes)
reads only the `need = ceil((W - 1) / B)` blocks before L. A block that ends no such run can
never serve a hit, yet, cached, it keeps its hash and waits in the free queue behind the
content-free blocks, competing with blocks that can. So:

    SlidingWindowCaching.REACHABLE   cache, in every alignment-sized segment, only its last `need`
                                     blocks (vLLM 0.32's rule; the default here: measured better,
                                     docs/prefix_caching.md). With one block size for all groups
                                     every block is reachable and this caches them all.
    SlidingWindowCaching.ALL         cache every full block (this project's earlier rule)

`prefix_cache_retention_interval` (vLLM's option, same meaning) thins this further (and, in
`state_mask`, a state group's checkpoints: the single block ending on each kept boundary):

    None   every aligned boundary, as above (dense)
    0      only the tails before the prompt's replay boundary `prompt - 1` and its shared-prefix
           junction (vLLM 0.32's engine default)
    k > 0  a tail once per k-token segment, plus the replay boundary (k a multiple of the alignment)

Per segment of `per = segment / B` blocks, block i is kept when `i % per >= per - need`:

    B = 8, alignment 32, W = 8 (need 1):  blocks 0 1 2 3 | 4 5 6 7    kept: 3, 7
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.errors import ConfigError
from hybridkv.kvcache.options import (  # (re-exported: the mode enums live in options.py)
    DecodeCheckpoints,
    SlidingWindowCaching,
    SpecDecode,
)
from hybridkv.kvcache.request import KVRequest


def replay_boundaries(num_prompt_tokens: int, alignment_tokens: int, spec_decode: SpecDecode) -> tuple[int, ...]:
    """Where a later request replaying a prompt resumes: a resend of the same prompt (hit at most
    `prompt - 1`); with EAGLE, one block below a resend and below a longer sibling (vLLM 0.32's rule)."""
    if spec_decode is SpecDecode.OFF:
        return (num_prompt_tokens - 1,)
    resend = (num_prompt_tokens - 1) // alignment_tokens * alignment_tokens
    extension = num_prompt_tokens // alignment_tokens * alignment_tokens
    return tuple(sorted({max(resend - alignment_tokens, 0), max(extension - alignment_tokens, 0)}))


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """The caching rule of the sliding-window groups and state checkpoints of one manager."""

    sliding: SlidingWindowCaching = SlidingWindowCaching.REACHABLE
    interval_tokens: int | None = None  # vLLM's prefix_cache_retention_interval
    alignment_tokens: int = 1  # the lcm of every group's block size
    spec_decode: SpecDecode = SpecDecode.OFF
    decode_checkpoints: DecodeCheckpoints = DecodeCheckpoints.EVERY

    def __post_init__(self) -> None:
        interval = self.interval_tokens
        if interval is not None and (interval < 0 or interval % self.alignment_tokens):
            raise ConfigError(
                f"prefix_cache_retention_interval {interval} must be None, 0 or a positive multiple of the "
                f"alignment {self.alignment_tokens} tokens (the lcm of the group block sizes)"
            )

    @property
    def dense_all(self) -> bool:
        """Every full block is cached (no mask to compute)."""
        return self.sliding is SlidingWindowCaching.ALL and self.interval_tokens is None

    def boundaries(self, request: KVRequest) -> tuple[int, ...]:
        """The request's reachable boundaries: its replay boundaries and its shared-prefix junction."""
        prompt = request.num_prompt_tokens if request.num_prompt_tokens is not None else request.num_tokens
        return (*replay_boundaries(prompt, self.alignment_tokens, self.spec_decode), request.shared_prefix_boundary)

    def state_mask(self, start: int, end: int, *, block_size: int, request: KVRequest) -> list[bool] | None:
        """Per state block index in [start, end): keep its checkpoint? None: every one. vLLM 0.32's
        rule: `0` keeps the states at the reachable boundaries only, `N` also one per N-token segment."""
        interval = self.interval_tokens
        if interval is None:
            return None
        mask = [False] * (end - start)
        if interval:
            per = interval // block_size
            if per <= 1:
                return None
            for i in range(start, end):
                mask[i - start] = (i + 1) % per == 0
        for boundary in self.boundaries(request):
            block = boundary // self.alignment_tokens * self.alignment_tokens // block_size - 1
            if start <= block < end:
                mask[block - start] = True
        return mask

    def caches_every_block(self, block_size: int, need: int) -> bool:
        """`mask` is None for every range: every full block is cached."""
        if self.dense_all or self.alignment_tokens % block_size:
            return True
        return self.interval_tokens is None and need >= self.alignment_tokens // block_size

    def mask(self, start: int, end: int, *, block_size: int, need: int,
             replay_boundaries: Sequence[int]) -> list[bool] | None:
        """Per block index in [start, end): cache it? None: cache every one."""
        if self.caches_every_block(block_size, need):
            return None
        interval = self.interval_tokens
        segment = self.alignment_tokens if interval is None else (interval or None)
        mask = [False] * (end - start)
        shift = 1 if self.spec_decode is SpecDecode.EAGLE else 0  # EAGLE's run ends one block past the hit
        if segment is not None:
            per = segment // block_size
            if need >= per:
                return None
            for i in range(start, end):
                if i >= shift and (i - shift) % per >= per - need:
                    mask[i - start] = True
        if interval is not None:
            for boundary in replay_boundaries:
                last = boundary // self.alignment_tokens * self.alignment_tokens // block_size + shift
                for i in range(max(start, last - need), min(end, last)):
                    mask[i - start] = True
        return mask
