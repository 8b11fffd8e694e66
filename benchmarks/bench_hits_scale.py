#!/usr/bin/env python
"""Issue 45's production-scale cells: hits of `--preset hybridkv` against vLLM's best setting, per layout x budget.

The trace is `bench_simulate_scale.py`'s (2,000 requests, ~27M prompt tokens, 512-token segments, seeded
by `--seed`), or any Mooncake trace given with `--trace` (JSONL: timestamp, input_length, output_length,
hash_ids). Each layout of `bench_hits.TARGET_LAYOUTS` runs ours (`bench_hits.OURS`, the hybridkv preset)
and every one of `bench_hits.VLLM_SETTINGS` through our simulator, at the budgets:

    25% / 100%   pools holding that share of the trace's distinct tokens with every group caching every
                 block (`bench_hits.budget_blocks`), the same bytes on both sides
    64GiB        one GPU's KV memory, each side planned at it

vLLM's side is our manager at vLLM's settings, which equals vLLM 0.32's manager request by request
(docs/prefix_caching.md; `bench_hits.py` drives vLLM's own manager on the short traces, too slow here).
Prints a line per run (hits, preemptions, prompt tokens computed, blocks, CPU seconds), a `CELL` line per
layout x budget (ours / the best vLLM setting), then last:

    min_cell_vs_vllm=<the worst cell's ratio> layout=... budget=... cells=<n> seed=<seed>

    .venv/bin/python benchmarks/bench_hits_scale.py [--seed 1] [--layouts mamba2] [--budgets 25%,64GiB]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hits import (  # noqa: E402
    LAYOUTS,
    OURS,
    TARGET_LAYOUTS,
    VLLM_SETTINGS,
    budget_blocks,
    bytes_per_block,
    materialize,
    setting_name,
)
from bench_simulate_scale import SCALE_SHAPE, write_trace  # noqa: E402

from hybridkv.plan.kv_cache_config import KVCacheConfig  # noqa: E402
from hybridkv.simulate.simulator import simulate  # noqa: E402

BUDGETS = ("25%", "100%", "64GiB")


def base_job(layout: str, trace: Path) -> dict[str, Any]:
    """A layout's job at vLLM's defaults on the trace file (bench_hits' scheduler limits)."""
    return {"layout": layout, "model": LAYOUTS[layout], "memory_gib": 8.0, "max_model_len": 32768,
            "max_num_batched_tokens": 2048, "max_num_seqs": 64, "mamba_cache_mode": "align", "retention": None,
            "release_order": "by_group", "spec_decode": "off", "generator": "file",
            "generator_options": {"path": str(trace)}, "ms_per_token": 0.0}


def run(job: dict[str, Any]) -> tuple[Any, int, float]:
    """(the simulate report, the pool's blocks, CPU seconds) of one job."""
    config, trace, options = materialize(job)
    started = time.process_time()
    report = simulate(trace, config, options)
    return report, config.num_blocks, time.process_time() - started


def cell(layout: str, budget: str, trace: Path, config: KVCacheConfig, distinct: int) -> tuple[int, int]:
    """Prints the runs of one layout x budget (`config`: the layout at vLLM's defaults, `distinct` the trace's
    distinct tokens); returns (our hits, vLLM's best hits)."""
    base = base_job(layout, trace)
    if budget.endswith("GiB"):
        pool: dict[str, Any] = {"memory_gib": float(budget[: -len("GiB")])}
    else:
        pool = {"pool_bytes": budget_blocks(config, distinct, float(budget[:-1]) / 100) * bytes_per_block(config)}
    hits: list[int] = []
    for name, setting in [("ours", OURS), *((setting_name(s), s) for s in VLLM_SETTINGS[layout])]:
        report, blocks, cpu = run({**base, **setting, **pool})
        hits.append(report.hit_tokens)
        print(f"layout={layout} budget={budget} setting={name.replace(' ', '_')} hits={report.hit_tokens} "
              f"ideal={report.ideal_tokens} preemptions={report.preemptions} prefill_tokens={report.prefill_tokens} "
              f"num_blocks={blocks} cpu_s={cpu:.0f}", flush=True)
    return hits[0], max(hits[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the generated trace's seed")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--trace", type=Path, help="a Mooncake trace to use instead of the generated one")
    parser.add_argument("--layouts", default=",".join(TARGET_LAYOUTS))
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated: N%% or NGiB")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace
        if trace is None:
            trace = Path(tmp) / "trace.jsonl"
            write_trace(trace, num_requests=args.num_requests, seed=args.seed, shape=SCALE_SHAPE)
        cells: list[tuple[float, str, str]] = []
        for layout in args.layouts.split(","):
            config, requests, options = materialize(base_job(layout, trace))
            distinct = simulate(requests, config, options).distinct_tokens
            for budget in args.budgets.split(","):
                ours, best = cell(layout, budget, trace, config, distinct)
                ratio = (ours + 1) / (best + 1)  # (+1: a cell where neither side hits is even)
                cells.append((ratio, layout, budget))
                print(f"CELL layout={layout} budget={budget} seed={args.seed} ours={ours} vllm_best={best} "
                      f"ratio={ratio:.3f}", flush=True)
    worst = min(cells)
    print(f"min_cell_vs_vllm={worst[0]:.3f} layout={worst[1]} budget={worst[2]} cells={len(cells)} seed={args.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
