"""KV cache manager benchmark: manager time per scheduled token on a shared-prefix trace.

    python benchmarks/bench_manager.py [--layout gemma3|mamba|both] [--n 10000] [--seed 0]
        [--max-running 32] [--profile] [--gc-freeze] [--json PATH] [--quick]

40,000 blocks of 16 tokens (more with --max-running above 32, so the pool never runs out),
max 32 running requests, max_model_len 8192, prefix caching on. Layouts: `gemma3` = 1
full-attention group + 5 sliding-window groups (window 1024); `mamba` = 1 full-attention group
+ 3 Mamba groups (Qwen3-Next's 1:3), run twice: `mamba-align` (MambaCacheMode.ALIGN) and
`mamba-all` (MambaCacheMode.ALL). Whole prompts are allocated in one step, so ALIGN mode keeps
a checkpoint only where a prompt ends on a block boundary (hit rate near 0) while ALL mode keeps
one at every boundary.

Each step: `begin_step`; every running request either finishes (free) or appends one token and allocates one
slot (a refused decode preempts it: freed and requeued); then waiting requests are admitted in
order while fewer than 32 run: lookup, then allocate the whole remaining prompt; a refusal (or a
hit deferred by the same-step rule) stops admission for this step. Only manager calls are timed;
hashing a request's blocks is timed separately (`us_per_request_hash`, prompt + decode blocks per
request). The last line is

    ns_per_scheduled_token=<ns> decode_allocate_us=<us> us_per_request_hash=<us> <layout>=<ns> ...

with ns = manager time / (prefill tokens scheduled + decode tokens); the first three figures are
those of the first layout run (gemma3 by default), the hash figure averaged over layouts.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter_ns

from tqdm import tqdm

from hybridkv.kvcache.hashing import BlockHasher
from hybridkv.kvcache.ids import RequestId
from hybridkv.kvcache.manager import KVCacheManager, MambaCacheMode
from hybridkv.kvcache.options import CacheOptions
from hybridkv.kvcache.request import KVRequest
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MambaType, SpecKind

try:
    from benchmarks.traces import Trace, make_trace
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from traces import Trace, make_trace  # type: ignore[no-redef,import-not-found]

NUM_BLOCKS = 40_000
BLOCK_SIZE = 16
MAX_RUNNING = 32
MAX_MODEL_LEN = 8192
WINDOW_TOKENS = 1024
QUICK_N = 300
LAYOUTS = ("gemma3", "mamba")
OPS = ("lookup", "allocate", "decode", "free", "step")  # step: begin_step
#: What each --layout runs: (layout, Mamba cache mode, report name).
RUNS = {"gemma3": [("gemma3", MambaCacheMode.ALIGN, "gemma3")],
        "mamba": [("mamba", MambaCacheMode.ALIGN, "mamba-align"), ("mamba", MambaCacheMode.ALL, "mamba-all")]}


def build_config(layout: str, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """The benchmark's KV cache config: every group has 16-token blocks."""
    full = AttentionSpec(kind=SpecKind.FULL, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    other: LayerSpec
    if layout == "gemma3":
        other, count = AttentionSpec(kind=SpecKind.SLIDING_WINDOW, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                                     window_tokens=WINDOW_TOKENS), 5
    elif layout == "mamba":
        other, count = MambaSpec(mamba_type=MambaType.GATED_DELTANET, shapes=((3, 8192), (32, 128, 128)),
                                 dtypes=("bfloat16", "float32")), 3
    else:
        raise SystemExit(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    specs = [full] + [other] * count
    groups = tuple(KVCacheGroupSpec(group_id=i, spec=s, layer_indices=(i,), block_size=BLOCK_SIZE)
                   for i, s in enumerate(specs))
    return KVCacheConfig(model=f"bench-{layout}", num_blocks=num_blocks, page_size_bytes=BLOCK_SIZE * 4096,
                         group_size=1, groups=groups, tensors=())


@dataclass
class Result:
    layout: str
    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    hash_ns: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    requests: int = 0

    @property
    def manager_ns(self) -> int:
        return sum(self.ns.values())

    @property
    def ns_per_token(self) -> float:
        return self.manager_ns / max(1, self.prefill_tokens + self.decode_tokens)

    @property
    def us_per_request_hash(self) -> float:
        return self.hash_ns / 1000 / max(1, self.requests)

    def op_us(self, op: str) -> float:
        return self.ns[op] / 1000 / max(1, self.calls[op])

    def figures(self) -> dict[str, float]:
        """The reported figures by name (`--json`; `bench_manager_vs_vllm.py` reads them)."""
        return {"lookup_us": self.op_us("lookup"), "allocate_us": self.op_us("allocate"),
                "decode_allocate_us": self.op_us("decode"), "free_us": self.op_us("free"),
                "ns_per_scheduled_token": self.ns_per_token, "hit_rate": self.hit_tokens / max(1, self.prompt_tokens),
                "scheduled_tokens": self.prefill_tokens + self.decode_tokens, "decode_calls": self.calls["decode"],
                "preemptions": self.preemptions, "manager_s": self.manager_ns / 1e9}


@dataclass
class _Job:
    request: KVRequest
    decode_left: int


def run(layout: str, trace: Trace, *, seed: int, progress: bool, mode: MambaCacheMode = MambaCacheMode.ALIGN,
        name: str = "", max_running: int = MAX_RUNNING) -> Result:
    """Replay `trace` on a fresh manager; see the module docstring for the loop."""
    num_blocks = NUM_BLOCKS * max(1, -(-max_running // MAX_RUNNING))
    manager = KVCacheManager(build_config(layout, num_blocks), max_model_len=MAX_MODEL_LEN,
        options=CacheOptions(mamba_cache_mode=mode))
    hasher = BlockHasher()
    rng = random.Random(seed + 1)
    result = Result(layout=name or layout, requests=len(trace))
    ns, calls = result.ns, result.calls
    waiting: deque[_Job] = deque(
        _Job(KVRequest(request_id=RequestId(f"r{i}"), token_ids=list(prompt)), steps)
        for i, (prompt, steps) in enumerate(trace)
    )
    running: list[_Job] = []
    bar = tqdm(total=len(trace), desc=layout, unit="req", disable=not progress, file=sys.stderr, leave=False)
    while waiting or running:
        t0 = perf_counter_ns()
        manager.begin_step()
        ns["step"] += perf_counter_ns() - t0
        kept: list[_Job] = []
        for job in running:
            request = job.request
            if not job.decode_left:
                t0 = perf_counter_ns()
                manager.free(request)
                ns["free"] += perf_counter_ns() - t0
                calls["free"] += 1
                bar.update(1)
                continue
            request.token_ids.append(rng.randrange(1, 150000))
            t0 = perf_counter_ns()
            hasher.update(request, BLOCK_SIZE)
            t1 = perf_counter_ns()
            new = manager.allocate(request, 1)
            ns["decode"] += perf_counter_ns() - t1
            result.hash_ns += t1 - t0
            calls["decode"] += 1
            if new is None:  # preempt by recompute: the request starts over
                manager.free(request)
                request.num_computed_tokens = 0
                result.preemptions += 1
                waiting.appendleft(job)
                continue
            request.num_computed_tokens += 1
            job.decode_left -= 1
            result.decode_tokens += 1
            kept.append(job)
        running = kept
        while waiting and len(running) < max_running:
            if not _admit(manager, hasher, waiting[0], result):
                break
            running.append(waiting.popleft())
    bar.close()
    manager.check_integrity()
    return result


def _admit(manager: KVCacheManager, hasher: BlockHasher, job: _Job, result: Result) -> bool:
    request = job.request
    ns, calls = result.ns, result.calls
    t0 = perf_counter_ns()
    hasher.update(request, BLOCK_SIZE)
    t1 = perf_counter_ns()
    hit = manager.lookup(request)
    t2 = perf_counter_ns()
    new = manager.allocate(request, request.num_tokens - hit.num_tokens, hit=hit)
    t3 = perf_counter_ns()
    result.hash_ns += t1 - t0
    ns["lookup"] += t2 - t1
    ns["allocate"] += t3 - t2
    calls["lookup"] += 1
    calls["allocate"] += 1
    if new is None:
        return False
    scheduled = request.num_tokens - hit.num_tokens
    result.prefill_tokens += scheduled
    result.prompt_tokens += request.num_tokens
    result.hit_tokens += hit.num_tokens
    request.num_computed_tokens = request.num_tokens
    return True


def report(result: Result) -> None:
    print(
        f"{result.layout}: lookup_us={result.op_us('lookup'):.1f} allocate_us={result.op_us('allocate'):.1f} "
        f"decode_allocate_us={result.op_us('decode'):.2f} free_us={result.op_us('free'):.1f} "
        f"hit_rate={result.hit_tokens / max(1, result.prompt_tokens):.3f} "
        f"prefill_tokens={result.prefill_tokens} decode_tokens={result.decode_tokens} "
        f"preemptions={result.preemptions} manager_s={result.manager_ns / 1e9:.2f} "
        f"ns_per_scheduled_token={result.ns_per_token:.0f} us_per_request_hash={result.us_per_request_hash:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layout", choices=(*LAYOUTS, "both"), default="both")
    parser.add_argument("--n", type=int, default=10_000, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"CI smoke run: n={QUICK_N}")
    parser.add_argument("--profile", action="store_true", help="print the top functions by own time")
    parser.add_argument("--max-running", type=int, default=MAX_RUNNING,
                        help="most running requests (the pool grows with it, so it never runs out)")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.collect(); gc.freeze() before each run (as an engine does after start-up)")
    parser.add_argument("--json", default=None, help="also write each run's figures to this file")
    args = parser.parse_args(argv)
    if args.max_running < 1:
        parser.error(f"--max-running must be >= 1, got {args.max_running}")
    n = QUICK_N if args.quick else args.n
    trace = make_trace(n, args.seed)
    layouts = LAYOUTS if args.layout == "both" else (args.layout,)
    results = []
    for layout, mode, name in [spec for chosen in layouts for spec in RUNS[chosen]]:
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        results.append(run(layout, trace, seed=args.seed, progress=not args.quick and sys.stderr.isatty(), mode=mode,
                           name=name, max_running=args.max_running))
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
        report(results[-1])
        if args.gc_freeze:
            gc.unfreeze()
    if args.json:
        with open(args.json, "w") as out:
            json.dump({r.layout: r.figures() for r in results}, out, indent=1)
    hash_us = sum(r.us_per_request_hash for r in results) / len(results)
    per_layout = " ".join(f"{r.layout}={r.ns_per_token:.0f}" for r in results)
    # headline: the first layout (gemma3 by default); every layout's figure follows by name
    head = results[0]
    print(f"ns_per_scheduled_token={head.ns_per_token:.0f} decode_allocate_us={head.op_us('decode'):.2f} "
          f"us_per_request_hash={hash_us:.1f} max_running={args.max_running} {per_layout}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
