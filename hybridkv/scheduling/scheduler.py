"""Continuous batching: FCFS, decode first, a token budget per step, chunked prefill, preemption.

Each `schedule()` call builds one step:

    1. running requests get their next tokens: decodes first (1 token each), then requests
       still prefilling (the rest of the prompt, capped by the budget), oldest first;
       when the manager refuses blocks, the latest-arrived running request is preempted
       (blocks freed, computed tokens reset, put at the front of the waiting queue) and the
       allocation is retried; once no later request is left, the request tries smaller chunks
       (halving) and, if not even one token fits, is itself preempted and waits;
    2. if nothing was preempted, waiting requests in FCFS order (or cache-aware, `queue_order`:
       the longest cached prefix first; or vLLM 0.34's windowed reorder, `queue_order.py`): prefix-cache lookup, then as
       many prompt tokens as the budget allows (a smaller chunk when nothing else runs), while
       `max_num_seqs` is not reached. A hit on a state checkpoint cached in this very step
       (`CacheHit.deferred`: its state is written only when the step runs) waits for the next.

Recurrent-state models in align mode (`align_tokens` = the state groups' block size): a
prefill chunk that would cross a block boundary without ending on one is cut back to end on
the last boundary it reaches, one starting inside a block ends at that block's end, and none
runs past the last boundary before the known tokens' end (vLLM 0.32's cuts), so every step's
end state is a checkpoint the manager can cache. Any budget works: a chunk too small to reach
the next boundary runs as it is. With partial hits (`partial_unit_tokens`: a prefix_match_unit
below the state block), a chunk also stops at the prompt's last unit boundary, whose state the
manager keeps as a partial checkpoint (vLLM 0.32's tail stop).

Copy on write: the block copies the step's allocations asked for (`KVCacheManager.take_pending_copies`,
partial hits) come with the step (`SchedulerOutput.copies`); the engine runs them before the forward.
With one running state per request (`RunningState.FIXED`) they also copy state hits into running
states, and `SchedulerOutput.checkpoint_copies` (taken after every allocation of the step) copy
running states out into checkpoints after the forward.

With a KV connector (`connector`, e.g. the KV cache server's): after the local lookup the
connector says how many more prompt tokens the external cache holds; they are allocated as
`num_external_tokens` with caching delayed (the engine caches them once they are loaded, or
calls `load_failed` to recompute the request) and the work starts after them. A request whose
external hit starts with the same block as one already loading in this step waits for the next
step, where it hits those blocks locally instead of loading a second copy. Finished and
preempted requests are reported to the connector.

`finish_step` advances computed tokens after the forward pass and releases finished requests.

Torch-free: the scheduler sees a request only through `SchedulableRequest` (the engine's
`Request`, or `hybridkv simulate`'s token-only request), so the simulator runs this very loop.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

from hybridkv.connector.base import KVConnectorScheduler
from hybridkv.errors import CapacityError
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import BlockCopy, CacheHit, CacheTiming, KVCacheManager
from hybridkv.kvcache.options import QueueOrder
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.queue_order import (
    NO_WINDOW,
    PROBE_WINDOW,
    Bypasses,
    WindowedAdmission,
    cache_aware,
    windowed,
)


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SchedulableRequest(Protocol):
    """What the scheduler reads and writes on a request (`engine.request.Request` has it all)."""

    kv: KVRequest
    arrival_seq: int  # arrival order; the latest-arrived running request is preempted first
    prompt_len: int
    status: RequestStatus
    prefix_hit_tokens: int  # local prefix-cache hit of the first schedule; -1 until then
    external_hit_tokens: int
    computed_prefill_tokens: int
    num_preemptions: int

    @property
    def request_id(self) -> RequestId: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...


R = TypeVar("R", bound=SchedulableRequest)


class KVRequestView:
    """The three read-only views of `kv` that `SchedulableRequest` asks for (a mixin)."""

    __slots__ = ()
    kv: KVRequest

    @property
    def request_id(self) -> RequestId:
        return self.kv.request_id

    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.kv.num_computed_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledWork(Generic[R]):
    """Positions [start_pos, start_pos + num_tokens) of `request` are computed this step.

    `samples` is fixed when the work is built: True when the step reaches the request's last
    known token, so its logits pick the next one (it must not change once that token is appended).
    """

    request: R
    start_pos: int
    num_tokens: int
    samples: bool
    external_tokens: int = 0  # tokens before start_pos the connector loads in this step

    @classmethod
    def of(cls, request: R, *, start_pos: int, num_tokens: int, external_tokens: int = 0) -> ScheduledWork[R]:
        return cls(request=request, start_pos=start_pos, num_tokens=num_tokens,
                   samples=start_pos + num_tokens == request.num_tokens, external_tokens=external_tokens)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOutput(Generic[R]):
    work: tuple[ScheduledWork[R], ...]
    preempted: tuple[R, ...]
    #: block copies to run before the step's forward, in order (partial hits' copy on write; FIXED hits)
    copies: tuple[BlockCopy, ...] = ()
    #: block copies to run after the step's forward (RunningState.FIXED: checkpoints out of running states)
    checkpoint_copies: tuple[BlockCopy, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.work)


class Scheduler(Generic[R]):
    """Decides which tokens of which requests run in each step, within the KV cache manager's blocks."""

    def __init__(self, manager: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 align_tokens: int = 0, connector: KVConnectorScheduler | None = None,
                 partial_unit_tokens: int = 0, queue_order: QueueOrder = QueueOrder.FCFS,
                 window: WindowedAdmission = NO_WINDOW) -> None:
        self.manager = manager
        self.queue_order = queue_order
        self.window = window  # vLLM 0.34's cache-aware admission window (FCFS only)
        self._bypasses = Bypasses()
        self.partial_unit_tokens = partial_unit_tokens  # align mode with partial hits: the prefix_match_unit
        self.connector = connector
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.align_tokens = align_tokens  # block size prefill chunks end on (0: no alignment)
        self.waiting: deque[R] = deque()
        self.running: list[R] = []  # sorted by arrival: the last one is the preemption victim
        self.num_preemptions = 0
        self._loading: set[tuple[int, object]] = set()  # first blocks of the prefixes loading in this step

    def add(self, request: R) -> None:
        self.waiting.append(request)
        if self.queue_order is QueueOrder.CACHE_AWARE:
            self._bypasses.joined(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput[R]:
        """The next step's work; raises CapacityError if a lone request cannot get blocks."""
        self.manager.begin_step()
        self._loading.clear()
        budget = self.max_num_batched_tokens
        work: dict[RequestId, ScheduledWork[R]] = {}
        preempted: list[R] = []
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            start = request.num_computed_tokens
            n = self._aligned(request, start, min(request.num_tokens - start, budget))
            while self.manager.allocate(request.kv, n) is None:
                if self.running[-1] is request:  # nobody later left to preempt: try a smaller chunk
                    n = self._largest_chunk(request, n // 2)
                    if n == 0:
                        self.running.pop()
                        self._preempt(request)
                        preempted.append(request)
                    break
                victim = self.running.pop()  # the latest-arrived running request
                if victim.request_id in work:
                    budget += work.pop(victim.request_id).num_tokens
                    n = self._aligned(request, start, min(request.num_tokens - start, budget))
                self._preempt(victim)
                preempted.append(victim)
            if request.status is RequestStatus.RUNNING:
                work[request.request_id] = ScheduledWork.of(request, start_pos=start, num_tokens=n)
                budget -= n
        scheduled = list(work.values())
        if not preempted:
            self._admit(scheduled, budget)
        if not scheduled and self.waiting:
            head = self.waiting[0]
            raise CapacityError(
                f"request {head.request_id!r} with {head.num_tokens} tokens cannot get KV cache blocks even "
                f"with no other request running; raise the KV cache budget (kv_cache_memory_gib, "
                f"--kv-cache-memory-gib) or shorten the prompt"
            )
        return SchedulerOutput(work=tuple(scheduled), preempted=tuple(preempted),
                               copies=self.manager.take_pending_copies(),
                               checkpoint_copies=self.manager.take_checkpoint_copies())

    def _admit(self, work: list[ScheduledWork[R]], budget: int) -> None:
        aware = self.queue_order is QueueOrder.CACHE_AWARE
        peeks: dict[RequestId, int] = {}  # this step's probes: the order and the protection share them

        def peek(request: R) -> int:
            if request.request_id not in peeks:
                peeks[request.request_id] = self.manager.peek(request.kv)
            return peeks[request.request_id]

        if aware and len(self.waiting) > 1 and budget > 0 and len(self.running) < self.max_num_seqs:
            self.waiting = cache_aware(self.waiting, peek, self._bypasses)
        elif self.window.on and self.queue_order is QueueOrder.FCFS:  # vLLM 0.34 reorders whatever the budget
            self.waiting = windowed(self.waiting, peek, self.window, usage=self.manager.usage(),
                                    movable=lambda r: not r.num_preemptions and not r.num_computed_tokens)
        admitted: list[R] = []
        deferred: list[R] = []
        if self.waiting and self.manager.protects:  # queue-aware retention: every waiting prefix stays
            for request in itertools.islice(self.waiting, PROBE_WINDOW):
                self.manager.protect_waiting(request.kv, peek(request))
        self._admit_waiting(work, budget, admitted, deferred)
        self.waiting.extendleft(reversed(deferred))
        if aware:
            self._bypasses.admitted(admitted, self.waiting)

    def _admit_waiting(self, work: list[ScheduledWork[R]], budget: int, admitted: list[R], deferred: list[R]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit: CacheHit = self.manager.lookup(request.kv)
            if hit.deferred:  # its state checkpoint is written by this step: look it up again in the next one
                if self.queue_order is QueueOrder.FCFS:
                    break
                deferred.append(self.waiting.popleft())  # cache-aware: the next candidate meanwhile
                continue
            external = self.connector.get_num_new_matched_tokens(request.kv, hit.num_tokens) if self.connector else 0
            first_block = self._first_block(request) if external else None
            if first_block in self._loading:
                break  # the same prefix loads in this step: the next step hits it locally
            start = hit.num_tokens + external
            n = self._aligned(request, start, min(request.num_tokens - start, budget))
            n = self._largest_chunk(request, n, hit=hit, external=external, halve=not self.running)
            if not n:
                self.manager.protect(hit)  # a value-aware eviction keeps the blocks it will take
                break  # with others running, blocks come back as they finish; alone, not even 1 token fits
            self.waiting.popleft()
            if first_block is not None:
                self._loading.add(first_block)
            if request.prefix_hit_tokens < 0:
                request.prefix_hit_tokens = hit.num_tokens
                request.external_hit_tokens = external
            if self.connector is not None:
                rid = request.request_id
                tables = self.manager.load_block_ids(rid, start) if external else self.manager.block_ids(rid)
                self.connector.update_state_after_alloc(request.kv, tables, external)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_seq)
            admitted.append(request)
            work.append(ScheduledWork.of(request, start_pos=start, num_tokens=n, external_tokens=external))
            budget -= n

    @staticmethod
    def _first_block(request: R) -> tuple[int, object] | None:
        """(block size, hash) of the request's first block at the smallest block size hashed."""
        hashes = request.kv.block_hashes
        return next(((size, hashes[size][0]) for size in sorted(hashes) if hashes[size]), None)

    def _aligned(self, request: R, start: int, n: int) -> int:
        """`n` tokens from `start`, cut to end on a block boundary in align mode (module docstring).

        As vLLM 0.32's scheduler cuts them (`_mamba_block_aligned_split`), except that a chunk too
        small to reach a boundary runs as it is: a chunk that stops short of the known tokens ends
        on the last boundary it reaches; a chunk starting inside a block ends at that block's end
        (a step writes one state: crossing a boundary from inside a block would checkpoint none);
        no chunk runs past the last boundary strictly before the end, so a resend of the whole
        prompt (hit at most `num_tokens - 1`) finds a checkpoint there; and none runs past the
        request's shared-prefix junction (`KVRequest.shared_prefix_boundary`, block-floored), so
        siblings sharing that prefix find the state there, nor past a placed checkpoint
        (`KVRequest.checkpoint_stops`, `kvcache/policies/placement.py`)."""
        size = self.align_tokens
        end = start + n
        if not size or n <= 1:
            return n
        if end < request.num_tokens:
            boundary = end - end % size
            end = boundary if boundary > start else end
        next_boundary = start - start % size + size if start % size else 0
        last = (request.num_tokens - 1) // size * size
        stops = [next_boundary, last]
        unit = self.partial_unit_tokens
        if unit:  # the prompt's partial checkpoint (what a resend of the prompt hits)
            tail = (request.prompt_len - 1) // unit * unit
            if last < tail < request.prompt_len:
                stops.append(tail)
        for junction in (request.kv.shared_prefix_boundary, *request.kv.checkpoint_stops):
            if start < junction < end:  # block-floored: only a boundary's state is kept
                stops.append(start + (junction - start) // size * size)
        end = min((s for s in stops if start < s < end), default=end)
        return end - start

    def abort(self, requests: Iterable[R]) -> None:
        """Forget `requests` (a failed `generate`): free their blocks and drop them from the queues."""
        ids = {r.request_id for r in requests}
        for request in [r for r in self.running if r.request_id in ids]:
            self._release(request)
            self.running.remove(request)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        self._bypasses.forget(ids)

    def load_failed(self, requests: Iterable[R]) -> None:
        """The connector could not load these just-admitted requests' external tokens: free their
        blocks and put them back at the head of the queue, to be recomputed without that hit."""
        for request in requests:
            self._release(request)
            self.running.remove(request)
            request.kv.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            request.prefix_hit_tokens = -1
            request.external_hit_tokens = 0
            if self.connector is not None:
                self.connector.request_load_failed(request.request_id)
            self.waiting.appendleft(request)

    def _release(self, request: R) -> None:
        if self.connector is not None:
            self.connector.request_finished(request.request_id, self.manager.block_ids(request.request_id))
        self.manager.free(request.kv)

    def _largest_chunk(self, request: R, n: int, *, hit: CacheHit | None = None, external: int = 0,
                       halve: bool = True) -> int:
        """Allocate the first of n, n/2, n/4, ..., 1 tokens that fits (only n unless `halve`);
        returns it, or 0 if none does.

        A sliding-window or chunked-local group needs blocks for the whole chunk but only a
        window of them afterwards, so a prompt whose budget-sized chunk does not fit may still
        run in smaller chunks; only when one token does not fit is the request impossible.
        """
        caching = CacheTiming.DELAYED if external else CacheTiming.IMMEDIATE
        while n > 0:
            if self.manager.allocate(request.kv, n, hit=hit, num_external_tokens=external, caching=caching) is not None:
                return n
            if not halve:
                return 0
            n //= 2
        return 0

    def _preempt(self, request: R) -> None:
        self._release(request)
        request.kv.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish_step(self, work: Sequence[ScheduledWork[R]]) -> list[R]:
        """Advance computed tokens of the step's work; free and return the requests that finished.

        Call after the sampled tokens were appended (finished requests have status FINISHED).
        """
        done: list[R] = []
        for item in work:
            request = item.request
            end = item.start_pos + item.num_tokens
            request.computed_prefill_tokens += max(0, min(end, request.prompt_len) - item.start_pos)
            request.kv.num_computed_tokens = end
            if request.status is RequestStatus.FINISHED:
                self._release(request)
                self.running.remove(request)
                done.append(request)
        if done and self.queue_order is QueueOrder.CACHE_AWARE:
            self._bypasses.forget(r.request_id for r in done)
        return done
