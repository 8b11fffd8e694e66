"""The joint hit of one instance: the longest prefix every KV cache group of it can serve.

The same rules as the KV cache manager's lookup (hybridkv.kvcache: coordinator and type managers),
restated over the blocks each group holds, which is all an index knows:

    full attention   every block of the prefix                     (held[0:p] all present)
    sliding window W the last ceil((W-1)/B) blocks before p,       (held[p-need:p] all present,
                     or the whole prefix when it is shorter          or held[0:p] when p < need)
    state (Mamba)    a checkpoint exactly at p                     (held[p-1] present)

p runs over multiples of the lcm of the groups' block sizes, at most `num_tokens - 1` (the last
prompt token is always computed, for its logits). The answer is the largest p every group accepts.

    block:    0     1     2     3     4     5
    full      x     x     x     x     x     .      -> p <= 5 blocks
    sliding   .     .     x     x     x     .      need 2: p in {4, 5}... p=5 needs held[3:5]: yes
    state     .     x     .     x     .     .      p=2 or p=4 -> joint p = 4 blocks

`attention_tokens` is what an attention-only index reports: the held prefix of the full-attention
groups alone (of every attention group when the model has no full-attention group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

__all__ = ["GroupRule", "RuleKind", "attention_tokens", "joint_hit_tokens", "rule_kind"]

Held = npt.NDArray[np.bool_]


class RuleKind(Enum):
    """How a group's blocks make a hit."""

    FULL = "full"
    SLIDING = "sliding"
    STATE = "state"
    NEVER = "never"  # cross attention, chunked local, unknown kinds: nothing to resume from


_KINDS = {
    "full_attention": RuleKind.FULL, "mla_attention": RuleKind.FULL, "sink_full_attention": RuleKind.FULL,
    "full": RuleKind.FULL,  # (hybridkv's own spelling)
    "sliding_window": RuleKind.SLIDING, "sliding_window_mla": RuleKind.SLIDING,
    "mamba": RuleKind.STATE,
}


def rule_kind(spec_kind: str | None) -> RuleKind:
    """The rule of a vLLM `kv_cache_spec_kind` (None: an engine that does not say: full attention)."""
    if spec_kind is None:
        return RuleKind.FULL
    return _KINDS.get(spec_kind, RuleKind.NEVER)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRule:
    """One KV cache group of an instance, as its events describe it."""

    kind: RuleKind
    block_size: int
    window_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block size must be positive, got {self.block_size}")
        if self.kind is RuleKind.SLIDING and self.window_tokens <= 0:
            raise ValueError(f"a sliding-window group needs a positive window, got {self.window_tokens}")

    @property
    def need_blocks(self) -> int:
        """Sliding window: blocks that must be held before the hit point."""
        return -(-(self.window_tokens - 1) // self.block_size)


def _prefix_blocks(held: Held) -> int:
    misses = np.flatnonzero(~held)
    return int(misses[0]) if misses.size else int(held.size)


def _valid_points(rule: GroupRule, held: Held) -> Held:
    """valid[k] = the group serves a hit of k blocks (k = 0..len(held))."""
    n = held.size
    valid = np.zeros(n + 1, dtype=np.bool_)
    valid[0] = True
    if rule.kind is RuleKind.STATE:
        valid[1:] = held
    elif rule.kind is RuleKind.SLIDING:
        need = rule.need_blocks
        counts = np.concatenate(([0], np.cumsum(held, dtype=np.int64)))
        k = np.arange(n + 1)
        start = np.maximum(0, k - need)
        valid[:] = counts[k] - counts[start] == k - start
    elif rule.kind is RuleKind.FULL:
        valid[: _prefix_blocks(held) + 1] = True
    return valid


def joint_hit_tokens(rules: Sequence[GroupRule], held: Sequence[Held], max_tokens: int) -> int:
    """The largest p (tokens) every group serves, p <= max_tokens, p a multiple of every block size.

    `held[g][i]`: group g holds its block i of the prompt (arrays may be shorter than the prompt:
    missing entries are misses)."""
    if not rules or max_tokens <= 0:
        return 0
    step = math.lcm(*(r.block_size for r in rules))
    limit = max_tokens // step * step
    for rule, h in zip(rules, held, strict=True):
        if rule.kind is RuleKind.FULL:
            limit = min(limit, _prefix_blocks(h) * rule.block_size // step * step)
        elif rule.kind is RuleKind.NEVER:
            return 0
    if limit == 0:
        return 0
    ok = np.ones(limit // step + 1, dtype=np.bool_)
    for rule, h in zip(rules, held, strict=True):
        if rule.kind is RuleKind.FULL:
            continue
        blocks = limit // rule.block_size
        padded = np.zeros(blocks, dtype=np.bool_)
        padded[: min(blocks, h.size)] = h[:blocks]
        ratio = step // rule.block_size
        ok &= _valid_points(rule, padded)[::ratio]
    hits = np.flatnonzero(ok)
    return int(hits[-1]) * step


def attention_tokens(rules: Sequence[GroupRule], held: Sequence[Held]) -> int:
    """The held prefix, in tokens, of the full-attention groups (of all attention groups without one)."""
    pick = [i for i, r in enumerate(rules) if r.kind is RuleKind.FULL]
    if not pick:
        pick = [i for i, r in enumerate(rules) if r.kind is RuleKind.SLIDING]
    if not pick:
        return 0
    return min(_prefix_blocks(held[i]) * rules[i].block_size for i in pick)
