"""Cache policies: guests of the KV cache manager, called at fixed points, each holding its own state.

The manager, coordinator, type managers and block pool are mechanism: they keep blocks, tables,
hits and the free queue exactly (vLLM's behaviour when every policy is off). A policy changes a
decision through one of these fixed points and nothing else:

    point              who calls it                      what a policy may do there
    looked_up          manager.lookup                    learn branch depths; set checkpoint stops
    admitted           manager.allocate, a new request   record its anchors / hit end
    allocated          manager.allocate (and decode)     mark blocks now allocated
    finished           manager.free                      mark the sequence end
    waiting            manager.protect_waiting           note the blocks a waiting request will hit
    new_step           manager.begin_step                forget last step's waiting hits
    reserve            coordinator.allocate (admission)  blocks a new request must leave free
    eviction order     block pool (`eviction.py`)        which free block is reused next

Modules (one policy each; `options.py` holds their knobs):

    value.py       value-aware eviction (`--eviction value`): an eviction order plus marks
    anchors.py     anchors and per-kind reuse rates (with value-aware eviction)
    placement.py   checkpoint placement (`--checkpoint-placement`)
    headroom.py    admission headroom (`--admission-headroom`)
    adoption.py    state adoption (`--running-state adopt`)

`build_policies` makes the set a `CacheOptions` asks for; `CachePolicies.stats()` is the one public
view of their state (tests and reports read it, never a private field). A new policy: a field in
`options.py`, a module here implementing the hooks it needs of `CachePolicy`, one line in
`build_policies`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.eviction import BlockMarks, BlockValue, LRUPolicy, PolicyFactory
from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.options import (
    CacheOptions,
    CheckpointPlacement,
    EvictionPolicyName,
    RunningState,
)
from hybridkv.kvcache.policies.adoption import StateAdoption
from hybridkv.kvcache.policies.anchors import Anchors
from hybridkv.kvcache.policies.headroom import AdmissionReserve, admission_reserve
from hybridkv.kvcache.policies.placement import CheckpointPlanner
from hybridkv.kvcache.policies.value import ValuePolicy
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.type_managers.base import SingleTypeManager

__all__ = ["EVICTION_POLICIES", "CachePolicies", "PolicyStats", "build_policies", "eviction_factory"]

#: Every eviction order a manager can be built with (`--eviction`).
EVICTION_POLICIES: dict[EvictionPolicyName, PolicyFactory] = {
    EvictionPolicyName.LRU: LRUPolicy,
    EvictionPolicyName.VALUE: ValuePolicy,
}


def eviction_factory(name: EvictionPolicyName) -> PolicyFactory:
    return EVICTION_POLICIES[name]


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyStats:
    """What the policies learned and did (`KVCacheManager.policies.stats()`)."""

    eviction: str
    #: per anchor kind: (anchors made, anchors a later hit ended at); empty without anchors
    anchor_reuse: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: state hits moved into running states (RunningState.ADOPT)
    state_adoptions: int = 0
    #: branch depths (tokens) placed checkpoints go to now (PLACED)
    popular_depths: tuple[int, ...] = ()
    #: blocks the waiting requests' hits take this step (AdmissionHeadroom.WAITING_HITS)
    waiting_hit_blocks: int = 0


class CachePolicies:
    """The policies one manager runs (module docstring); attributes are None where a policy is off."""

    def __init__(self, *, options: CacheOptions, pool: BlockPool, marks: BlockMarks | None,
                 placement: CheckpointPlanner, anchors: Anchors | None, reserve: AdmissionReserve | None,
                 adoption: StateAdoption | None) -> None:
        self.options = options
        self._pool = pool
        #: value-aware eviction's marking verbs; None with LRU
        self.marks = marks
        self.placement = placement
        self.anchors = anchors
        self.reserve = reserve
        self.adoption = adoption
        #: the lookup learns depths and places stops (PLACED); with JUNCTION only a request's hints do
        self.placing = options.checkpoint_placement is not CheckpointPlacement.JUNCTION

    def looked_up(self, request: KVRequest, longest_tokens: int) -> None:
        """After a lookup whose full-attention groups matched `longest_tokens`: the request's checkpoint stops.
        The manager calls it only when there is work (placement on, or the request has hints)."""
        if self.placing:
            self.placement.observe(longest_tokens)
        request.checkpoint_stops = self.placement.stops(request)

    def waiting(self, ids: Sequence[int]) -> None:
        """A waiting request will hit `ids` (free cached blocks kept, and kept free at admission)."""
        if self.marks is not None:
            self.marks.protect(ids)
        if self.reserve is not None:
            self.reserve.waiting(ids)

    def waiting_prefix(self, managers: Sequence[SingleTypeManager], hashes: dict[int, list[BlockHash]],
                       hit_tokens: int) -> None:
        """`waiting` for the cached blocks of a waiting request's hit of `hit_tokens`; a state hit there
        is one adoption must leave alone (another waiting request hits it too)."""
        ids: list[int] = []
        for m in managers:
            found = m.hit_block_ids(m.view, hashes, hit_tokens)
            if m.copies_hits and found and self.adoption is not None:
                self.adoption.waiting(found[0])
            ids += found
        self.waiting(ids)

    def value_of(self, block: int) -> BlockValue | None:
        """The class `block` would be released into now (value-aware eviction), None with LRU."""
        return self.marks.value_of(block) if self.marks is not None else None

    def anchor_share(self, block: int) -> float | None:
        """The share of the ANCHOR bonus `block` gets (value-aware eviction), None with LRU."""
        return self.marks.share_of(block) if self.marks is not None else None

    def eviction_order(self, *, cached_only: bool = False) -> list[int]:
        """The free blocks in the order the pool reuses them (first = next), or only those still cached."""
        order = self._pool.eviction.ordered()
        return [b for b in order if self._pool.hash_of(b) is not None] if cached_only else order

    def stats(self) -> PolicyStats:
        return PolicyStats(
            eviction=self.options.eviction.value,
            anchor_reuse=self.anchors.rates.counts() if self.anchors is not None else {},
            state_adoptions=self.adoption.adoptions if self.adoption is not None else 0,
            popular_depths=tuple(self.placement.popular),
            waiting_hit_blocks=len(self.reserve.waiting_hits) if self.reserve is not None else 0)


def build_policies(options: CacheOptions, pool: BlockPool, managers: Sequence[SingleTypeManager], *,
                   alignment_tokens: int) -> CachePolicies:
    """The policies `options` asks for, over `pool` (built with `eviction_factory(options.eviction)`) and the
    type managers; hands the marking verbs to the managers that mark."""
    marks = cast("BlockMarks", pool.eviction) if options.eviction is EvictionPolicyName.VALUE else None
    for manager in managers:
        manager.marks = marks
    adopt = options.running_state is RunningState.ADOPT
    anchors = (Anchors(managers, alignment_tokens, marks.mark, prompt_ends=not adopt)
               if marks is not None and options.caching else None)
    return CachePolicies(
        options=options, pool=pool, marks=marks,
        placement=CheckpointPlanner(options.checkpoint_placement, alignment_tokens=alignment_tokens,
                                    interval_tokens=options.checkpoint_interval_tokens),
        anchors=anchors,
        reserve=admission_reserve(pool, options.admission_headroom, pool.num_groups),
        adoption=StateAdoption(pool, anchors.fresh_end) if anchors is not None and adopt else None)
