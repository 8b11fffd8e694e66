"""`hybridkv plan`'s prefix-caching options: checked against the planned block sizes, reported in the
table and `--json`, and passed on in `--vllm`'s flags (vLLM 0.32's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.errors import ConfigError
from hybridkv.plan.match_unit import MatchUnit, resolve_match_unit
from hybridkv.plan.specs import MambaCacheMode

if TYPE_CHECKING:
    from rich.console import Console

    from hybridkv.plan.planner import Plan


@dataclass(frozen=True, slots=True, kw_only=True)
class CachingOptions:
    """The caching options `plan` was given (None: vLLM's default)."""

    prefix_match_unit: int | None = None
    prefix_cache_retention_interval: int | None = None
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN

    def __post_init__(self) -> None:
        interval = self.prefix_cache_retention_interval
        if interval is not None and interval < 0:
            raise ConfigError(f"prefix_cache_retention_interval must be None or an integer >= 0, got {interval}")


def match_unit(result: Plan, options: CachingOptions) -> MatchUnit:
    """Where hits land in `result`'s layout; ConfigError names a unit that does not fit its blocks."""
    return resolve_match_unit(result.config.groups, options.prefix_match_unit, caching=True,
                              mamba_cache_mode=options.mamba_cache_mode)


def caching_json(unit: MatchUnit, options: CachingOptions) -> dict[str, Any]:
    """`plan --json`'s "prefix_caching" entry."""
    return {"prefix_match_unit": options.prefix_match_unit, "hash_unit_tokens": unit.hash_unit_tokens,
            "hit_granularity_tokens": unit.hit_alignment_tokens, "sub_block_hits": unit.partial_hits,
            "prefix_cache_retention_interval": options.prefix_cache_retention_interval,
            "mamba_cache_mode": options.mamba_cache_mode.value}


def render_caching(console: Console, name: str, unit: MatchUnit, options: CachingOptions) -> None:
    """One line under the plan table: the hit granularity and the retention setting."""
    sub = " (sub-block hits: the hit block is copied on write)" if unit.partial_hits else ""
    interval = options.prefix_cache_retention_interval
    kept = "every aligned boundary" if interval is None else ("replay boundary only" if interval == 0
                                                              else f"replay boundary and every {interval} tokens")
    console.print(f"prefix caching ({name}): keys every {unit.hash_unit_tokens} tokens, hits every "
                  f"{unit.hit_alignment_tokens} tokens{sub}; windows and states kept at {kept}", soft_wrap=True)


def vllm_caching_flags(options: CachingOptions) -> tuple[str, ...]:
    """The caching flags beyond `vllm_flags`'s (only those set, so vLLM keeps its defaults)."""
    flags: list[str] = []
    if options.prefix_match_unit is not None:
        flags += ["--prefix-match-unit", str(options.prefix_match_unit)]
    if options.prefix_cache_retention_interval is not None:
        flags += ["--prefix-cache-retention-interval", str(options.prefix_cache_retention_interval)]
    return tuple(flags)
