"""The real manager against the naive reference on seeded random workloads.

With eviction pressure: every hit is at most the naive hit and uses only blocks holding the
request's own tokens. Without eviction (a pool too large to ever evict): hits are equal.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from hybridkv.kvcache.manager import CacheHit, KVCacheManager, MambaCacheMode
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheGroupSpec
from tests.factories import make_config, make_group, make_request
from tests.kvcache.naive_manager import ContentTracker, NaiveManager

LAYOUTS: dict[str, list[KVCacheGroupSpec]] = {
    "full+sliding": [make_group(kind="full", block_size=4), make_group(kind="sliding", block_size=4, window_tokens=7)],
    "full+mamba": [make_group(kind="full", block_size=4), make_group(kind="mamba", block_size=4)],
    "full+chunked": [make_group(kind="full", block_size=4), make_group(kind="chunked", block_size=4, chunk_tokens=8)],
    "mixed": [
        make_group(kind="full", block_size=4),
        make_group(kind="sliding", block_size=4, window_tokens=6),
        make_group(kind="sliding", block_size=4, window_tokens=6),
        make_group(kind="chunked", block_size=4, chunk_tokens=8),
        make_group(kind="mamba", block_size=4),
    ],
    "two_block_sizes": [
        make_group(kind="full", block_size=2),
        make_group(kind="sliding", block_size=4, window_tokens=9),
    ],
    "sliding_only": [make_group(kind="sliding", block_size=2, window_tokens=5)],
    # the decode path with more than FEW groups (a boundary step pops 9 blocks), and with several
    # managers releasing in one step
    "many_groups": [make_group(kind="full", block_size=4)]
    + [make_group(kind="sliding", block_size=4, window_tokens=7) for _ in range(8)],
    "windows+chunked": [
        make_group(kind="full", block_size=4),
        make_group(kind="sliding", block_size=4, window_tokens=6),
        make_group(kind="sliding", block_size=4, window_tokens=11),
        make_group(kind="chunked", block_size=4, chunk_tokens=8),
    ],
}
#: Layouts with a state group run in both modes ("[all]": MambaCacheMode.ALL).
CASES = [*sorted(LAYOUTS), "full+mamba[all]", "mixed[all]"]


def make_harness(case: str, *, num_blocks: int, seed: int) -> Harness:
    layout, _, mode = case.partition("[")
    return Harness(LAYOUTS[layout], num_blocks=num_blocks, seed=seed,
                   mode=MambaCacheMode.ALL if mode else MambaCacheMode.ALIGN)


@dataclass
class Job:
    request: KVRequest
    prompt_tokens: int
    decode_steps: int
    decoded: int = 0
    hit_tokens: int = field(default=0)


class Harness:
    """Drives the real manager like an engine and checks every lookup against the naive one."""

    def __init__(self, groups: list[KVCacheGroupSpec], *, num_blocks: int, seed: int,
                 mode: MambaCacheMode = MambaCacheMode.ALIGN) -> None:
        self.rng = random.Random(seed)
        self.manager = KVCacheManager(make_config(groups=groups, num_blocks=num_blocks), max_model_len=100_000,
            options=CacheOptions(mamba_cache_mode=mode))
        self.naive = NaiveManager(self.manager.config.groups, mode)
        self.tracker = ContentTracker(self.manager.config.groups, mode)
        self.block_size = max(g.block_size for g in groups)
        self.lookups = 0
        self.shorter = 0
        self.hit_tokens = 0

    def make_job(self, index: int, prefixes: list[list[int]]) -> Job:
        rng = self.rng
        prefix = rng.choice(prefixes)[: rng.randint(0, 40)]
        prompt = prefix + [rng.randint(1, 60) for _ in range(rng.randint(1, 10))]
        salt = "tenant-b" if rng.random() < 0.15 else None
        request = make_request(request_id=f"r{index}", token_ids=prompt, cache_salt=salt)
        return Job(request=request, prompt_tokens=len(prompt), decode_steps=rng.randint(0, 9))

    def lookup(self, job: Job, exact: bool) -> None:
        request = job.request
        hit = self.manager.lookup(request)
        expected = self.naive.longest_hit(request.token_ids, request.cache_salt)
        assert hit.num_tokens <= expected, f"{request.request_id}: hit {hit.num_tokens} > naive {expected}"
        if exact:
            assert hit.num_tokens == expected, f"{request.request_id}: hit {hit.num_tokens} != naive {expected}"
        self.tracker.check_hit(request.token_ids, request.cache_salt, hit.num_tokens, hit.blocks)
        self.lookups += 1
        self.shorter += hit.num_tokens < expected
        self.hit_tokens += hit.num_tokens
        job.hit_tokens = hit.num_tokens
        self.step(job, hit_tokens=hit.num_tokens, hit=hit)

    def step(self, job: Job, *, hit_tokens: int = 0, hit: CacheHit | None = None) -> bool:
        """Schedule the next prefill chunk or one decode token; False if the pool refused."""
        request = job.request
        start = request.num_computed_tokens + hit_tokens
        if start >= job.prompt_tokens:
            request.token_ids.append(self.rng.randint(1, 60))
        remaining = request.num_tokens - start
        chunk = remaining
        if remaining > 1 and self.rng.random() < 0.5:  # chunked prefill, often ending on a block boundary
            cut = self.rng.randint(1, remaining)
            aligned = (start + cut) // self.block_size * self.block_size - start
            chunk = aligned if aligned > 0 and self.rng.random() < 0.7 else cut
        new = self.manager.allocate(request, chunk, hit=hit)
        if new is None:
            if start >= job.prompt_tokens:
                request.token_ids.pop()
            return False
        end = start + chunk
        self.naive.record_step(request.token_ids, request.cache_salt, start, end)
        tables = self.manager.block_ids(request.request_id)
        self.tracker.check_table(request.token_ids, request.cache_salt, tables, start, end)
        steps = self.manager.state_steps(request.request_id, start_tokens=start, end_tokens=end) if end > start else ()
        self.tracker.check_state_steps(steps, tables, start, end)
        self.tracker.record_step(request.token_ids, request.cache_salt, tables, start, end)
        request.num_computed_tokens = end
        if start >= job.prompt_tokens:
            job.decoded += 1
        return True

    def run(self, *, num_requests: int, max_running: int, exact: bool) -> None:
        rng = self.rng
        prefixes = [[rng.randint(1, 60) for _ in range(40)] for _ in range(4)]
        waiting = [self.make_job(i, prefixes) for i in range(num_requests)]
        running: list[Job] = []
        for _ in range(200 * num_requests):
            if not (waiting or running):
                break
            self.manager.begin_step()  # one operation per step: no hit waits for a step
            if waiting and len(running) < max_running and rng.random() < 0.5:
                job = waiting.pop(0)
                self.lookup(job, exact)
                running.append(job)
            elif running:
                job = rng.choice(running)
                done = job.request.num_computed_tokens >= job.prompt_tokens and job.decoded >= job.decode_steps
                if done or rng.random() < 0.03 or not self.step(job):
                    self.manager.free(job.request)  # finished, or preempted (and requeued)
                    running.remove(job)
                    if not done:
                        job.request.num_computed_tokens = 0
                        waiting.insert(0, job)
            self.manager.check_integrity()
            if not running and rng.random() < 0.02:
                assert self.manager.reset_prefix_cache()
                self.naive.reset()
        assert not (waiting or running), f"workload stuck: {len(waiting)} waiting, {len(running)} running"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES)
def test_without_eviction_hits_equal_the_naive_hits(case: str, seed: int) -> None:
    harness = make_harness(case, num_blocks=5_000, seed=seed)
    harness.run(num_requests=40, max_running=4, exact=True)
    assert harness.lookups >= 40
    assert harness.hit_tokens > 0, "the workload must produce hits to compare"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", CASES)
def test_under_eviction_hits_are_never_longer_nor_wrong(case: str, seed: int) -> None:
    groups = LAYOUTS[case.partition("[")[0]]
    # One request of up to 60 tokens always fits alone (16 blocks of 4 per group); several compete.
    harness = make_harness(case, num_blocks=17 * len(groups) + 8, seed=seed)
    harness.run(num_requests=60, max_running=3, exact=False)
    assert harness.lookups >= 60
