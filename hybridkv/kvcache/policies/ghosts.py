"""The online choice (`--online-choice ghosts`): shadow managers measure what each setting would hit.

No static setting wins everywhere. Measured on `bench_hits.py`'s cells: keeping state checkpoints
only at the replay boundary (vLLM's `prefix_cache_retention_interval 0`) wins on long multi-turn
sessions with big states at a quarter of the working set (a Nemotron-H checkpoint costs seven
blocks, ~9k tokens of its attention KV), and loses a third of the hits on chats and at full
memory; value-aware eviction's class bonuses win where anchors recur and lose to plain recency
where they do not. So the manager learns which one the traffic it serves wants:

    live manager ──admitted / allocated / finished / new step──▶ every ghost
       ▲                                                           │ (own lookup, own cache)
       └──── apply(best choice) ◀── decayed hit tokens per ghost ◀─┘

A *ghost* is a metadata-only `KVCacheManager` (block ids and hashes, no KV bytes) with the live
manager's config and options and one fixed `Choice`. It replays each request the live manager
admits: its own lookup at admission (the hit it scores), then every step to the end the live
request reached, then the free; it never holds a block the live one does not, so its pool is
as full as the live one's. A ghost that cannot allocate drops that request (counted). Each
ghost's score is its hit tokens with an exponential decay (`HALF_LIFE_ADMISSIONS`); every
`DECIDE_EVERY` admissions the live manager takes the best-scoring choice, switching only when it
beats the current one by `SWITCH_MARGIN` (no flapping on noise). A switch changes what happens
from then on (the blocks cached so far stay): the bonus weights re-score the free queue at once,
the retention rule applies to the next checkpoints.

The candidates (`candidates`): the options' own setting first, then each combination of the
switchable knobs the layout has -- value bonuses on / recency only (value-aware eviction only)
and, with state groups in align mode, dense checkpoints / retention 0.

Cost: one manager's work per ghost per step (no KV, no model), i.e. up to 4x the manager's own, and
only from the live pool's first eviction of a cached block on: before it every choice hits alike
(nothing was lost to a choice yet), so a pool that holds the whole working set never pays for ghosts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.request import KVRequest

#: admissions after which a ghost's hits count half (the scores follow the traffic as it changes)
HALF_LIFE_ADMISSIONS = 256
#: admissions between two decisions (and before the first one)
DECIDE_EVERY = 8
#: how much more a ghost must have hit than the current choice's for the live manager to switch
SWITCH_MARGIN = 0.02
#: the ghosts start when the live pool first evicts a cached block (`GhostDuel`'s `pressure`)
START_UNDER_PRESSURE = True
#: waiting requests per step whose hits each ghost protects: the head of the queue, in the order admission
#: tries them (the live manager protects up to 64, `queue_order.PROBE_WINDOW`). Protection pays where a
#: request is admitted soon; probing 64 in each of 4 ghosts every step was half the run time of a
#: 2,000-request trace at 25% of its working set. Measured at 300 requests of the production-like trace
#: at 25%: equal hits on Gemma 3 and Qwen3.5, 41% / 28% less CPU
GHOST_WAITING = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """One setting of the knobs a running manager can switch (`CachePolicies.apply`)."""

    #: state checkpoints: None (every aligned boundary) or 0 (the replay boundary and junction only)
    state_retention: int | None
    #: value-aware eviction's class bonuses: True as configured, False recency only
    value_bonuses: bool

    def describe(self) -> str:
        dense = "dense" if self.state_retention is None else f"retention {self.state_retention}"
        return f"{dense}, {'value bonuses' if self.value_bonuses else 'recency only'}"


def candidates(first: Choice, *, has_value: bool, has_states: bool) -> list[Choice]:
    """`first`, then every other combination of the switchable knobs this manager has."""
    retentions: list[int | None] = [first.state_retention, *([0 if first.state_retention is None else None]
                                                            if has_states else [])]
    bonuses = [first.value_bonuses, *([not first.value_bonuses] if has_value else [])]
    return [Choice(state_retention=r, value_bonuses=b) for r, b in itertools.product(retentions, bonuses)]


class GhostHit(Protocol):
    @property
    def num_tokens(self) -> int: ...
    @property
    def deferred(self) -> bool: ...


class GhostManager(Protocol):
    """What a ghost needs of a `KVCacheManager` (the policies room cannot import the manager)."""

    def begin_step(self) -> None: ...
    def lookup(self, request: KVRequest) -> Any: ...  # (a CacheHit: results.py is the manager's room)
    def allocate(self, request: KVRequest, num_new_tokens: int, *, hit: Any = None) -> object: ...
    def free(self, request: KVRequest) -> None: ...
    def peek(self, request: KVRequest) -> int: ...
    def protect_waiting(self, request: KVRequest, hit_tokens: int) -> None: ...
    def take_pending_copies(self) -> object: ...
    def take_checkpoint_copies(self) -> object: ...


@dataclass(slots=True)
class _Shadow:
    """A live request as one ghost replays it."""

    request: KVRequest
    end: int = 0  # tokens the ghost allocated up to
    ran: int = 0  # of those, the tokens of steps that ran (the end before the last allocate)
    live_end: int = 0  # the live request's end at the last allocate
    hit: GhostHit | None = None  # the ghost's own hit, until its first allocate


@dataclass(slots=True)
class Ghost:
    """One shadow manager and what it measured."""

    choice: Choice
    manager: GhostManager
    score: float = 0.0
    hit_tokens: int = 0
    dropped: int = 0
    requests: dict[RequestId, _Shadow] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class GhostStats:
    """The online choice's public view (`PolicyStats.online`)."""

    current: str
    switches: int
    #: whether the ghosts run (they start at the live pool's first eviction)
    started: bool
    #: per candidate: (its description, hit tokens its ghost found, requests it dropped)
    ghosts: tuple[tuple[str, int, int], ...]


class GhostDuel:
    """The ghosts of one live manager and the decision (module docstring)."""

    def __init__(self, choices: Sequence[Choice], make_ghost: Callable[[Choice], GhostManager],
                 apply: Callable[[Choice], None], *, pressure: Callable[[], bool] | None = None) -> None:
        """Ghosts of `choices` (the live manager's own first) from `make_ghost`; `apply` switches the live
        manager. With `pressure` (and `START_UNDER_PRESSURE`) the ghosts are built only once it says so
        (the live pool evicted a cached block): until then every choice hits alike, and nothing is spent."""
        self.choices = list(choices)
        self.ghosts: list[Ghost] = []
        self.current = 0
        self.switches = 0
        self._make_ghost = make_ghost
        self._apply = apply
        self._pressure = pressure if START_UNDER_PRESSURE else None
        self._admissions = 0
        self._waiting = 0  # waiting requests protected in this step
        self._decay = 0.5 ** (1 / HALF_LIFE_ADMISSIONS)
        if self._pressure is None:
            self._start()

    def _start(self) -> None:
        self.ghosts = [Ghost(choice=c, manager=self._make_ghost(c)) for c in self.choices]
        self._pressure = None

    # -- the live manager's events ----------------------------------------------------------------

    def admitted(self, request: KVRequest, hit_tokens: int) -> None:
        """The live manager admitted `request` (new or resumed after preemption): each ghost looks it up."""
        del hit_tokens
        if self._pressure is not None:
            if not self._pressure():
                return
            self._start()
        decay = self._decay
        for ghost in self.ghosts:
            if request.request_id in ghost.requests:
                self._drop(ghost, request.request_id)  # (re-admitted without a free: start over)
            shadow = _Shadow(request=_copy(request))
            hit = ghost.manager.lookup(shadow.request)
            got = 0 if hit.deferred else hit.num_tokens
            ghost.score = ghost.score * decay + got
            ghost.hit_tokens += got
            shadow.hit = hit if got else None
            ghost.requests[request.request_id] = shadow
        self._admissions += 1
        if self._admissions % DECIDE_EVERY == 0:
            self._decide()

    def allocated(self, request: KVRequest, end: int) -> None:
        """The live `request` holds slots up to `end` tokens for this step: each ghost follows."""
        for ghost in self.ghosts:
            shadow = ghost.requests.get(request.request_id)
            if shadow is None:
                continue
            shadow.live_end = end
            hit, shadow.hit = shadow.hit, None
            if hit is not None:  # the admission step: allocate past the ghost's own hit
                new = max(end, hit.num_tokens + 1) - hit.num_tokens
                if ghost.manager.allocate(shadow.request, new, hit=hit) is None:
                    self._drop(ghost, request.request_id)
                    continue
                shadow.ran = hit.num_tokens
                shadow.end = hit.num_tokens + new
                continue
            if shadow.end:  # a running request: its last step ran
                shadow.ran = shadow.request.num_computed_tokens = shadow.end
            if end <= shadow.end:
                continue  # the ghost is ahead (a longer hit)
            if ghost.manager.allocate(shadow.request, end - shadow.end) is None:
                self._drop(ghost, request.request_id)
                continue
            shadow.end = end

    def finished(self, request: KVRequest) -> None:
        """The live manager freed `request`: each ghost frees its copy (what its steps computed cached)."""
        for ghost in self.ghosts:
            shadow = ghost.requests.pop(request.request_id, None)
            if shadow is None:
                continue
            ran = request.num_computed_tokens >= shadow.live_end
            shadow.request.num_computed_tokens = shadow.end if ran else shadow.ran
            ghost.manager.free(shadow.request)

    def waiting(self, request: KVRequest) -> None:
        """`request` waits this step: each ghost keeps its own hit for it, as the live manager does (the
        first `GHOST_WAITING` of the step)."""
        if not self.ghosts or self._waiting >= GHOST_WAITING:
            return
        self._waiting += 1
        copy = _copy(request)  # (one for every ghost: peek and protect_waiting leave a request as it is)
        for ghost in self.ghosts:
            if request.request_id not in ghost.requests:
                ghost.manager.protect_waiting(copy, ghost.manager.peek(copy))

    def new_step(self) -> None:
        self._waiting = 0
        for ghost in self.ghosts:
            ghost.manager.take_pending_copies()
            ghost.manager.take_checkpoint_copies()
            ghost.manager.begin_step()

    # -- the decision -------------------------------------------------------------------------------

    def _decide(self) -> None:
        if not self.ghosts:
            return
        now = self.ghosts[self.current]
        best = max(range(len(self.ghosts)), key=lambda i: self.ghosts[i].score)
        if best != self.current and self.ghosts[best].score > now.score * (1 + SWITCH_MARGIN):
            self.current = best
            self.switches += 1
            self._apply(self.ghosts[best].choice)

    def _drop(self, ghost: Ghost, request_id: RequestId) -> None:
        shadow = ghost.requests.pop(request_id)
        shadow.request.num_computed_tokens = shadow.ran
        ghost.manager.free(shadow.request)
        ghost.dropped += 1

    def stats(self) -> GhostStats:
        return GhostStats(current=self.choices[self.current].describe(), switches=self.switches,
                          started=bool(self.ghosts),
                          ghosts=tuple((g.choice.describe(), g.hit_tokens, g.dropped) for g in self.ghosts))


def _copy(request: KVRequest) -> KVRequest:
    """A ghost's own request: the live one's tokens and hashes (shared, the same chain), its own progress."""
    return KVRequest(request_id=request.request_id, token_ids=request.token_ids, cache_salt=request.cache_salt,
                     lora_name=request.lora_name, mm_features=request.mm_features,
                     num_encoder_tokens=request.num_encoder_tokens, block_hashes=request.block_hashes,
                     num_prompt_tokens=request.num_prompt_tokens, cache_checkpoints=request.cache_checkpoints)
