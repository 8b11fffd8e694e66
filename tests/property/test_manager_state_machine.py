"""Random admit / lookup / allocate / decode / preempt / free / reset sequences over mixed groups.

After every step: `check_integrity()` (ref counts == holders, free queue == ref 0, maps
consistent), every block id held in exactly one group and one position, refused allocations
change nothing, and every hit uses only blocks holding the request's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.core.kv_cache_manager import CacheHit, KVCacheManager
from hybridkv.core.request import KVRequest
from tests.differential.naive_manager import ContentTracker
from tests.factories import make_config, make_group, make_request

GROUPS = [
    make_group(kind="full", block_size=2),
    make_group(kind="sliding", block_size=2, window_tokens=5),
    make_group(kind="chunked", block_size=2, chunk_tokens=4),
    make_group(kind="mamba", block_size=2),
]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [7] * 12]
MAX_MODEL_LEN = 32


@dataclass
class Job:
    request: KVRequest
    prompt_tokens: int


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(make_config(groups=GROUPS, num_blocks=40), max_model_len=MAX_MODEL_LEN)
        self.tracker = ContentTracker(self.manager.config.groups)
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.counter = 0

    # -- helpers ----------------------------------------------------------------------------------

    def snapshot(self) -> object:
        tables = {j.request.request_id: self.manager.block_ids(j.request.request_id) for j in self.running}
        return self.manager.usage(), self.manager.group_usage(), tables

    def run_step(self, job: Job, num_new: int, hit: CacheHit | None) -> bool:
        request = job.request
        start = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        before = self.snapshot()
        new = self.manager.allocate(request, num_new, hit=hit)
        if new is None:
            assert self.snapshot() == before, "a refused allocation changed the manager"
            return False
        end = start + num_new
        tables = self.manager.block_ids(request.request_id)
        self.tracker.record_new(request.token_ids, request.cache_salt,
                                [len(t) - len(n) for t, n in zip(tables, new, strict=True)], new)
        self.tracker.record_state(request.token_ids, request.cache_salt, tables, end)
        request.num_computed_tokens = end
        return True

    def preempt_job(self, job: Job) -> None:
        self.manager.free(job.request)
        self.running.remove(job)
        job.request.num_computed_tokens = 0
        self.waiting.append(job)

    # -- rules ------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), prefix_len=st.integers(0, 12),
          suffix=st.lists(st.integers(1, 3), min_size=1, max_size=5), salted=st.booleans())
    def admit(self, prefix: int, prefix_len: int, suffix: list[int], salted: bool) -> None:
        self.counter += 1
        tokens = PREFIXES[prefix][:prefix_len] + suffix
        request = make_request(request_id=f"r{self.counter}", token_ids=tokens, cache_salt="t" if salted else None)
        self.waiting.append(Job(request=request, prompt_tokens=len(tokens)))

    @precondition(lambda self: bool(self.waiting))
    @rule(index=st.integers(0, 5), chunk=st.integers(1, 16))
    def schedule(self, index: int, chunk: int) -> None:
        job = self.waiting[index % len(self.waiting)]
        request = job.request
        hit = self.manager.lookup(request)
        self.tracker.check_hit(request.token_ids, request.cache_salt, hit.num_tokens, hit.blocks)
        num_new = min(chunk, request.num_tokens - hit.num_tokens)
        if self.run_step(job, num_new, hit):
            self.waiting.remove(job)
            self.running.append(job)

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
        if not self.run_step(job, num_new if decoding else min(chunk, num_new), None):
            self.preempt_job(job)

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

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def integrity(self) -> None:
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
            assert self.manager.usage() == 0.0 and self.manager.group_usage() == (0,) * len(GROUPS)


ManagerMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=True,
)
TestManagerStateMachine = ManagerMachine.TestCase
