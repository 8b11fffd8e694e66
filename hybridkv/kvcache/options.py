"""Every prefix-cache knob in one frozen value, and the named presets.

`CacheOptions` is what the KV cache manager, the engine's scheduler, the planner's state layout
and `hybridkv simulate` read their cache settings from; `run`, `serve` and `simulate` declare one
CLI flag per field (one "Cache policy" help panel) and `--preset NAME` starts from `PRESETS[NAME]`.

    PRESETS["vllm"]       vLLM 0.32's behaviour, flag for flag (the default: docs/prefix_caching.md)
    PRESETS["hybridkv"]   the best setting this project has measured (bench_hits.py --targets)

`CacheOptions()` with no arguments is the manager's mechanism default: vLLM's policies with
blocks released position by position across groups (`ReleaseOrder.INTERLEAVED`).

Adding a knob: a field here with its help (the CLI flag appears in every command's Cache policy
panel by itself), its enum if it is a mode, its check in `__post_init__` / `validate`; the policy
that reads it lives in its own module under `kvcache/policies/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hybridkv.errors import ConfigError
from hybridkv.kvcache.events import KVEvents
from hybridkv.kvcache.hashing import HashAlgo
from hybridkv.plan.kv_cache_config import KVCacheConfig, RunningState, StateLayout
from hybridkv.plan.kv_cache_config import check_running_state as check_running_state_mode
from hybridkv.plan.match_unit import MatchUnit, check_prefix_match_unit, resolve_match_unit
from hybridkv.plan.specs import MambaCacheMode, SpecKind

__all__ = [
    "PRESETS", "AdmissionHeadroom", "CacheOptions", "CheckpointPlacement", "DecodeCheckpoints",
    "EvictionPolicyName", "HashAlgo", "KVEvents", "MambaCacheMode", "OnlineChoice", "PrefixCaching", "QueueOrder",
    "ReleaseOrder", "RunningState", "SlidingWindowCaching", "SpecDecode", "StateLayout", "describe", "options_from",
    "preset",
]


class AdmissionHeadroom(Enum):
    """What a new request's first allocation must leave free for the requests already running.

    NONE: nothing (vLLM's: a request is admitted when its first chunk fits). NEXT_BLOCK: one new
    block in every group per running request -- what each needs when its computation crosses
    its next block boundary (for a state group: the new state its next checkpoint is written
    into, k pages in the multi-page layout). Without it, a request admitted into the last free
    blocks is preempted by the first running request that crosses a boundary, re-admitted the
    next step, and preempted again: with small blocks and large states that churn recomputes
    prompts and evicts the prefixes it then misses (docs/prefix_caching.md). WAITING_HITS:
    NEXT_BLOCK, and the free blocks the waiting requests' hits will take stay free too (the
    scheduler names them each step, `KVCacheManager.protect_waiting`): a new request is not
    admitted by evicting the prefix another waiting request would hit.
    """

    NONE = "none"
    NEXT_BLOCK = "next_block"
    WAITING_HITS = "waiting_hits"


class CheckpointPlacement(Enum):
    """Where align-mode prefill chunks end, i.e. where state checkpoints exist (module docstring)."""

    JUNCTION = "junction"
    PLACED = "placed"


class DecodeCheckpoints(Enum):
    """Which state checkpoints a request's decode leaves cached (align mode).

    EVERY: one at every block boundary decode crosses (vLLM 0.32). With the small blocks of the
    multi-page state layout that is a checkpoint of k pages every 16 generated tokens, and only
    the last one -- where the next turn or tool call resumes -- is ever hit. LAST: a decode
    checkpoint replaces the request's previous one, which is dropped from the cache (the blocks
    become content-free, reused first) unless another request holds it. Prompt checkpoints
    (chunk ends, junctions, placed stops) are unaffected.
    """

    EVERY = "every"
    LAST = "last"


class EvictionPolicyName(Enum):
    """The eviction policies a `KVCacheManager` can be built with."""

    LRU = "lru"
    VALUE = "value"  # policies/value.py: recency plus compute saved per byte, dead blocks first


class OnlineChoice(Enum):
    """Whether the manager picks its runtime-switchable knobs online (`policies/ghosts.py`).

    OFF: the options as given. GHOSTS: metadata-only shadow managers, one per candidate setting of
    the knobs that can change while requests run (value eviction's class bonuses on or off; state
    checkpoints kept densely or only at the replay boundary and the junction), replay every request
    the manager admits; the manager takes the setting whose shadow hit most, recently."""

    OFF = "off"
    GHOSTS = "ghosts"


class PrefixCaching(Enum):
    """Whether full blocks are cached and looked up (OFF: state groups keep one running state)."""

    ON = "on"
    OFF = "off"


class QueueOrder(Enum):
    """Which waiting request is admitted next (module docstring)."""

    FCFS = "fcfs"
    CACHE_AWARE = "cache_aware"


class ReleaseOrder(Enum):
    """The order a finished (or preempted) request's blocks enter the free queue, tail first.

    INTERLEAVED: position by position across groups (the k-th block from the tail of every group
    before the (k+1)-th of any), so the LRU evicts a position from all groups together.
    BY_GROUP: group after group in group-id order, each tail first (vLLM 0.32's order: the lowest
    group's blocks are evicted first)."""

    INTERLEAVED = "interleaved"
    BY_GROUP = "by_group"


class SlidingWindowCaching(Enum):
    """Which full sliding-window blocks `allocate` caches (module docstring)."""

    REACHABLE = "reachable"
    ALL = "all"


class SpecDecode(Enum):
    """Speculative decoding as the prefix cache sees it (vLLM's `use_eagle`): with EAGLE / MTP a hit
    must leave the block before the generation point to be recomputed (the draft model needs its
    hidden states), so every group matches one block past the hit and drops it."""

    OFF = "off"
    EAGLE = "eagle"


def _help(text: str) -> dict[str, str]:
    """A field's metadata: its help line (the CLI flag's, `cli/cache_flags.py`)."""
    return {"help": text}


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOptions:
    """Every cache knob; each field's `help` (its metadata) is its CLI flag's help (docs/prefix_caching.md
    measures them). A field without help (`events`) is set by the code that needs it, not by a flag."""

    prefix_caching: PrefixCaching = field(default=PrefixCaching.ON, metadata=_help(
        "cache full blocks and look them up (off: state groups keep one running state)"))
    mamba_cache_mode: MambaCacheMode = field(default=MambaCacheMode.ALIGN, metadata=_help(
        "state checkpoints (Mamba / Gated DeltaNet): align = where a step ends on a block boundary, all = at "
        "every block boundary"))
    state_layout: StateLayout = field(default=StateLayout.ONE_PAGE, metadata=_help(
        "Mamba hybrids: one_page (a state in one page, attention blocks of hundreds of tokens, as vLLM) or "
        "multi_page (a state over several --block-size pages: short prefixes hit)"))
    running_state: RunningState = field(default=RunningState.MOVING, metadata=_help(
        "state groups in align mode: moving (vLLM's: a request holds the state it reads and the one it writes), "
        "fixed (one running state; hits and checkpoints copied) or adopt (fixed; a hit on a finished request's "
        "end becomes the running state)"))
    prefix_cache_retention_interval: int | None = field(default=None, metadata=_help(
        "vLLM's option: sliding-window tails and state checkpoints kept only at each prompt's replay boundary "
        "(0), or once per N tokens too (default: every aligned boundary)"))
    sliding_window_caching: SlidingWindowCaching = field(default=SlidingWindowCaching.REACHABLE, metadata=_help(
        "which full sliding-window blocks are cached: reachable (vLLM's) or all"))
    prefix_match_unit: int | None = field(default=None, metadata=_help(
        "vLLM's option (alias --hash-block-size): tokens per prefix-cache key (default: the block size; finer "
        "units make hits land inside a block only with a state group in align mode)"))
    eviction: EvictionPolicyName = field(default=EvictionPolicyName.LRU, metadata=_help(
        "which cached block is reused first: lru (vLLM's) or value (recency plus compute saved per byte; window "
        "tails and checkpoints at hit points kept, waiting requests' hits protected)"))
    checkpoint_placement: CheckpointPlacement = field(default=CheckpointPlacement.JUNCTION, metadata=_help(
        "where state checkpoints are written: junction (vLLM's) or placed (also at popular branch depths)"))
    checkpoint_interval_tokens: int | None = field(default=None, metadata=_help(
        "with --checkpoint-placement placed: also a state checkpoint every N tokens"))
    decode_checkpoints: DecodeCheckpoints = field(default=DecodeCheckpoints.EVERY, metadata=_help(
        "state checkpoints decode leaves cached: every (vLLM's: one per block boundary crossed) or last (a "
        "request's newest replaces its previous one)"))
    admission_headroom: AdmissionHeadroom = field(default=AdmissionHeadroom.NONE, metadata=_help(
        "what a new request leaves free: none (vLLM's), next_block (one block per group for each running "
        "request) or waiting_hits (next_block, and the prefixes waiting requests will hit)"))
    queue_order: QueueOrder = field(default=QueueOrder.FCFS, metadata=_help(
        "which waiting request is admitted next: fcfs (vLLM's) or cache_aware (the longest cached prefix first, "
        "each request passed over at most 32 times)"))
    cache_aware_admission_window: int = field(default=0, metadata=_help(
        "vLLM 0.34's cache-aware admission (with --queue-order fcfs): the first N waiting requests admitted "
        "deepest cached prefix first (0: off)"))
    cache_aware_admission_threshold: float = field(default=0.5, metadata=_help(
        "vLLM 0.34's: pool usage (blocks held by requests) from which that window reorders (default 0.5)"))
    online_choice: OnlineChoice = field(default=OnlineChoice.OFF, metadata=_help(
        "off, or ghosts: shadow managers replay the traffic under each candidate eviction weighting and "
        "checkpoint retention, and the manager switches to the one that hits most (never below a static choice)"))
    release_order: ReleaseOrder = field(default=ReleaseOrder.INTERLEAVED, metadata=_help(
        "free order of a request's blocks: interleaved across groups, or by_group (vLLM's)"))
    turn_checkpoints: bool = field(default=False, metadata=_help(
        "state checkpoints at chat-message ends (simulate: the trace's turn ends; serve takes them from the chat "
        "template)"))
    spec_decode: SpecDecode = field(default=SpecDecode.OFF, metadata=_help(
        "eagle: hits drop one block for the draft model (vLLM's use_eagle)"))
    hash_algo: HashAlgo = field(default=HashAlgo.XXH3_128, metadata=_help(
        "block hash (equal hits with any)"))
    hash_seed: int = field(default=0, metadata=_help(
        "seed of the block hash chain"))
    events: KVEvents = KVEvents.OFF

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = ENUM_FIELDS.get(f.name)
            if kind is not None and not isinstance(value, kind):
                raise ConfigError(f"{f.name} must be one of {[m.value for m in kind]}, got {value!r}")
        if not isinstance(self.turn_checkpoints, bool):
            raise ConfigError(f"turn_checkpoints must be true or false, got {self.turn_checkpoints!r}")
        for name in ("prefix_cache_retention_interval", "checkpoint_interval_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0 or value > _MAX_TOKENS):
                raise ConfigError(f"{name} must be None or an integer in [0, {_MAX_TOKENS}], "
                                  f"got {value!r}")
        if not _is_int(self.cache_aware_admission_window) or self.cache_aware_admission_window < 0:
            raise ConfigError(f"cache_aware_admission_window must be an integer >= 0, got "
                              f"{self.cache_aware_admission_window!r}")
        threshold = self.cache_aware_admission_threshold
        if not isinstance(threshold, int | float) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"cache_aware_admission_threshold must be a number in [0, 1], got {threshold!r}")
        if self.checkpoint_interval_tokens == 0:
            raise ConfigError("checkpoint_interval_tokens must be None or a positive integer, got 0")
        if not _is_int(self.hash_seed) or not 0 <= self.hash_seed < 2**64:
            raise ConfigError(f"hash_seed must be an integer in [0, 2**64), got {self.hash_seed!r}")
        if self.prefix_match_unit is not None:
            check_prefix_match_unit(self.prefix_match_unit)
        check_running_state_mode(self.running_state, self.mamba_cache_mode)

    def replace(self, **changes: Any) -> CacheOptions:
        """A copy with `changes` (field names; enum members or their string values)."""
        return options_from(self, changes)

    @property
    def caching(self) -> bool:
        return self.prefix_caching is PrefixCaching.ON

    def match_unit(self, config: KVCacheConfig) -> MatchUnit:
        """Where hits land for `config`'s groups (vLLM's prefix_match_unit resolved; ConfigError where vLLM refuses)."""
        return resolve_match_unit(config.groups, self.prefix_match_unit, caching=self.caching,
                                  mamba_cache_mode=self.mamba_cache_mode)

    def validate(self, config: KVCacheConfig) -> MatchUnit:
        """The checks that need the planned groups; returns the resolved match unit.

        Raises:
            ConfigError: a combination this manager does not support for these groups, naming the option.
        """
        unit = self.match_unit(config)
        if unit.partial_hits and config.pages_per_state > 1:
            raise ConfigError(
                f"prefix_match_unit={unit.hash_unit_tokens} makes hits land inside the {unit.scheduler_block_tokens}-"
                f"token blocks of this layout (partial hits), which this manager does not combine with the "
                f"multi_page state layout; expected a unit of at least {unit.scheduler_block_tokens} tokens (or None), "
                f"or that option off")
        if self.running_state.one_state and unit.partial_hits:
            raise ConfigError(
                f"running_state={self.running_state.value} with prefix_match_unit={unit.hash_unit_tokens} (hits inside "
                f"the {unit.scheduler_block_tokens}-token blocks) is not supported; expected a unit of at least "
                f"{unit.scheduler_block_tokens} tokens (or None), or running_state moving")
        _check_spec_decode(config, self.spec_decode)
        return unit


def _check_spec_decode(config: KVCacheConfig, spec_decode: SpecDecode) -> None:
    """EAGLE's hit rule is modelled for attention groups of one block size (full, sliding window)."""
    if spec_decode is SpecDecode.OFF:
        return
    kinds = {g.kind for g in config.groups}
    sizes = sorted({g.block_size for g in config.groups})
    if not kinds <= {SpecKind.FULL, SpecKind.SLIDING_WINDOW} or len(sizes) > 1:
        raise ConfigError(
            f"spec_decode={spec_decode.value} is modelled for full and sliding-window groups of one block size; "
            f"got kinds {sorted(k.value for k in kinds)} and block sizes {sizes}")


_MAX_TOKENS = 2**40
ENUM_FIELDS: dict[str, type[Enum]] = {
    "prefix_caching": PrefixCaching, "mamba_cache_mode": MambaCacheMode, "state_layout": StateLayout,
    "running_state": RunningState, "sliding_window_caching": SlidingWindowCaching, "eviction": EvictionPolicyName,
    "checkpoint_placement": CheckpointPlacement, "decode_checkpoints": DecodeCheckpoints,
    "admission_headroom": AdmissionHeadroom, "queue_order": QueueOrder, "release_order": ReleaseOrder,
    "online_choice": OnlineChoice,
    "spec_decode": SpecDecode, "hash_algo": HashAlgo, "events": KVEvents,
}
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CacheOptions))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce(name: str, value: object) -> object:
    """`value` for field `name`: an enum member from its string value; other values as given."""
    kind = ENUM_FIELDS.get(name)
    if kind is None or isinstance(value, kind):
        return value
    values = [m.value for m in kind]
    if isinstance(value, str) and value in values:
        return kind(value)
    raise ConfigError(f"{name} must be one of {values}, got {value!r}")


def options_from(base: CacheOptions | str, changes: Mapping[str, object]) -> CacheOptions:
    """`base` (a preset name or options) with `changes` applied; the keys are `CacheOptions` field
    names, the values enum members, their string values, integers, None or booleans.

    Raises:
        ConfigError: an unknown preset or field, or a value the field does not take (one line, naming it).
    """
    start = preset(base) if isinstance(base, str) else base
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise ConfigError(f"unknown cache option {unknown[0]!r}; expected one of {', '.join(FIELDS)}")
    coerced: dict[str, Any] = {k: _coerce(k, v) for k, v in changes.items()}
    return dataclasses.replace(start, **coerced)


def describe(options: CacheOptions) -> str:
    """`options` in words: a preset's name, or the nearest preset with the fields that differ
    (`vllm + eviction=value`)."""
    best = ""
    best_changes: list[str] = []
    for name, setting in PRESETS.items():
        changes = [f"{f}={_value(getattr(options, f))}" for f in FIELDS if getattr(options, f) != getattr(setting, f)]
        if not best or len(changes) < len(best_changes):
            best, best_changes = name, changes
    return " + ".join([best, *best_changes])


def _value(value: object) -> object:
    return value.value if isinstance(value, Enum) else value


def preset(name: str) -> CacheOptions:
    """The preset called `name`.

    Raises:
        ConfigError: no such preset (the message lists them).
    """
    found = PRESETS.get(name)
    if found is None:
        raise ConfigError(f"unknown cache preset {name!r}; expected one of {', '.join(PRESETS)}")
    return found


#: `CacheOptions()`: the manager's mechanism defaults (module docstring)
MECHANISM_DEFAULTS = CacheOptions()

#: The named settings (module docstring). "hybridkv" is `bench_hits.py --targets`' OURS.
PRESETS: dict[str, CacheOptions] = {
    "vllm": CacheOptions(release_order=ReleaseOrder.BY_GROUP),
    "hybridkv": CacheOptions(
        eviction=EvictionPolicyName.VALUE, checkpoint_placement=CheckpointPlacement.PLACED,
        release_order=ReleaseOrder.INTERLEAVED, state_layout=StateLayout.MULTI_PAGE,
        running_state=RunningState.ADOPT, decode_checkpoints=DecodeCheckpoints.LAST,
        admission_headroom=AdmissionHeadroom.WAITING_HITS, queue_order=QueueOrder.CACHE_AWARE,
        turn_checkpoints=True, online_choice=OnlineChoice.GHOSTS),
}
#: The preset `run`, `serve`, `simulate` and `LLM` start from when none is named (docs/prefix_caching.md says why).
DEFAULT_PRESET = "vllm"
