"""The order waiting requests are admitted in: FCFS (vLLM's) or cache-aware.

FCFS admits the waiting queue head first and stops at the first request that does not fit. Under
memory pressure the queue backs up, and a request whose prefix is cached waits behind requests
that hit nothing while eviction takes its prefix away: the hit is lost though it was there when
the request arrived.

CACHE_AWARE (SGLang's "longest prefix match" order, with a starvation bound) probes the first
`PROBE_WINDOW` waiting requests each step (`KVCacheManager.peek`: the hit `lookup` would find,
counting nothing) and admits the longest cached prefix first, so a prefix is used while it is
still cached, and requests sharing a prefix run together instead of one evicting the other's.
Ties keep the order requests joined the queue in. A request passed over `MAX_BYPASS` times (a
request that joined the queue after it admitted before it) goes first, whatever its hit: no
request waits forever. A hit deferred to
the next step (a state checkpoint this step writes) does not stop admission as in FCFS: that
request waits one step and the next candidate is tried.

WINDOWED (vLLM 0.34's `cache_aware_admission_window` / `_threshold`, `windowed`): an FCFS queue whose
first `window` plain waiting requests are sorted by cached-prefix depth once the pool is at least
`threshold` used; preempted requests keep their places and the queue behind the window is unchanged.

Only the order changes: each request computes the same tokens either way (`run`'s outputs are
the same); the hit tokens, the prompt tokens recomputed and the time to first token change.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Protocol, TypeVar

from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.options import CacheOptions

#: waiting requests probed per step by CACHE_AWARE; those behind them keep FCFS order
PROBE_WINDOW = 64
#: admissions of later joiners a request may be passed over by before it goes first
MAX_BYPASS = 32


class _Queued(Protocol):
    @property
    def request_id(self) -> RequestId: ...


Q = TypeVar("Q", bound=_Queued)


class Bypasses:
    """Per waiting request, its place in join order (a ticket) and how many requests that joined
    the queue after it were admitted before it."""

    def __init__(self) -> None:
        self._ticket: dict[RequestId, int] = {}
        self._count: dict[RequestId, int] = {}
        self._next = 0

    def joined(self, request: _Queued) -> None:
        """`request` joined the waiting queue (a preempted request keeps its first ticket)."""
        if request.request_id not in self._ticket:
            self._ticket[request.request_id] = self._next
            self._next += 1

    def ticket(self, request: _Queued) -> int:
        return self._ticket.get(request.request_id, self._next)

    def starved(self, request: _Queued) -> bool:
        return self._count.get(request.request_id, 0) >= MAX_BYPASS

    def admitted(self, admitted: Iterable[_Queued], waiting: Iterable[_Queued]) -> None:
        """Count this step's admissions against every request still waiting that joined before them."""
        tickets = sorted(self.ticket(r) for r in admitted)
        for request in admitted:
            self._count.pop(request.request_id, None)
        if not tickets:
            return
        count = self._count
        for request in waiting:
            mine = self.ticket(request)
            passed = len(tickets) - bisect.bisect_right(tickets, mine)
            if passed:
                count[request.request_id] = count.get(request.request_id, 0) + passed

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        """Finished or aborted requests."""
        for request_id in request_ids:
            self._count.pop(request_id, None)
            self._ticket.pop(request_id, None)


def cache_aware(waiting: deque[Q], peek: Callable[[Q], int], bypasses: Bypasses) -> deque[Q]:
    """`waiting` reordered: of its first PROBE_WINDOW requests, the starved ones first, then the
    longest cached prefix first, each in join order; the requests behind them unchanged."""
    probed = list(islice(waiting, PROBE_WINDOW))

    def key(request: Q) -> tuple[bool, int, int]:
        starved = bypasses.starved(request)
        return not starved, 0 if starved else -peek(request), bypasses.ticket(request)

    out = deque(sorted(probed, key=key))
    out.extend(islice(waiting, len(probed), None))  # (a deque indexed in its middle walks it)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowedAdmission:
    """vLLM 0.34's cache-aware admission (`cache_aware_admission_window` / `_threshold`), applied to an
    FCFS queue before each step's admissions (`windowed`)."""

    window: int = 0
    threshold: float = 0.5

    @classmethod
    def of(cls, cache: CacheOptions) -> WindowedAdmission:
        """The rule of `cache`: off without prefix caching, as vLLM ignores it there."""
        window = cache.cache_aware_admission_window if cache.caching else 0
        return cls(window=window, threshold=cache.cache_aware_admission_threshold)

    @property
    def on(self) -> bool:
        return self.window > 0


def windowed(waiting: deque[Q], peek: Callable[[Q], int], rule: WindowedAdmission, *, usage: float,
             movable: Callable[[Q], bool]) -> deque[Q]:
    """`waiting` reordered as vLLM 0.34's `Scheduler._reorder_waiting_by_cached_prefix` does it.

    Nothing moves while the pool's usage (blocks held by requests, cached free blocks not counted)
    is below `rule.threshold`. Otherwise, among the first `rule.window` requests, the slots of the
    `movable` ones (waiting, never preempted, nothing computed) are refilled with those same
    requests, the deepest cached prefix first (ties: queue order); every other request keeps its
    position and the queue behind the window is unchanged:

        window 4, movable a b _ d (cached 0 5 - 9), c preempted  ->  d b c a
    """
    if len(waiting) < 2 or usage < rule.threshold:
        return waiting
    head = list(islice(waiting, rule.window))
    slots = [i for i, request in enumerate(head) if movable(request)]
    if len(slots) < 2:
        return waiting
    cached = {i: peek(head[i]) for i in slots}
    order = sorted(slots, key=lambda i: (-cached[i], i))
    if order == slots:
        return waiting
    reordered = list(head)
    for slot, source in zip(slots, order, strict=True):
        reordered[slot] = head[source]
    out = deque(reordered)
    out.extend(islice(waiting, len(head), None))
    return out


#: the window off (vLLM's default)
NO_WINDOW = WindowedAdmission()
