"""The simulation loop: a trace through the engine's `Scheduler` and a `KVCacheManager`, no model.

Each step: requests whose arrival time has come (and whose parent finished) join the waiting
queue; `Scheduler.schedule()` picks the step's work exactly as in the engine (decode first,
chunked prefill within the token budget, admission with prefix lookups, preemption by recompute,
align-mode chunk cuts for state groups); every request whose step reached its last known token
"samples" a synthetic token; `finish_step` advances computed tokens and frees finished requests;
the clock moves by `step_ms`, plus `ms_per_token` for each token the step computed (0 by default:
every step takes the same time), or jumps to the next arrival when nothing runs.

    hit tokens:   what the manager served at each request's first admission (`prefix_hit_tokens`)
    ideal tokens: the infinite-cache ideal at its arrival (`ideal.py`), capped at prompt - 1
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybridkv.errors import CapacityError, ConfigError
from hybridkv.kvcache.hit_limits import HitLimit
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import (
    KVCacheManager,
    MambaCacheMode,
)
from hybridkv.kvcache.options import MECHANISM_DEFAULTS, CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheConfig
from hybridkv.plan.specs import SpecKind
from hybridkv.scheduling.queue_order import WindowedAdmission
from hybridkv.scheduling.scheduler import KVRequestView, RequestStatus, Scheduler
from hybridkv.simulate.ideal import IdealCache
from hybridkv.simulate.trace import TraceRequest

OUTPUT_TOKEN_BASE = 1 << 40  # synthetic generated tokens: above any prompt token id
PROGRESS_EVERY = 64  # steps between two calls of `simulate`'s progress callback


@dataclass(slots=True, kw_only=True)
class SimRequest(KVRequestView):
    """A request as the scheduler sees it (`engine.scheduler.SchedulableRequest`), tokens only."""

    kv: KVRequest
    arrival_seq: int
    prompt_len: int
    output_tokens: int
    status: RequestStatus = RequestStatus.WAITING
    prefix_hit_tokens: int = -1
    external_hit_tokens: int = 0
    computed_prefill_tokens: int = 0
    num_preemptions: int = 0
    queued_ms: float = 0.0  # when it last joined the waiting queue (its arrival or parent's end, a preemption)
    wait_ms: float = -1.0  # time spent in the queue: before its first step and after each preemption; -1 until run
    queued: bool = True  # in the waiting queue now
    ideal_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SimOptions:
    """The scheduler's and manager's settings for one simulation."""

    max_model_len: int
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    step_ms: float = 30.0
    #: simulated ms each computed token adds to its step (prefill costs time: a side that recomputes
    #: more prompt tokens waits longer); 0 = every step takes `step_ms`
    ms_per_token: float = 0.0
    #: every prefix-cache knob (`kvcache/options.py`): the manager's, the queue order, the turn hints
    cache: CacheOptions = MECHANISM_DEFAULTS

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.step_ms <= 0:
            raise ConfigError(f"step time must be > 0 ms, got {self.step_ms}")
        if not self.ms_per_token >= 0:
            raise ConfigError(f"ms_per_token must be >= 0 (simulated ms per computed token), got {self.ms_per_token}")


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupLimits:
    """One KV cache group: what it is and how often it stopped a hit, by reason."""

    group_id: int
    kind: str
    block_size: int
    limited_by: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimReport:
    """What a simulation measured (`hybridkv simulate --json` prints it as is)."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    ideal_tokens: int
    generated_tokens: int
    steps: int
    preemptions: int
    lookups: int
    max_running: int
    mean_running: float
    num_blocks: int
    wall_s: float
    groups: tuple[GroupLimits, ...]
    #: tokens of every prompt and computed sequence, shared prefixes counted once
    distinct_tokens: int = 0
    #: per trace request (in trace order): its hit tokens at its first admission
    request_hits: tuple[int, ...] = field(default=())
    #: per trace request (in trace order): its infinite-cache ideal (what `request_hits` is measured against)
    request_ideals: tuple[int, ...] = field(default=())
    #: prompt tokens the model computed: the prompts less their hits, plus every recompute after a preemption
    prefill_tokens: int = 0
    #: the pool's fraction held by running requests after each step's allocation, averaged over steps
    #: (the rest is what the prefix cache keeps)
    mean_held_fraction: float = 0.0
    #: (simulated ms, running requests, waiting requests), sampled every `concurrency_every` steps
    concurrency: tuple[tuple[float, int, int], ...] = field(default=())
    #: block copies the manager asked for (partial hits' copy on write; nothing is copied here)
    block_copies: int = 0
    #: RunningState.FIXED: block copies into state checkpoints after a step (one per page group), and
    #: checkpoints skipped for want of free blocks
    checkpoint_copies: int = 0
    checkpoints_skipped: int = 0
    #: RunningState.ADOPT: state hits moved into running states instead of copied
    state_adoptions: int = 0
    #: value eviction: per anchor kind, (anchors made, anchors a later hit ended at) (`ManagerStats`)
    anchor_reuse: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: the online choice (`--online-choice ghosts`): the choice at the end, how often it switched, and per
    #: candidate (its description, the hit tokens its ghost found, the requests its ghost dropped)
    online_choice: str = ""
    online_switches: int = 0
    online_ghosts: tuple[tuple[str, int, int], ...] = ()
    #: simulated ms each request spent in the waiting queue (before its first step, and again after each
    #: preemption until it runs again): mean and 95th percentile over the requests (what a queue order
    #: costs in time to first token, and what preemption costs)
    mean_wait_ms: float = 0.0
    p95_wait_ms: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hits_vs_ideal(self) -> float:
        return self.hit_tokens / self.ideal_tokens if self.ideal_tokens else 1.0


def _limits_of(config: KVCacheConfig, limited_by: Sequence[dict[HitLimit, int]]) -> tuple[GroupLimits, ...]:
    out = []
    for group, counts in zip(config.groups, limited_by or [{}] * len(config.groups), strict=True):
        kind = group.kind.value
        if group.kind is SpecKind.SLIDING_WINDOW:
            kind = f"{kind} {group.window_tokens}"
        out.append(GroupLimits(group_id=group.group_id, kind=kind, block_size=group.block_size,
                               limited_by={limit.value: counts.get(limit, 0) for limit in HitLimit}))
    return tuple(out)


class _Run:
    """The state of one simulation (`simulate` drives it)."""

    def __init__(self, trace: Sequence[TraceRequest], manager: KVCacheManager, options: SimOptions,
                 align_tokens: int, partial_unit_tokens: int) -> None:
        self.trace = trace
        self.options = options
        self.manager = manager
        self.scheduler: Scheduler[SimRequest] = Scheduler(
            manager, max_num_batched_tokens=options.max_num_batched_tokens, max_num_seqs=options.max_num_seqs,
            align_tokens=align_tokens, partial_unit_tokens=partial_unit_tokens, queue_order=options.cache.queue_order,
            window=WindowedAdmission.of(options.cache))
        self.block_copies = 0
        self.ideal = IdealCache()
        self.pending = deque(sorted(range(len(trace)), key=lambda i: (trace[i].arrival_ms, i)))
        self.blocked: list[int] = []  # arrived, waiting for their parent to finish
        self.finished: dict[int, list[int]] = {}  # index -> whole sequence (only for requests a later one extends)
        self.done: set[int] = set()  # indices of the finished requests
        self.parents = {item.parent for item in trace if item.parent is not None}
        self.requests: list[SimRequest] = []
        self.clock_ms = 0.0
        self.step_tokens = 0  # tokens the last step computed

    def arrive(self) -> None:
        trace, ready = self.trace, []
        while self.pending and trace[self.pending[0]].arrival_ms <= self.clock_ms:
            ready.append(self.pending.popleft())
        still = []
        for index in sorted(self.blocked + ready):
            parent = trace[index].parent
            if parent is not None and parent not in self.done:
                still.append(index)
                continue
            self._add(index)
        self.blocked = still

    def _add(self, index: int) -> None:
        item = self.trace[index]
        prompt = (self.finished[item.parent] if item.parent is not None else []) + list(item.new_tokens)
        prompt = prompt[: self.options.max_model_len - 1]
        parent_len = len(self.finished[item.parent]) if item.parent is not None else 0
        ends = tuple(parent_len + p for p in item.turn_ends if parent_len + p < len(prompt))
        kv = KVRequest(request_id=RequestId(f"r{index}"), token_ids=prompt, cache_salt=item.cache_salt,
                       cache_checkpoints=ends if self.options.cache.turn_checkpoints else ())
        request = SimRequest(kv=kv, arrival_seq=index, prompt_len=len(prompt),
                             output_tokens=item.output_tokens, queued_ms=self.clock_ms)
        request.ideal_tokens = min(self.ideal.longest_prefix(prompt, salt=item.cache_salt), len(prompt) - 1)
        self.ideal.add(prompt, salt=item.cache_salt)
        self.requests.append(request)
        self.scheduler.add(request)

    def step(self) -> int:
        out = self.scheduler.schedule()
        self.step_tokens = out.num_tokens
        self.block_copies += len(out.copies)  # (no pages here: a copy is only counted)
        max_len = self.options.max_model_len
        for request in out.preempted:  # back in the queue: its wait runs again
            request.queued, request.queued_ms = True, self.clock_ms
        for work in out.work:
            if work.request.queued:
                work.request.wait_ms = max(work.request.wait_ms, 0.0) + self.clock_ms - work.request.queued_ms
                work.request.queued = False
            if work.samples:
                request = work.request
                generated = request.num_tokens - request.prompt_len
                request.kv.token_ids.append(OUTPUT_TOKEN_BASE + request.arrival_seq * 65_536 + generated)
                if generated + 1 >= request.output_tokens or request.num_tokens >= max_len:
                    request.status = RequestStatus.FINISHED
        for request in self.scheduler.finish_step(out.work):
            index = request.arrival_seq
            self.done.add(index)
            if index in self.parents:  # (a 27M-token trace without parents keeps no second copy)
                self.finished[index] = list(request.kv.token_ids)
            # the last sampled token is never computed: the ideal keeps what was
            self.ideal.add(request.kv.token_ids[: request.num_computed_tokens], salt=self.trace[index].cache_salt)
        return len(self.scheduler.running)


def simulate(trace: Sequence[TraceRequest], config: KVCacheConfig, options: SimOptions, *,
             concurrency_every: int = 1, manager: KVCacheManager | None = None,
             progress: Callable[[int, int], None] | None = None) -> SimReport:
    """Run `trace` through the scheduler and a fresh manager over `config` (or `manager`, built for
    `config`: e.g. another engine's manager behind the same verbs); see the module docstring.
    `progress(finished, total)` is called every `PROGRESS_EVERY` steps and at the end."""
    if not trace:
        raise ConfigError("the trace holds no requests")
    for index, item in enumerate(trace):
        if item.parent is not None and not 0 <= item.parent < index:
            raise ConfigError(f"trace request {index} names parent {item.parent}; expected an earlier request")
    started = time.perf_counter()
    manager = manager or KVCacheManager(config, max_model_len=options.max_model_len, options=options.cache)
    state_sizes = {g.block_size for g in config.groups if g.kind is SpecKind.MAMBA}
    cache = options.cache
    aligned = cache.mamba_cache_mode is MambaCacheMode.ALIGN and cache.caching
    align = max(state_sizes) if aligned and state_sizes else 0  # as the engine's LLM._align_tokens
    unit = cache.match_unit(config)
    run = _Run(trace, manager, options, align, unit.hash_unit_tokens if align and unit.partial_hits else 0)
    steps = running_sum = max_running = 0
    held_sum = 0.0
    samples: list[tuple[float, int, int]] = []
    while run.pending or run.blocked or run.scheduler.has_unfinished:
        run.arrive()
        if not run.scheduler.has_unfinished:
            run.clock_ms = max(run.clock_ms, run.trace[run.pending[0]].arrival_ms) if run.pending else run.clock_ms
            if not run.pending and run.blocked:
                raise ConfigError(f"trace requests {run.blocked[:5]} wait for parents that never finish")
            continue
        try:
            running = run.step()
        except CapacityError:
            head = run.scheduler.waiting[0]
            raise CapacityError(
                f"trace request {head.arrival_seq} ({head.num_tokens} tokens) cannot get KV cache blocks even with "
                f"no other request running ({config.num_blocks} blocks of {config.groups[0].block_size} tokens); "
                "raise the memory budget (--memory-gib) or lower --max-model-len"
            ) from None
        steps += 1
        running_sum += running
        held_sum += manager.usage()
        max_running = max(max_running, running)
        if steps % concurrency_every == 0:
            samples.append((run.clock_ms, running, len(run.scheduler.waiting)))
        if progress is not None and steps % PROGRESS_EVERY == 0:
            progress(len(run.done), len(trace))
        run.clock_ms += options.step_ms + options.ms_per_token * run.step_tokens
    if progress is not None:
        progress(len(run.done), len(trace))
    stats = manager.stats()
    policies = getattr(manager, "policies", None)  # (a stand-in manager, e.g. vLLM's own, has no policies)
    online = policies.stats().online if policies is not None else None
    requests = run.requests
    ordered = sorted(requests, key=lambda r: r.arrival_seq)
    return SimReport(
        requests=len(requests), prompt_tokens=sum(r.prompt_len for r in requests),
        hit_tokens=sum(max(r.prefix_hit_tokens, 0) for r in requests),
        ideal_tokens=sum(r.ideal_tokens for r in requests),
        generated_tokens=sum(r.num_tokens - r.prompt_len for r in requests), steps=steps,
        preemptions=run.scheduler.num_preemptions, lookups=stats.lookups, max_running=max_running,
        mean_running=running_sum / steps if steps else 0.0, num_blocks=config.num_blocks,
        wall_s=time.perf_counter() - started, groups=_limits_of(config, stats.limited_by),
        concurrency=tuple(samples), distinct_tokens=run.ideal.distinct_tokens(),
        request_hits=tuple(r.prefix_hit_tokens for r in ordered),
        request_ideals=tuple(r.ideal_tokens for r in ordered),
        block_copies=run.block_copies, checkpoint_copies=stats.checkpoint_copies,
        checkpoints_skipped=stats.checkpoints_skipped, state_adoptions=stats.state_adoptions,
        anchor_reuse=stats.anchor_reuse,
        online_choice=online.current if online else "", online_switches=online.switches if online else 0,
        online_ghosts=online.ghosts if online else (),
        prefill_tokens=sum(r.computed_prefill_tokens for r in requests),
        mean_held_fraction=held_sum / steps if steps else 0.0,
        **_waits(requests),
    )


def _waits(requests: Sequence[SimRequest]) -> dict[str, float]:
    waits = sorted(r.wait_ms for r in requests)
    if not waits:
        return {"mean_wait_ms": 0.0, "p95_wait_ms": 0.0}
    return {"mean_wait_ms": sum(waits) / len(waits), "p95_wait_ms": waits[min(len(waits) - 1, len(waits) * 95 // 100)]}
