"""Cache policies: guests of the KV cache manager, called at fixed points, each holding its own state.

The manager, coordinator, type managers and block pool are mechanism: they keep blocks, tables,
hits and the free queue exactly (vLLM's behaviour when every policy is off). A policy changes a
decision through one of these fixed points and nothing else:

    point              who calls it                      what a policy may do there
    looked_up          manager.lookup                    learn branch depths; set checkpoint stops
    admitted           manager.allocate, a new request   record its anchors / hit end; ghosts look it up
    allocated          manager.allocate (and decode)     mark blocks now allocated; ghosts follow
    finished           manager.free                      mark the sequence end; ghosts free it
    waiting            manager.protect_waiting           note the blocks a waiting request will hit
    new_step           manager.begin_step                forget last step's waiting hits; ghosts step
    reserve            coordinator.allocate (admission)  blocks a new request must leave free
    eviction order     block pool (`eviction.py`)        which free block is reused next

Modules (one policy each; `options.py` holds their knobs):

    value.py       value-aware eviction (`--eviction value`): an eviction order plus marks
    anchors.py     anchors and per-kind reuse rates (with value-aware eviction)
    placement.py   checkpoint placement (`--checkpoint-placement`)
    headroom.py    admission headroom (`--admission-headroom`)
    adoption.py    state adoption (`--running-state adopt`)
    ghosts.py      the online choice (`--online-choice ghosts`): shadow managers pick the knobs

`build_policies` makes the set a `CacheOptions` asks for; `CachePolicies.stats()` is the one public
view of their state (tests and reports read it, never a private field). A new policy: a field in
`options.py`, a module here implementing the hooks it needs of `CachePolicy`, one line in
`build_policies`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

from hybridkv.kvcache.block_pool import BlockPool
from hybridkv.kvcache.eviction import BlockMarks, BlockValue, Ids, LRUPolicy, PolicyFactory
from hybridkv.kvcache.ids import BlockHash
from hybridkv.kvcache.options import (
    CacheOptions,
    CheckpointPlacement,
    EvictionPolicyName,
    MambaCacheMode,
    RunningState,
)
from hybridkv.kvcache.policies.adoption import StateAdoption
from hybridkv.kvcache.policies.anchors import Anchors
from hybridkv.kvcache.policies.ghosts import Choice, GhostDuel, GhostManager, GhostStats, candidates
from hybridkv.kvcache.policies.headroom import AdmissionReserve, admission_reserve
from hybridkv.kvcache.policies.placement import CheckpointPlanner
from hybridkv.kvcache.policies.value import ValuePolicy, ValueWeights
from hybridkv.kvcache.request import KVRequest
from hybridkv.kvcache.type_managers.base import SingleTypeManager
from hybridkv.kvcache.type_managers.state import MambaManager

__all__ = ["EVICTION_POLICIES", "CachePolicies", "Choice", "Observer", "PolicyStats", "build_policies",
           "eviction_factory"]

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
    #: the online choice's ghosts and current choice (OnlineChoice.GHOSTS), else None
    online: GhostStats | None = None


class Observer(Protocol):
    """The request events a policy follows (the manager calls them; `CachePolicies.observer`)."""

    def admitted(self, request: KVRequest, hit_tokens: int) -> None: ...
    def allocated(self, request: KVRequest, end: int) -> None: ...
    def finished(self, request: KVRequest) -> None: ...


class _Both:
    """Anchors and ghosts, each told every event (anchors first: the live manager's marks)."""

    def __init__(self, first: Observer, second: Observer) -> None:
        self._first, self._second = first, second

    def admitted(self, request: KVRequest, hit_tokens: int) -> None:
        self._first.admitted(request, hit_tokens)
        self._second.admitted(request, hit_tokens)

    def allocated(self, request: KVRequest, end: int) -> None:
        self._first.allocated(request, end)
        self._second.allocated(request, end)

    def finished(self, request: KVRequest) -> None:
        self._first.finished(request)
        self._second.finished(request)


class CachePolicies:
    """The policies one manager runs (module docstring); attributes are None where a policy is off."""

    def __init__(self, *, options: CacheOptions, pool: BlockPool, managers: Sequence[SingleTypeManager],
                 marks: BlockMarks | None, placement: CheckpointPlanner, anchors: Anchors | None,
                 reserve: AdmissionReserve | None, adoption: StateAdoption | None) -> None:
        self.options = options
        self._pool = pool
        self._managers = managers
        #: value-aware eviction's marking verbs; None with LRU
        self.marks = marks
        self.placement = placement
        self.anchors = anchors
        self.reserve = reserve
        self.adoption = adoption
        #: the lookup learns depths and places stops (PLACED); with JUNCTION only a request's hints do
        self.placing = options.checkpoint_placement is not CheckpointPlacement.JUNCTION
        #: the online choice (`start_ghosts`), None when off
        self.duel: GhostDuel | None = None
        #: who follows admitted / allocated / finished (anchors, ghosts), None when nobody does
        self.observer: Observer | None = anchors

    @property
    def choice(self) -> Choice:
        """The switchable knobs as they are now (`apply`)."""
        states = [m for m in self._managers if isinstance(m, MambaManager)]
        retention = states[0].retention if states else None
        interval = retention.interval_tokens if retention is not None else self.options.prefix_cache_retention_interval
        bonuses = not isinstance(self.marks, ValuePolicy) or self.marks.weights != ValueWeights.recency_only()
        return Choice(state_retention=interval, value_bonuses=bonuses)

    def apply(self, choice: Choice) -> None:
        """Switch the knobs to `choice` from now on: value-aware eviction's class bonuses (the free
        queue re-scored at once) and the state groups' checkpoint retention (the next checkpoints)."""
        if isinstance(self.marks, ValuePolicy):
            self.marks.set_weights(ValueWeights() if choice.value_bonuses else ValueWeights.recency_only())
        for manager in self._managers:
            if isinstance(manager, MambaManager) and manager.retention is not None:
                manager.retention = dataclasses.replace(manager.retention, interval_tokens=choice.state_retention)

    def start_ghosts(self, make_ghost: Callable[[], tuple[GhostManager, CachePolicies]]) -> None:
        """Run the online choice: one ghost per candidate (`ghosts.candidates`), each a manager from
        `make_ghost` (with these options, the online choice off) switched to its choice."""
        has_states = self.options.mamba_cache_mode is MambaCacheMode.ALIGN and any(m.is_state for m in self._managers)
        choices = candidates(self.choice, has_value=isinstance(self.marks, ValuePolicy), has_states=has_states)
        if len(choices) < 2:
            return

        def ghost(choice: Choice) -> GhostManager:
            manager, policies = make_ghost()
            policies.apply(choice)
            return manager

        pool = self._pool
        self.duel = GhostDuel(choices, ghost, self.apply, pressure=lambda: pool.evictions > 0)
        self.observer = self.duel if self.anchors is None else _Both(self.anchors, self.duel)

    def new_step(self) -> None:
        if self.duel is not None:
            self.duel.new_step()

    def looked_up(self, request: KVRequest, longest_tokens: int) -> None:
        """After a lookup whose full-attention groups matched `longest_tokens`: the request's checkpoint stops.
        The manager calls it only when there is work (placement on, or the request has hints)."""
        if self.placing:
            self.placement.observe(longest_tokens)
        request.checkpoint_stops = self.placement.stops(request)

    def waiting(self, ids: Sequence[int] | Ids) -> None:
        """A waiting request will hit `ids` (free cached blocks kept, and kept free at admission)."""
        if self.marks is not None:
            self.marks.protect(ids)
        if self.reserve is not None:
            self.reserve.waiting(ids)

    def hit_ids(self, hashes: dict[int, list[BlockHash]], hit_tokens: int) -> tuple[list[int], list[int]]:
        """The cached blocks of a hit of `hit_tokens` on the chain `hashes`, and the first block of each state
        hit a group copies (`copies_hits`), for `waiting_prefix`."""
        ids: list[int] = []
        states: list[int] = []
        for m in self._managers:
            found = m.hit_block_ids(m.view, hashes, hit_tokens)
            if m.copies_hits and found:
                states.append(found[0])
            ids += found
        return ids, states

    def waiting_prefix(self, ids: Sequence[int] | Ids, states: list[int]) -> None:
        """`waiting` for the blocks of a waiting request's hit (`hit_ids`); its state hits are ones adoption
        must leave alone (another waiting request hits them too)."""
        if self.adoption is not None:
            for block in states:
                self.adoption.waiting(block)
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
            waiting_hit_blocks=len(self.reserve.waiting_hits) if self.reserve is not None else 0,
            online=self.duel.stats() if self.duel is not None else None)


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
        options=options, pool=pool, managers=managers, marks=marks,
        placement=CheckpointPlanner(options.checkpoint_placement, alignment_tokens=alignment_tokens,
                                    interval_tokens=options.checkpoint_interval_tokens),
        anchors=anchors,
        reserve=admission_reserve(pool, options.admission_headroom, pool.num_groups),
        adoption=StateAdoption(pool, anchors.fresh_end) if anchors is not None and adopt else None)
