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

Only the order changes: each request computes the same tokens either way (`run`'s outputs are
the same); the hit tokens, the prompt tokens recomputed and the time to first token change.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Protocol, TypeVar

from hybridkv.kvcache.ids import RequestId

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
