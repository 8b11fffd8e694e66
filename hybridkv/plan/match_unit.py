"""`prefix_match_unit` (vLLM 0.32's option; `hash_block_size` in its KV cache code): the token
granularity of prefix-cache keys, and where hits can land.

vLLM 0.32 resolves it once, from the KV cache groups (`resolve_kv_cache_block_sizes` and
`partial_hash_hits_enabled` in `v1/core/kv_cache_utils.py`):

    one group:   keys and hits every block; any other unit is an error while caching is on
    several:     scheduler block = lcm(block sizes)
                 caching off, or a state group not in align mode  -> unit = scheduler block (option ignored)
                 otherwise unit = the option, else gcd(block sizes); every block size must divide by it
    hits land every `unit` tokens (sub-block, "partial" hits) only where a state group in align
    mode has a block larger than the unit and every other group can look up inside a block
    (full attention and state groups can; sliding window, chunked local and cross attention
    cannot, unless their block equals the unit); elsewhere they land every scheduler block.

A partial hit ends inside a physical block: the request gets a private copy of that block
(copy on write) and recomputes from the hit. See docs/prefix_caching.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.errors import ConfigError
from hybridkv.plan.kv_cache_config import KVCacheGroupSpec
from hybridkv.plan.specs import MambaCacheMode, SpecKind

__all__ = ["FINE_GRAINED_KINDS", "MatchUnit", "check_prefix_match_unit", "resolve_match_unit"]

#: Group kinds whose hit rule can look up a hit that ends inside a block (vLLM 0.32's
#: `supports_fine_grained_hash_lookup`: its full-attention and Mamba managers).
FINE_GRAINED_KINDS = frozenset({SpecKind.FULL, SpecKind.MAMBA})


@dataclass(frozen=True, slots=True, kw_only=True)
class MatchUnit:
    """The resolved prefix-match granularity of one KV cache layout.

    `hash_unit_tokens`: tokens per prefix-cache key. `hit_alignment_tokens`: the granularity hits
    land on (the unit where partial hits are on, else the scheduler block). `partial_hits`: whether
    a hit may end inside a physical block (then its tail block is copied on write).
    """

    scheduler_block_tokens: int
    hash_unit_tokens: int
    hit_alignment_tokens: int
    partial_hits: bool

    def __post_init__(self) -> None:
        if self.scheduler_block_tokens % self.hit_alignment_tokens:
            raise ConfigError(f"hit alignment {self.hit_alignment_tokens} must divide the scheduler block "
                              f"{self.scheduler_block_tokens}")


def check_prefix_match_unit(value: object) -> int | None:
    """`value` as a prefix_match_unit option (None or a positive integer); ConfigError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"prefix_match_unit must be None or a positive integer (tokens), got {value!r}")
    return value


def resolve_match_unit(groups: Sequence[KVCacheGroupSpec], prefix_match_unit: int | None, *,
                       caching: bool, mamba_cache_mode: MambaCacheMode) -> MatchUnit:
    """The match unit vLLM 0.32 resolves for these groups (module docstring).

    Raises:
        ConfigError: an option vLLM rejects: a unit other than the block with one group, or one
            that does not divide every group's block size.
    """
    unit = check_prefix_match_unit(prefix_match_unit)
    sizes = [g.block_size for g in groups]
    scheduler = math.lcm(*sizes) if sizes else 1
    if len(groups) <= 1:
        if unit not in (None, scheduler) and caching and groups:
            raise ConfigError(
                f"prefix_match_unit={unit} is invalid: with a single KV cache group, prefix-cache hits land "
                f"on the block size ({scheduler}); unset it or set it to {scheduler}")
        return _whole_blocks(scheduler)
    states = [g for g in groups if g.kind is SpecKind.MAMBA]
    if not caching or (states and mamba_cache_mode is not MambaCacheMode.ALIGN):
        return _whole_blocks(scheduler)
    hash_unit = unit if unit is not None else math.gcd(*sizes)
    if any(size % hash_unit for size in sizes):
        raise ConfigError(
            f"prefix_match_unit={hash_unit} is invalid: every KV cache group's block size must be divisible by "
            f"it; got group block sizes {sizes}")
    partial = (any(g.block_size > hash_unit for g in states)
               and all(g.kind in FINE_GRAINED_KINDS or g.block_size == hash_unit for g in groups))
    return MatchUnit(scheduler_block_tokens=scheduler, hash_unit_tokens=hash_unit,
                     hit_alignment_tokens=hash_unit if partial else scheduler, partial_hits=partial)


def _whole_blocks(scheduler: int) -> MatchUnit:
    return MatchUnit(scheduler_block_tokens=scheduler, hash_unit_tokens=scheduler,
                     hit_alignment_tokens=scheduler, partial_hits=False)
