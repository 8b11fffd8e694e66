#!/usr/bin/env python
"""Prefix hits and capacity of a Mamba hybrid in the two state layouts (`--state-layout`).

A seeded shared-prefix trace (each request: one of a few shared prefixes of 100-500 tokens, then a
suffix of its own) runs through `hybridkv simulate`'s loop on Qwen3.5-0.8B (catalog config; full
attention + Gated DeltaNet) planned in the one-page layout (vLLM's: 544-token blocks) and in the
multi-page layout (16-token blocks, a state over 34 pages), at the same budget. Prints one line per
layout, then the planner's max concurrency of both at a short `max_model_len`; then short requests
(100-200-token prompts opening with one of a few 64-128-token prefixes, 16-32 generated tokens, all
arriving at once, `max_num_seqs` high) through `simulate` at a fixed budget, one line per setting
(one_page + moving = vLLM's, multi_page + moving, multi_page + fixed running state): the real peak
number of running requests, hits, preemptions and copies, with the planner's max concurrency of the
setting at the requests' longest length; then, multi-page layout, moving vs fixed at 1, 0.5 and
0.2 GiB (0.2: preemption everywhere) on the shared-prefix trace and the seeded chat, agentic,
system-prompt and branching generators (prompts ~512 tokens, answers ~64): hits, prompt tokens
computed (recompute after preemption included), preemptions; and last:

    multi_page_hits=<hit tokens> one_page_hits=<hit tokens> concurrency_ratio=<multi / one page>
        concurrency_fixed_ratio=<peak running: multi_page + fixed / one_page + moving>

    .venv/bin/python benchmarks/bench_state_layout.py [--quick]

Counts, not times: the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridkv.catalog import find  # noqa: E402
from hybridkv.kvcache.options import CacheOptions  # noqa: E402
from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.planner import GIB, PlannerOptions, RunningState, StateLayout, plan  # noqa: E402
from hybridkv.plan.specs import ModelSpec  # noqa: E402
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate  # noqa: E402
from hybridkv.simulate.simulator import SimOptions, simulate  # noqa: E402
from hybridkv.simulate.trace import TraceRequest  # noqa: E402

MODEL = "Qwen/Qwen3.5-0.8B"
MEMORY_GIB = 4.0
MAX_MODEL_LEN = 4096
SHORT_LEN = 512  # "short requests" for the capacity figure
BURST_GIB = 1.0  # the budget of the short-request burst
BUDGETS_GIB = (1.0, 0.5, 0.2)  # moving vs fixed on the generated traces (0.2: preemption everywhere)
LONG_LEN = 8192
BURST_SETTINGS = ((StateLayout.ONE_PAGE, RunningState.MOVING), (StateLayout.MULTI_PAGE, RunningState.MOVING),
                  (StateLayout.MULTI_PAGE, RunningState.FIXED))


def shared_prefix_trace(*, num_requests: int, num_prefixes: int, seed: int) -> list[TraceRequest]:
    """Requests opening with one of `num_prefixes` prefixes of 100-500 tokens, then 10-60 tokens of their own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32_000) for _ in range(rng.randint(100, 500))] for _ in range(num_prefixes)]
    return [TraceRequest(arrival_ms=100.0 * i, output_tokens=16,
                         new_tokens=tuple(rng.choice(prefixes) + [rng.randrange(32_000)
                                                                  for _ in range(rng.randint(10, 60))]))
            for i in range(num_requests)]


def short_request_burst(*, num_requests: int, seed: int) -> list[TraceRequest]:
    """Requests all arriving at 0: one of 8 prefixes of 64-128 tokens, then their own tokens up to a
    prompt of 100-200 tokens; 16-32 generated tokens each."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32_000) for _ in range(rng.randint(64, 128))] for _ in range(8)]
    out = []
    for _ in range(num_requests):
        prefix = rng.choice(prefixes)
        own = [rng.randrange(32_000) for _ in range(rng.randint(100, 200) - len(prefix))]
        out.append(TraceRequest(arrival_ms=0.0, output_tokens=rng.randint(16, 32), new_tokens=tuple(prefix + own)))
    return out


def burst(spec: ModelSpec, *, num_requests: int) -> dict[tuple[StateLayout, RunningState], int]:
    """The short-request burst in each setting (one line each); the peak running requests per setting."""
    trace = short_request_burst(num_requests=num_requests, seed=1)
    longest = max(len(r.new_tokens) + r.output_tokens for r in trace)
    peaks = {}
    for layout, running in BURST_SETTINGS:
        result = plan(spec, PlannerOptions(memory_bytes=int(BURST_GIB * GIB), max_model_len=longest,
                                           state_layout=layout, running_state=running))
        report = simulate(trace, result.config, SimOptions(max_model_len=longest, max_num_seqs=4096,
                                                           max_num_batched_tokens=8192,
                                                           cache=CacheOptions(running_state=running)))
        peaks[layout, running] = report.max_running
        print(f"burst layout={layout.value} running_state={running.value} memory_gib={BURST_GIB} "
              f"requests={report.requests} peak_running={report.max_running} mean_running={report.mean_running:.1f} "
              f"planner_concurrency={result.max_concurrency:.2f} hits={report.hit_tokens} ideal={report.ideal_tokens} "
              f"prefill_tokens={report.prefill_tokens} preemptions={report.preemptions} steps={report.steps} "
              f"block_copies={report.block_copies} "
              f"checkpoint_copies={report.checkpoint_copies} checkpoints_skipped={report.checkpoints_skipped}")
    return peaks


def hits_by_budget(spec: ModelSpec, *, num_requests: int, budgets: tuple[float, ...]) -> None:
    """Multi-page layout, moving vs fixed, at each budget: the shared-prefix trace and the generated
    traces (prompts ~512 tokens, answers ~64), one line per (budget, trace, running state)."""
    traces = {"shared": shared_prefix_trace(num_requests=2 * num_requests, num_prefixes=8, seed=0)}
    for kind in (Generator.CHAT, Generator.AGENTIC, Generator.SYSTEM_PROMPT, Generator.BRANCHING):
        traces[kind.value] = generate(kind, GeneratorOptions(num_requests=num_requests, seed=0,
                                                             mean_prompt_tokens=512, mean_output_tokens=64))
    for gib in budgets:
        for name, trace in traces.items():
            for running in RunningState:
                config = plan(spec, PlannerOptions(memory_bytes=int(gib * GIB), max_model_len=LONG_LEN,
                                                   state_layout=StateLayout.MULTI_PAGE, running_state=running)).config
                report = simulate(trace, config, SimOptions(max_model_len=LONG_LEN,
                                                                      cache=CacheOptions(running_state=running)))
                print(f"budget memory_gib={gib} trace={name} running_state={running.value} "
                      f"requests={report.requests} hits={report.hit_tokens} prefill_tokens={report.prefill_tokens} "
                      f"preemptions={report.preemptions} peak_running={report.max_running} "
                      f"checkpoint_copies={report.checkpoint_copies} checkpoints_skipped={report.checkpoints_skipped}")


def model() -> ModelSpec:
    entry = find(MODEL)
    assert entry is not None
    return model_spec_from_config(entry.config, name=entry.hf_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prefix hits and capacity: one-page vs multi-page states")
    parser.add_argument("--quick", action="store_true", help="a short trace (CI smoke)")
    args = parser.parse_args(argv)
    spec = model()
    trace = shared_prefix_trace(num_requests=24 if args.quick else 200, num_prefixes=4 if args.quick else 8, seed=0)
    hits = {}
    for layout in StateLayout:
        config = plan(spec, PlannerOptions(memory_bytes=int(MEMORY_GIB * GIB), max_model_len=MAX_MODEL_LEN,
                                           state_layout=layout)).config
        report = simulate(trace, config, SimOptions(max_model_len=MAX_MODEL_LEN))
        hits[layout] = report.hit_tokens
        print(f"layout={layout.value} model={MODEL} memory_gib={MEMORY_GIB} requests={report.requests} "
              f"prompt_tokens={report.prompt_tokens} hits={report.hit_tokens} ideal={report.ideal_tokens} "
              f"attention_block={config.attention_block_size} pages_per_state={config.pages_per_state}")
    short = plan(spec, PlannerOptions(memory_bytes=int(MEMORY_GIB * GIB), max_model_len=SHORT_LEN))
    one, multi = short.state_layouts
    ratio = multi.max_concurrency / one.max_concurrency
    print(f"max_concurrency max_model_len={SHORT_LEN} one_page={one.max_concurrency:.2f} "
          f"multi_page={multi.max_concurrency:.2f}")
    peaks = burst(spec, num_requests=100 if args.quick else 600)
    hits_by_budget(spec, num_requests=12 if args.quick else 100,
                   budgets=BUDGETS_GIB[-1:] if args.quick else BUDGETS_GIB)
    fixed_ratio = (peaks[StateLayout.MULTI_PAGE, RunningState.FIXED]
                   / peaks[StateLayout.ONE_PAGE, RunningState.MOVING])
    print(f"multi_page_hits={hits[StateLayout.MULTI_PAGE]} one_page_hits={hits[StateLayout.ONE_PAGE]} "
          f"concurrency_ratio={ratio:.2f} concurrency_fixed_ratio={fixed_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
