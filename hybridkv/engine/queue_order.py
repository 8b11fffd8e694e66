"""The order waiting requests are admitted in: FCFS (vLLM's) or cache-aware.

FCFS admits the waiting queue head first and stops at the first request that does not fit. Under
memory pressure the queue backs up, and a request whose prefix is cached waits behind requests
that hit nothing while eviction takes its prefix away: the hit is lost though it was there when
the request arrived.

CACHE_AWARE (SGLang's "longest prefix match" order, with a starvation bound) probes the first
`PROBE_WINDOW` waiting requests each step (`KVCacheManager.peek`: the hit `lookup` would find,
counting nothing) and admits the longest cached prefix first, so a prefix is used while it is
still cached, and requests sharing a prefix run together instead of one evicting the other's.
Ties keep arrival order. A request passed over `MAX_BYPASS` times (a later-arrived request
admitted before it) goes first, whatever its hit: no request waits forever. A hit deferred to
the next step (a state checkpoint this step writes) does not stop admission as in FCFS: that
request waits one step and the next candidate is tried.

Only the order changes: each request computes the same tokens either way (`run`'s outputs are
the same); the hit tokens, the prompt tokens recomputed and the time to first token change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Protocol, TypeVar

from hybridkv.kvcache.ids import RequestId


class QueueOrder(Enum):
    """Which waiting request is admitted next (module docstring)."""

    FCFS = "fcfs"
    CACHE_AWARE = "cache_aware"


#: waiting requests probed per step by CACHE_AWARE; those behind them keep FCFS order
PROBE_WINDOW = 64
#: later-arrived admissions a request may be passed over by before it goes first
MAX_BYPASS = 32


class _Queued(Protocol):
    arrival_seq: int

    @property
    def request_id(self) -> RequestId: ...


Q = TypeVar("Q", bound=_Queued)


class Bypasses:
    """Per waiting request, how many later-arrived requests were admitted before it."""

    def __init__(self) -> None:
        self._count: dict[RequestId, int] = {}

    def starved(self, request: _Queued) -> bool:
        return self._count.get(request.request_id, 0) >= MAX_BYPASS

    def admitted(self, admitted: Iterable[_Queued], waiting: Iterable[_Queued]) -> None:
        """Count this step's admissions against every request still waiting that arrived earlier."""
        latest = max((r.arrival_seq for r in admitted), default=-1)
        for request in admitted:
            self._count.pop(request.request_id, None)
        if latest < 0:
            return
        count = self._count
        for request in waiting:
            if request.arrival_seq < latest:
                passed = sum(1 for r in admitted if r.arrival_seq > request.arrival_seq)
                count[request.request_id] = count.get(request.request_id, 0) + passed

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        for request_id in request_ids:
            self._count.pop(request_id, None)


def cache_aware(waiting: deque[Q], peek: Callable[[Q], int], bypasses: Bypasses) -> deque[Q]:
    """`waiting` reordered: of its first PROBE_WINDOW requests, the starved ones first, then the
    longest cached prefix first, each in arrival order; the requests behind them unchanged."""
    probed = [waiting[i] for i in range(min(PROBE_WINDOW, len(waiting)))]
    keyed = sorted(range(len(probed)),
                   key=lambda i: (not bypasses.starved(probed[i]),
                                  probed[i].arrival_seq if bypasses.starved(probed[i]) else -peek(probed[i]),
                                  probed[i].arrival_seq))
    out = deque(probed[i] for i in keyed)
    out.extend(waiting[i] for i in range(len(probed), len(waiting)))
    return out
