"""What the KV cache manager's verbs take and answer: modes, cache hits, new blocks, state steps, stats.

Value objects only (`manager.py` re-exports every name, so `from hybridkv.kvcache.manager import
CacheHit` keeps working).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, cast

from hybridkv.errors import AllocationError
from hybridkv.kvcache.hit_limits import HitLimit
from hybridkv.kvcache.ids import NULL_BLOCK_ID, BlockId, GroupId, RequestId


class CacheTiming(Enum):
    """When `allocate` caches the newly full blocks: now, or later through `cache`
    (external KV still loading asynchronously)."""

    IMMEDIATE = "immediate"
    DELAYED = "delayed"


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheHit:
    """The answer of `lookup`: `num_tokens` cached tokens and their block ids per group
    (0 = the null block, where a group skips the block). Pass it to `allocate` unchanged."""

    request_id: RequestId
    num_tokens: int
    blocks: tuple[tuple[BlockId, ...], ...]
    #: The hit uses a state checkpoint cached in the current step (its state is written only when
    #: the step runs): `allocate` refuses it (returns None) until the next `begin_step`. Keep the
    #: request waiting (no preemption helps) and look it up again in the next step.
    deferred: bool = False
    pool_epoch: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise AllocationError(f"a cache hit cannot have {self.num_tokens} tokens; expected >= 0")


class NewBlocks(tuple[tuple[BlockId, ...], ...]):
    """The answer of `allocate`: per group (ascending group id), the block ids the step added
    to the request's table, to append to the runner's block table after `CacheHit.blocks`
    (0 = the null block where a group skips a position; empty where a group added nothing).

    After a partial hit (its length not a multiple of a group's block size) the group's first
    new entry is the request's private copy of the hit's last block, and replaces it.

    A tuple of tuples, so `new[g]` and comparison with a plain tuple work as for one."""

    __slots__ = ()

    @classmethod
    def of_ints(cls, entries: Iterable[tuple[int, ...]]) -> NewBlocks:
        """The coordinator's int entries (block ids from the pool) as `NewBlocks`."""
        return cls(cast("Iterable[tuple[BlockId, ...]]", entries))

    @property
    def num_blocks(self) -> int:
        """New real (non-null) blocks over all groups."""
        return sum(1 for entries in self for block in entries if block != NULL_BLOCK_ID)


class BlockCopy(NamedTuple):
    """A copy the engine runs before the step's forward (`take_pending_copies`): every page of
    `src_block_id` to `dst_block_id`, both blocks of group `group_id` (the K/V pages of an
    attention group, the state of a state group). A partial hit's private block, or a state's
    partial checkpoint kept before its own request overwrites it.

    A named tuple (immutable, built without a Python `__init__`): a multi-page state's checkpoint
    is one copy per page group, hundreds per checkpoint, and a long trace makes millions."""

    group_id: GroupId
    src_block_id: BlockId
    dst_block_id: BlockId


@dataclass(frozen=True, slots=True, kw_only=True)
class StateCheckpoint:
    """The state of a state group after the request's first `num_tokens` tokens, in `block_id`."""

    num_tokens: int
    block_id: BlockId


@dataclass(frozen=True, slots=True, kw_only=True)
class StateStep:
    """What the layers of one state group read and write in one step of one request.

    `read`: the state the step starts from (None: the step starts at token 0, from a zero
    state); after a cache hit it is the hit's checkpoint block, to restore from. `writes`:
    every state the step must store, ascending by `num_tokens`; the last one is the state after
    the step's last token (the running state). ALIGN mode writes one state; ALL mode also one
    per block boundary the step crosses. A write may name the read block (the state is then
    updated in place); it never names a block another request can read.
    """

    group_id: GroupId
    read: StateCheckpoint | None
    writes: tuple[StateCheckpoint, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerStats:
    """Prefix-cache statistics since construction.

    `query_tokens` sums the prompt lengths looked up, `hit_tokens` the hits returned;
    `group_hit_tokens[g]` sums what group g alone could serve when the coordinator first asked
    it (full attention: the whole prompt; other types: the candidate length at that point),
    which shows which group limits the hit; `limited_by[g]` counts why group g could not serve
    the next aligned length after the hit (`hit_limits.py`).
    """

    lookups: int
    query_tokens: int
    hit_tokens: int
    group_hit_tokens: tuple[int, ...]
    #: per group, lookups whose hit this group stopped, by reason (`hit_limits.HitLimit`)
    limited_by: tuple[dict[HitLimit, int], ...] = ()
    #: block copies handed out by `take_pending_copies` (partial hits' copy on write; FIXED hits)
    block_copies: int = 0
    #: RunningState.FIXED: block copies out of running states into checkpoints (one per page group,
    #: `take_checkpoint_copies`), and checkpoints skipped for want of free blocks (`running_state.py`)
    checkpoint_copies: int = 0
    checkpoints_skipped: int = 0
    #: RunningState.ADOPT: state hits moved into a new request's running state instead of copied
    state_adoptions: int = 0
    #: value eviction: per anchor kind (`checkpoints.AnchorKind` value), (anchors made, anchors a later hit
    #: ended at): the reuse rates that scale each anchor's bonus
    anchor_reuse: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


