"""Random admit / lookup / allocate / decode / preempt / free / reset sequences over mixed groups.

Each example starts from one of several layouts (full + sliding + chunked + Mamba, identical
sliding groups, two block sizes) with a pool small enough to force refusals, preemption and
eviction. The machine plays an engine, including its mistakes' neighbours: a hit kept across
other requests' steps (it may go stale), and a step allocated but preempted before it ran.

Checked after every step, against models that do not use the manager's code:
- `check_integrity()` (ref counts == holders, free queue == ref 0, maps consistent), every block
  id held in exactly one group and position, usage 0 when nothing runs;
- a refused allocation changes nothing (tables, usage, no event);
- after each allocate, the tables follow the attention definitions (`required_entries`): every
  entry the step needs is real and holds the request's own tokens (`ContentTracker`: what the
  completed steps physically wrote), every other entry is null (released early);
- every hit is sound (its blocks hold the request's prefix), every hit block's hash was reported
  by a `BlockStored` event and not yet by a `BlockRemoved` one;
- a kept hit raises `StaleHitError` if it became unsound, and only if something was evicted.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.errors import StaleHitError
from hybridkv.kvcache.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEvents
from hybridkv.kvcache.manager import CacheHit, CheckpointPlacement, EvictionPolicyName, KVCacheManager, MambaCacheMode
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheGroupSpec, RunningState
from hybridkv.plan.specs import SpecKind
from tests.factories import make_config, make_group, make_request
from tests.kvcache.naive_manager import ContentTracker

MIXED = [
    make_group(kind="full", block_size=2),
    make_group(kind="sliding", block_size=2, window_tokens=5),
    make_group(kind="chunked", block_size=2, chunk_tokens=4),
    make_group(kind="mamba", block_size=2),
]
# groups, num_blocks; "_all": MambaCacheMode.ALL; "_fixed": RunningState.FIXED (one running state per request)
LAYOUTS: dict[str, tuple[list[KVCacheGroupSpec], int]] = {
    "mixed": ([
        make_group(kind="full", block_size=2),
        make_group(kind="sliding", block_size=2, window_tokens=5),
        make_group(kind="chunked", block_size=2, chunk_tokens=4),
        make_group(kind="mamba", block_size=2),
    ], 32),
    "twin_sliding": ([
        make_group(kind="full", block_size=2),
        make_group(kind="sliding", block_size=2, window_tokens=4),
        make_group(kind="sliding", block_size=2, window_tokens=4),
        make_group(kind="mamba", block_size=2),
    ], 26),
    "two_block_sizes": ([
        make_group(kind="full", block_size=2),
        make_group(kind="sliding", block_size=4, window_tokens=7),
        make_group(kind="chunked", block_size=4, chunk_tokens=8),
        make_group(kind="mamba", block_size=4),
    ], 26),
    "mixed_all": (MIXED, 40),
    # the multi-page state layout: one state of 3 pages = 3 page groups of one hit rule, with small
    # attention blocks beside it (StateLayout.MULTI_PAGE)
    "multi_page": ([
        make_group(kind="full", block_size=2),
        make_group(kind="sliding", block_size=2, window_tokens=5),
        *(dataclasses.replace(make_group(kind="mamba", block_size=2), state_page=s, state_pages=3)
          for s in range(3)),
    ], 44),
}
LAYOUTS["mixed_fixed"] = (MIXED, 28)
LAYOUTS["multi_page_fixed"] = (LAYOUTS["multi_page"][0], 36)
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [7] * 16]
MAX_MODEL_LEN = 32
# What the run must have exercised (counted below; `TestManagerStateMachine` checks every one).
COVERAGE: Counter[str] = Counter()
REQUIRED = ("layout:mixed", "layout:twin_sliding", "layout:two_block_sizes", "layout:mixed_all", "layout:multi_page",
            "layout:mixed_fixed", "layout:multi_page_fixed", "state_copied_in", "checkpoint_copied_out",
            "hit", "deferred",
            "refused_new", "refused_running",
            "evicted", "uncached_unrun_step", "stale_hit", "kept_hit_used", "reset", "eviction:value", "eviction:lru")


@dataclass
class Job:
    request: KVRequest
    hit: CacheHit | None = None  # a lookup kept for a later allocate
    hit_maybe_stale: bool = False  # something was evicted since that lookup


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.counter = 0
        self.stored: Counter[tuple[int, bytes]] = Counter()  # (group, hash) -> copies, from events
        self.stored_this_step: set[tuple[int, bytes]] = set()  # BlockStored since the last begin_step

    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), eviction=st.sampled_from(list(EvictionPolicyName)),
                placement=st.sampled_from(list(CheckpointPlacement)))
    def build(self, layout: str, eviction: EvictionPolicyName, placement: CheckpointPlacement) -> None:
        groups, num_blocks = LAYOUTS[layout]
        mode = MambaCacheMode.ALL if layout.endswith("_all") else MambaCacheMode.ALIGN
        running = RunningState.FIXED if layout.endswith("_fixed") else RunningState.MOVING
        self.manager = KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=MAX_MODEL_LEN,
            options=CacheOptions(events=KVEvents.ON, mamba_cache_mode=mode, eviction=eviction,
                    checkpoint_placement=placement, running_state=running))
        self.groups = self.manager.config.groups
        self.tracker = ContentTracker(self.groups, mode, running)
        COVERAGE[f"layout:{layout}"] += 1
        COVERAGE[f"eviction:{eviction.value}"] += 1

    # -- helpers ----------------------------------------------------------------------------------

    def drain_events(self) -> bool:
        """Apply the manager's events to the (group, hash) model; True if anything was removed."""
        removed = False
        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self.stored[(event.group_id, block_hash)] += 1
                    self.stored_this_step.add((event.group_id, block_hash))
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    key = (event.group_id, block_hash)
                    assert self.stored[key] > 0, f"BlockRemoved for {key}, which no BlockStored reported"
                    self.stored[key] -= 1
                removed = True
                COVERAGE["evicted"] += 1
            else:
                assert isinstance(event, AllBlocksCleared) and not self.running
                self.stored.clear()
                removed = True
        if removed:
            for job in self.waiting:
                job.hit_maybe_stale = True
        return removed

    def check_hit_events(self, request: KVRequest, hit: CacheHit) -> None:
        for g, blocks in enumerate(hit.blocks):
            hashes = request.block_hashes.get(self.groups[g].block_size, [])
            for i, block_id in enumerate(blocks):
                if block_id:
                    assert self.stored[(g, hashes[i])] > 0, f"hit uses group {g} position {i}, never reported stored"

    def same_step_checkpoint(self, request: KVRequest, hit: CacheHit) -> bool:
        """Whether the hit restores a state checkpoint stored (BlockStored) since the last begin_step."""
        for g, blocks in enumerate(hit.blocks):
            group = self.groups[g]
            if group.kind is SpecKind.MAMBA and blocks and blocks[-1] and (
                    (g, request.block_hashes[group.block_size][len(blocks) - 1]) in self.stored_this_step):
                return True
        return False

    def chunk_end(self, start: int, chunk: int, limit: int) -> int:
        """Tokens of a prefill step: `chunk` (1..16) capped at `limit`; chunks of 3 and more end on
        a multiple of every block size when they can (what an engine does for Mamba checkpoints)."""
        num_new = min(chunk, limit)
        step = max(g.block_size for g in self.groups)
        aligned = (start + num_new) // step * step - start
        return aligned if chunk >= 3 and aligned > 0 else num_new

    def snapshot(self) -> object:
        tables = {j.request.request_id: self.manager.block_ids(j.request.request_id) for j in self.running}
        return self.manager.usage(), self.manager.group_usage(), tables

    def allocate(self, job: Job, num_new: int, hit: CacheHit | None) -> tuple[int, int] | None:
        """Allocate one step; (first_new, end) or None when refused (then nothing changed)."""
        request = job.request
        first_new = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        before = self.snapshot()
        if self.manager.allocate(request, num_new, hit=hit) is None:
            assert self.snapshot() == before, "a refused allocation changed the manager"
            assert self.manager.take_events() == [], "a refused allocation recorded events"
            COVERAGE["refused_running" if before[2].get(request.request_id) else "refused_new"] += 1
            return None
        end = first_new + num_new
        assert not (hit and self.same_step_checkpoint(request, hit)), "a same-step state checkpoint was restored"
        copies = self.manager.take_pending_copies()  # (FIXED: a state hit into the running state) before the step
        self.tracker.apply_copies(copies)
        COVERAGE["state_copied_in"] += bool(copies)
        tables = self.manager.block_ids(request.request_id)
        self.tracker.check_table(request.token_ids, request.cache_salt, tables, first_new, end)
        if end > first_new:
            steps = self.manager.state_steps(request.request_id, start_tokens=first_new, end_tokens=end)
            self.tracker.check_state_steps(steps, tables, first_new, end)
        self.drain_events()
        return first_new, end

    def compute(self, job: Job, first_new: int, end: int) -> None:
        """The step ran: its KV / state is written, the engine advances the request."""
        request = job.request
        tables = self.manager.block_ids(request.request_id)
        self.tracker.record_step(request.token_ids, request.cache_salt, tables, first_new, end)
        copies = self.manager.take_checkpoint_copies()  # (FIXED) after the step: running states out
        self.tracker.apply_copies(copies)
        COVERAGE["checkpoint_copied_out"] += bool(copies)
        self.drain_events()
        request.num_computed_tokens = end

    def preempt_job(self, job: Job, *, step_ran: bool = True) -> None:
        self.manager.free(job.request)
        if self.drain_events() and not step_ran:
            COVERAGE["uncached_unrun_step"] += 1
        self.running.remove(job)
        job.request.num_computed_tokens = 0
        job.hit = None
        self.waiting.append(job)

    def start(self, job: Job, chunk: int) -> tuple[int, int] | None:
        """Admit a waiting job with its kept hit (or a fresh lookup): the allocate of its first step."""
        request = job.request
        hit, job.hit = job.hit, None
        if hit is None:
            peeked = self.manager.peek(request)  # the cache-aware queue's probe: the same length, nothing counted
            hit = self.manager.lookup(request)
            assert peeked == hit.num_tokens, f"peek {peeked} != lookup {hit.num_tokens}"
            self.tracker.check_hit(request.token_ids, request.cache_salt, hit.num_tokens, hit.blocks)
            self.check_hit_events(request, hit)
            job.hit_maybe_stale = False
            if self.same_step_checkpoint(request, hit):
                assert hit.deferred, "a hit on a state checkpoint stored in this step is not deferred"
            if hit.deferred:
                COVERAGE["deferred"] += 1
        else:
            COVERAGE["kept_hit_used"] += 1
        COVERAGE["hit"] += hit.num_tokens > 0
        num_new = self.chunk_end(hit.num_tokens, chunk, request.num_tokens - hit.num_tokens)
        problems = self.tracker.hit_problems(request.token_ids, request.cache_salt, hit.num_tokens, hit.blocks)
        try:
            step = self.allocate(job, num_new, hit)
        except StaleHitError:
            assert job.hit_maybe_stale, "StaleHitError although nothing was evicted since the lookup"
            COVERAGE["stale_hit"] += 1
            self.drain_events()
            return None
        assert not problems or step is None, f"an unsound kept hit was accepted: {problems}"
        if step is not None:
            self.waiting.remove(job)
            self.running.append(job)
        return step

    # -- rules ------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(0, 16),
          suffix=st.lists(st.integers(1, 3), min_size=1, max_size=5), salt=st.integers(0, 3))
    def admit(self, prefix: int, prefix_len: int, suffix: list[int], salt: int) -> None:
        self.counter += 1
        tokens = PREFIXES[prefix][:prefix_len] + suffix
        request = make_request(request_id=f"r{self.counter}", token_ids=tokens, cache_salt="t" if salt == 2 else None)
        self.waiting.append(Job(request=request))

    @precondition(lambda self: bool(self.waiting))
    @rule(index=st.integers(0, 5))
    def lookup_now_allocate_later(self, index: int) -> None:
        """Keep a hit; other rules may evict its blocks before `schedule` uses it."""
        job = self.waiting[index % len(self.waiting)]
        job.hit = self.manager.lookup(job.request)
        job.hit_maybe_stale = False
        self.tracker.check_hit(job.request.token_ids, job.request.cache_salt, job.hit.num_tokens, job.hit.blocks)
        self.check_hit_events(job.request, job.hit)

    @precondition(lambda self: bool(self.waiting))
    @rule(index=st.integers(0, 5), chunk=st.integers(1, 16))
    def schedule(self, index: int, chunk: int) -> None:
        job = self.waiting[index % len(self.waiting)]
        step = self.start(job, chunk)
        if step is not None:
            self.compute(job, *step)

    @precondition(lambda self: bool(self.running))
    @rule(index=st.integers(0, 5), chunk=st.integers(1, 16), token=st.integers(1, 3))
    def advance(self, index: int, chunk: int, token: int) -> None:
        """The next prefill chunk, or one decode token; preempt the request if refused."""
        job = self.running[index % len(self.running)]
        request = job.request
        decoding = request.num_computed_tokens >= request.num_tokens
        if decoding:
            if request.num_tokens >= MAX_MODEL_LEN:
                return
            request.token_ids.append(token)
        num_new = request.num_tokens - request.num_computed_tokens
        step = self.allocate(job, num_new if decoding else self.chunk_end(request.num_computed_tokens, chunk, num_new),
                             None)
        if step is None:
            self.preempt_job(job)
        else:
            self.compute(job, *step)

    @rule(index=st.integers(0, 5), chunk=st.integers(1, 16), token=st.integers(1, 3), admit_new=st.booleans())
    def allocate_then_preempt_before_running(self, index: int, chunk: int, token: int, admit_new: bool) -> None:
        """An engine allocates a step, then preempts the request in the same scheduling step:
        the step never runs, so nothing it would have written may become a prefix hit."""
        if admit_new and self.waiting:
            job = self.waiting[index % len(self.waiting)]
            if self.start(job, chunk) is not None:
                self.preempt_job(job, step_ran=False)
            return
        if not self.running:
            return
        job = self.running[index % len(self.running)]
        request = job.request
        if request.num_computed_tokens >= request.num_tokens:
            if request.num_tokens >= MAX_MODEL_LEN:
                return
            request.token_ids.append(token)
        self.allocate(job, min(chunk, request.num_tokens - request.num_computed_tokens), None)
        self.preempt_job(job, step_ran=False)

    @precondition(lambda self: bool(self.running))
    @rule(index=st.integers(0, 5))
    def preempt(self, index: int) -> None:
        self.preempt_job(self.running[index % len(self.running)])

    @precondition(lambda self: bool(self.running))
    @rule(index=st.integers(0, 5))
    def finish(self, index: int) -> None:
        job = self.running.pop(index % len(self.running))
        self.manager.free(job.request)
        self.manager.free(job.request)  # a second free is a no-op, never a double free
        self.drain_events()

    @rule()
    def begin_step(self) -> None:
        """The engine's next scheduling step: every step allocated so far has run."""
        self.manager.begin_step()
        self.stored_this_step.clear()

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll != 5:  # rare (Hypothesis favours 0 and the bounds): a reset wipes the cache the rules build up
            return
        assert self.manager.reset_prefix_cache() == (not self.running)
        self.drain_events()
        COVERAGE["reset"] += not self.running

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "manager"):
            return
        self.manager.check_integrity()
        owner: dict[int, tuple[int, int]] = {}
        for job in self.running:
            for g, table in enumerate(self.manager.block_ids(job.request.request_id)):
                for position, block_id in enumerate(table):
                    if block_id:
                        place = owner.setdefault(block_id, (g, position))
                        assert place == (g, position), (
                            f"block {block_id} is held at group {g} position {position} and at {place}")
        if not self.running:
            assert self.manager.usage() == 0.0 and self.manager.group_usage() == (0,) * len(self.groups)


ManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=True,
)


@pytest.mark.slow
class TestManagerStateMachine(ManagerMachine.TestCase):
    def runTest(self) -> None:
        COVERAGE.clear()
        super().runTest()
        missing = [what for what in REQUIRED if not COVERAGE[what]]
        assert not missing, f"the state machine never exercised {missing}: {dict(COVERAGE)}"
