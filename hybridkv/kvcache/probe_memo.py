"""Waiting requests' probes, remembered until something they read changes.

A cache-aware queue order and queue-aware retention probe every waiting request of the window
each step (`KVCacheManager.peek`, `protect_waiting`): up to 64 lookups of chains of thousands of
hashes per step, most of them answering exactly what they answered the step before. A probe reads
the prefix maps at its request's keys only, so its answer stays true until one of those keys
changes in some map. The maps write down each key they change (`PrefixMap.changes`: a key
cached, a group's block of it evicted, a waiting copy promoted); before any answer is read, those
keys drop the answers that read them:

    probe(r) ──answer, the keys it read──▶ answers[r], watch[key] ∋ r
    map change (key) ───────────────────▶ watch[key] ─▶ drop answers[r]

The keys a probe reads: with a downward-closed group (full attention), only the chain up to one
block past that group's answer (no group is asked beyond it, `HybridCoordinator`); without one,
the chain up to the probe's limit. Answers are exact: a run with the memo takes every decision
it takes without it (tested against the unmemoized manager). The log is bounded: past `MAX_CHANGES`
keys (no probe for a long time, e.g. an empty queue) every answer is dropped and the log emptied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.kvcache.coordinator import KVCacheCoordinator
from hybridkv.kvcache.ids import BlockHash, RequestId
from hybridkv.kvcache.policies import CachePolicies
from hybridkv.kvcache.prefix_map import Ids, PrefixMap
from hybridkv.kvcache.request import KVRequest

#: keys changed since the last read after which every answer is dropped instead (a long pause in
#: probing must not grow the log without bound)
MAX_CHANGES = 1 << 16


@dataclass(slots=True)
class _Answer:
    num_tokens: int  # the request's length when probed (a preempted request returns longer)
    hit_tokens: int
    keys: list[BlockHash]  # the keys the probe read (its watch entries)
    #: protect_waiting's blocks of the hit and the state hit's first row, once computed
    protected: tuple[Ids, list[int]] | None = None


class ProbeMemo:
    """The answers of one manager's probes (module docstring)."""

    def __init__(self, maps: Sequence[PrefixMap]) -> None:
        self._changes: list[BlockHash] = []
        for pmap in maps:
            pmap.changes = self._changes
        self._answers: dict[RequestId, _Answer] = {}
        self._watch: dict[BlockHash, set[RequestId]] = {}

    def hit(self, request_id: RequestId, num_tokens: int) -> _Answer | None:
        """The remembered answer of `request_id` at `num_tokens` tokens, None where there is none
        or a key it read changed since."""
        self._settle()
        answer = self._answers.get(request_id)
        if answer is None or answer.num_tokens != num_tokens:
            return None
        return answer

    def store(self, request_id: RequestId, num_tokens: int, hit_tokens: int,
              hashes: dict[int, list[BlockHash]], reach_tokens: int) -> _Answer:
        """Remember a probe that read the chain `hashes` up to `reach_tokens` tokens."""
        self._settle()
        self.forget(request_id)
        keys = [key for size, chain in hashes.items() for key in chain[: reach_tokens // size + 1]]
        answer = _Answer(num_tokens=num_tokens, hit_tokens=hit_tokens, keys=keys)
        self._answers[request_id] = answer
        watch = self._watch
        for key in keys:
            watchers = watch.get(key)
            if watchers is None:
                watch[key] = {request_id}
            else:
                watchers.add(request_id)
        return answer

    def forget(self, request_id: RequestId) -> None:
        """Drop `request_id`'s answer (admitted, finished, or one of its keys changed)."""
        answer = self._answers.pop(request_id, None)
        if answer is None:
            return
        watch = self._watch
        for key in answer.keys:
            watchers = watch.get(key)
            if watchers is not None:
                watchers.discard(request_id)
                if not watchers:
                    del watch[key]

    def bound(self) -> None:
        """Drop every answer if more than `MAX_CHANGES` keys changed since the last read."""
        if len(self._changes) > MAX_CHANGES:
            self.clear()

    def clear(self) -> None:
        """Drop every answer (the prefix cache was reset)."""
        self._answers.clear()
        self._watch.clear()
        self._changes.clear()

    def _settle(self) -> None:
        changes = self._changes
        if not changes:
            return
        if len(changes) > MAX_CHANGES:
            self.clear()
            return
        watch = self._watch
        for key in changes:
            watchers = watch.get(key)
            if watchers is not None:
                for request_id in list(watchers):
                    self.forget(request_id)
        changes.clear()


class WaitingProbes:
    """`KVCacheManager.peek` and `protect_waiting`'s blocks, remembered in a `ProbeMemo` (made at the first
    probe: a manager that never probes never logs its maps' changes; none with partial hits, `_memo`)."""

    def __init__(self, coordinator: KVCacheCoordinator, policies: CachePolicies,
                 hashes: Callable[[KVRequest], dict[int, list[BlockHash]]], maps: Sequence[PrefixMap]) -> None:
        self._coordinator = coordinator
        self._policies = policies
        self._hashes = hashes
        self._maps = maps
        self.memo: ProbeMemo | None = None

    def peek(self, request: KVRequest, max_length: int) -> int:
        """The hit `lookup` would find now, in tokens (at most `max_length`)."""
        memo = self._memo()
        if memo is not None:
            answer = memo.hit(request.request_id, request.num_tokens)
            if answer is not None:
                return answer.hit_tokens
        hashes = self._hashes(request)
        coordinator = self._coordinator
        _, tokens, first = coordinator.find_longest_cache_hit(hashes, max_length, blocks=False)
        if memo is not None:
            reach = coordinator.probe_reach(first, max_length)
            memo.store(request.request_id, request.num_tokens, tokens, hashes, reach)
        return tokens

    def protect(self, request: KVRequest, hit_tokens: int) -> None:
        """Tell the policies the blocks of `request`'s hit of `hit_tokens` (`peek`'s answer this step)."""
        memo = self._memo()
        answer = memo.hit(request.request_id, request.num_tokens) if memo is not None else None
        if answer is None or answer.hit_tokens != hit_tokens:
            self._policies.waiting_prefix(*self._policies.hit_ids(self._hashes(request), hit_tokens))
            return
        if answer.protected is None:
            ids, states = self._policies.hit_ids(self._hashes(request), hit_tokens)
            blocks = np.array(ids, np.int64)  # (the policies take an array as is: built once, read each step)
            answer.protected = blocks[blocks != 0], states
        self._policies.waiting_prefix(*answer.protected)

    def forget(self, request_id: RequestId) -> None:
        if self.memo is not None:
            self.memo.forget(request_id)

    def new_step(self) -> None:
        """Bound the change log where nothing probes for long (an empty queue): past `MAX_CHANGES`, drop all."""
        if self.memo is not None:
            self.memo.bound()

    def _memo(self) -> ProbeMemo | None:
        """The memo, made at the first probe; none with partial hits (entries inside blocks: not logged by key)."""
        if self.memo is None and not self._coordinator.partial_hits:
            self.memo = ProbeMemo(self._maps)
        return self.memo
