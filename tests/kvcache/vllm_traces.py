"""Seeded traces and one scheduler loop, shared by hybridkv's manager and vLLM's real one.

Pure Python with no hybridkv import: `vllm_fixtures/generate_vllm_hits.py` runs it under the
vLLM venv to drive vLLM 0.32's `KVCacheManager`; `test_mamba_vs_vllm.py` runs it on ours. The
loop makes the same decisions for both as long as both managers answer the same, and records,
per request, the step it was admitted in and its prefix-hit tokens (a hit deferred by the
same-step rule shows as a later admission step).

Each step: `begin_step`; running requests first (a prefilling one gets its next chunk, a decoding
one appends a token and asks for one slot, a finished one is freed); then waiting requests are
admitted in order (lookup, then allocate the first chunk) while fewer than `max_running` run and
the token budget lasts; a refused admission stops admission for the step (vLLM's scheduler
does the same). Chunks follow vLLM's scheduler for each mode:

    all:    min(remaining, budget)
    align:  vLLM's `_mamba_block_aligned_split`: a prefill chunk that does not reach the prompt
            end is cut down to a block boundary; a chunk starting mid-block stops at the next
            boundary; no chunk runs past the prompt's last block boundary `(n - 1) // B * B`
"""

from __future__ import annotations

import random
from typing import Protocol

Trace = list[tuple[list[int], int]]  # (prompt token ids, decode steps)
Case = tuple[int, int, int]  # (seed, token budget per step, max running requests)
#: Small budgets chunk prefills over many steps; large ones admit several requests per step,
#: which is where the same-step rule defers hits.
CASES: tuple[Case, ...] = ((0, 96, 4), (1, 96, 4), (2, 96, 4), (3, 96, 4), (4, 512, 8), (5, 512, 8), (6, 384, 6),
                           (7, 1024, 12))


class Driver(Protocol):
    """What the loop needs from a manager; requests are the driver's own objects."""

    def begin_step(self) -> None: ...
    def new_request(self, index: int, prompt: list[int]) -> object: ...
    def lookup(self, request: object) -> int: ...
    def admit(self, request: object, num_new_tokens: int) -> bool: ...
    def extend(self, request: object, num_new_tokens: int) -> bool: ...
    def append_token(self, request: object, token: int) -> None: ...
    def computed(self, request: object, num_tokens: int) -> None: ...
    def free(self, request: object) -> None: ...


def make_trace(seed: int, *, num_requests: int = 40, block_size: int = 16) -> Trace:
    """Prompts built from 4 shared prefixes (some ending mid-block) plus a unique suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.randint(2, 12) * block_size + rng.randint(0, 3))]
                for _ in range(4)]
    trace = []
    for _ in range(num_requests):
        prefix = rng.choice(prefixes)
        cut = prefix[: rng.randint(len(prefix) // 2, len(prefix))] if rng.random() < 0.85 else []
        suffix = [rng.randrange(1, 50_000) for _ in range(rng.randint(1, 3 * block_size))]
        trace.append((cut + suffix, rng.randint(0, 2 * block_size)))
    return trace


def case_name(case: Case) -> str:
    return "seed={}:budget={}:max_running={}".format(*case)


def replay_case(driver: Driver, case: Case, *, mode: str, not_before: list[int] | None = None) -> list[tuple[int, int]]:
    seed, budget, max_running = case
    return replay(driver, make_trace(seed), mode=mode, budget=budget, max_running=max_running, not_before=not_before)


def chunk_tokens(mode: str, *, start: int, budget: int, num_prompt: int, num_tokens: int, block_size: int) -> int:
    """Tokens to schedule for a request at `start` (see the module docstring)."""
    num_new = min(num_tokens - start, budget)
    if mode == "all" or start >= num_prompt:
        return num_new
    end = start + num_new
    if end < num_prompt:
        end = end // block_size * block_size
    stops = (block_size * (start // block_size + 1) if start % block_size else 0,
             (num_tokens - 1) // block_size * block_size)
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


def replay(driver: Driver, trace: Trace, *, mode: str, block_size: int = 16, budget: int = 96,
           max_running: int = 4, not_before: list[int] | None = None) -> list[tuple[int, int]]:
    """(admission step, hit tokens) per request of `trace`. With `not_before` (admission steps
    recorded from another manager), request i is not looked up before step `not_before[i]`."""
    admitted: list[tuple[int, int]] = [(-1, -1)] * len(trace)
    waiting = list(range(len(trace)))
    running: list[list[int]] = []  # [index, computed tokens, decode steps left]
    requests: dict[int, object] = {}
    lengths = [len(prompt) for prompt, _ in trace]
    step = 0
    while waiting or running:
        step += 1
        if step > 100 * len(trace):
            raise RuntimeError(f"replay stuck at step {step}: {len(waiting)} waiting, {len(running)} running")
        driver.begin_step()
        left = budget
        kept = []
        for item in running:
            index, computed, decode_left = item
            request = requests[index]
            prompt_len = len(trace[index][0])
            if computed >= prompt_len and decode_left == 0:
                driver.free(request)
                continue
            kept.append(item)
            if left == 0:
                continue
            if computed >= lengths[index]:  # decode: the model produced a token for the last position
                driver.append_token(request, 1 + (index * 1_000_003 + computed) % 49_999)
                lengths[index] += 1
                item[2] -= 1
            num_new = chunk_tokens(mode, start=computed, budget=left, num_prompt=prompt_len,
                                   num_tokens=lengths[index], block_size=block_size)
            if num_new == 0:
                continue
            if not driver.extend(request, num_new):
                raise RuntimeError(f"request {index}: the pool refused a running request; enlarge it")
            item[1] = computed + num_new
            driver.computed(request, item[1])
            left -= num_new
        running = kept
        while waiting and len(running) < max_running and left > 0:
            index = waiting[0]
            if not_before is not None and step < not_before[index]:
                break
            prompt, decode_steps = trace[index]
            request = requests.setdefault(index, driver.new_request(index, prompt))
            hit = driver.lookup(request)
            num_new = chunk_tokens(mode, start=hit, budget=left, num_prompt=len(prompt), num_tokens=len(prompt),
                                   block_size=block_size)
            if num_new == 0 or not driver.admit(request, num_new):
                break
            waiting.pop(0)
            admitted[index] = (step, hit)
            driver.computed(request, hit + num_new)
            running.append([index, hit + num_new, decode_steps])
            left -= num_new
    return admitted
