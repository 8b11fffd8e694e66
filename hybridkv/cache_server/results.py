"""What the store's operations answer (the control loop turns each into its wire reply)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.wire import Refusal


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupResult:
    lookup_id: int  # 0 when nothing is held (no hit)
    hit_tokens: int
    object_group_hit_tokens: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreResult:
    stored: list[bool]
    refusals: list[Refusal]  # the first limits.MAX_REFUSALS_REPLIED
    refusals_left_out: int
    object_group_bytes: list[int]  # bytes copied from the engine, per object group


@dataclass(frozen=True, slots=True, kw_only=True)
class RetrieveResult:
    tokens: int
    bytes_copied: int
    object_group_bytes: list[int]  # bytes copied to the engine, per object group


@dataclass(frozen=True, slots=True, kw_only=True)
class ClearResult:
    objects_removed: int  # from L1
    problems: list[str]  # what an L2 tier could not clear (empty: everything went)
