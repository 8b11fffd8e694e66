#!/usr/bin/env python
"""Times vLLM 0.32's real KV cache manager on `bench_manager.py`'s trace and loop (run in the vLLM venv).

    ~/.cache/hybridkv-bench/vllm-manager-venv/bin/python benchmarks/vllm_manager_timing.py \\
        [--n 3000] [--seed 0] [--max-running 32] [--num-blocks 40000] [--reps 1] [--gc-freeze] [--json OUT]

The layout of `bench_manager.py --layout gemma3`: 1 full-attention group + 5 sliding-window groups
(window 1024), 16-token blocks. The trace is `traces.make_trace(n, seed)` (the same module ours
reads). Each step: `new_step_starts`; every running request either finishes (`free`) or decodes one
token (`allocate_slots(request, 1)`); then requests are admitted in order while fewer than
`--max-running` run, each with its whole prompt (`get_computed_blocks`, then `allocate_slots` with
the hit); a refused admission waits for the next step. Making a request (block hashing) and
appending its token are the engine core's work and are not timed. Prints one line per rep and,
with `--json`, writes {"median": {us_gcb, us_alloc_prefill, us_alloc_decode, us_free,
ns_per_sched_token, sched_tokens, hit_rate}} for `bench_manager_vs_vllm.py`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_manager
from traces import Trace, make_trace
from vllm.v1.request import RequestStatus

BLOCK_TOKENS, WINDOW_TOKENS, SLIDING_GROUPS, NEXT_TOKEN = 16, 1024, 5, 7


@dataclass(slots=True)
class Clock:
    """Seconds and calls per timed manager operation."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("step", "gcb", "prefill", "decode",
                                                                              "free"), 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("gcb", "prefill", "decode", "free"), 0))

    def timed(self, op: str, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.seconds[op] += time.perf_counter() - start
        if op in self.calls:
            self.calls[op] += 1
        return result


def replay(trace: Trace, *, num_blocks: int, max_running: int, max_model_len: int) -> dict[str, float]:
    specs = [vllm_manager.full(BLOCK_TOKENS)] + [vllm_manager.sliding(BLOCK_TOKENS, WINDOW_TOKENS)] * SLIDING_GROUPS
    cfg = vllm_manager.config(specs, num_blocks=num_blocks)
    mgr = vllm_manager.manager(cfg, max_model_len=max_model_len)
    clock = Clock()
    queue = list(range(len(trace)))[::-1]  # next request at the end
    running: list[list] = []  # [request, decode steps left]
    prompt_tokens = hit_tokens = new_tokens = decoded = 0
    while queue or running:
        clock.timed("step", mgr.new_step_starts)
        still = []
        for entry in running:
            req, left = entry
            if left == 0:
                clock.timed("free", mgr.free, req)
                req.status = RequestStatus.FINISHED_STOPPED
                continue
            req.append_output_token_ids(NEXT_TOKEN)
            if clock.timed("decode", mgr.allocate_slots, req, 1) is None:
                raise SystemExit(f"a decode step found no free block: raise --num-blocks (now {num_blocks})")
            req.num_computed_tokens += 1
            decoded += 1
            entry[1] = left - 1
            still.append(entry)
        running = still
        while queue and len(running) < max_running:
            tokens, steps = trace[queue[-1]]
            req = vllm_manager.request(str(len(trace) - len(queue)), tokens, hash_block=BLOCK_TOKENS)
            blocks, hit, _ = clock.timed("gcb", mgr.get_computed_blocks, req)
            if clock.timed("prefill", mgr.allocate_slots, req, req.num_tokens - hit, num_new_computed_tokens=hit,
                           new_computed_blocks=blocks) is None:
                break
            queue.pop()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = req.num_tokens
            prompt_tokens, hit_tokens, new_tokens = prompt_tokens + req.num_tokens, hit_tokens + hit, \
                new_tokens + req.num_tokens - hit
            running.append([req, steps])
    if mgr.block_pool.get_num_free_blocks() != num_blocks - 1:
        raise SystemExit("internal error: blocks still held after every request finished")
    s, c = clock.seconds, clock.calls
    scheduled = new_tokens + decoded
    return {"us_gcb": 1e6 * s["gcb"] / c["gcb"], "us_alloc_prefill": 1e6 * s["prefill"] / c["prefill"],
            "us_alloc_decode": 1e6 * s["decode"] / c["decode"], "us_free": 1e6 * s["free"] / c["free"],
            "ns_per_sched_token": 1e9 * sum(s.values()) / scheduled, "sched_tokens": scheduled,
            "hit_rate": hit_tokens / prompt_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=40_000)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--gc-freeze", action="store_true", help="gc.collect(); gc.freeze() before each rep "
                        "(as vLLM's engine core does after start-up)")
    parser.add_argument("--json", default=None, help="write the per-rep figures and their medians here")
    args = parser.parse_args()
    trace = make_trace(args.n, args.seed)
    print(f"config=gemma3 full+{SLIDING_GROUPS}xsliding(window {WINDOW_TOKENS}) block={BLOCK_TOKENS} "
          f"num_blocks={args.num_blocks} max_running={args.max_running} n={args.n}", flush=True)
    reps = []
    for rep in range(args.reps):
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        reps.append(replay(trace, num_blocks=args.num_blocks, max_running=args.max_running,
                           max_model_len=args.max_model_len))
        if args.gc_freeze:
            gc.unfreeze()
        print(f"rep {rep}: " + " ".join(f"{k}={v:.3f}" for k, v in reps[-1].items()), flush=True)
    median = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "reps": reps, "median": median}, f)
    print(f"ns_per_sched_token={median['ns_per_sched_token']:.0f} hit_rate={median['hit_rate']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
