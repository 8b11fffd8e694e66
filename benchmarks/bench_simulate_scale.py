#!/usr/bin/env python
"""`hybridkv simulate` at production scale: wall time and peak memory per layout x preset x budget.

A seeded production-like trace (`hybridkv simulate --generate sessions`' generator, `SCALE_SHAPE`:
2,000 requests, ~27M prompt tokens, ~13.5k tokens per prompt, 512-token segments, an infinite
cache hits ~30% of the prompt tokens, as the held-out production conversation trace of issue 45:
2,000 requests, 27.4M prompt tokens, 29%) is written once as a Mooncake trace, then replayed
black-box by `hybridkv simulate MODEL --trace FILE --preset P --memory-gib G --json`, one process
per run, for every layout of `bench_hits.TARGET_LAYOUTS` (Qwen3.5-27B, Nemotron-Nano-9B-v2,
Gemma-3-27B), both presets and each budget:

    8GiB / 64GiB   KV memory (64 GiB: one GPU's)
    10Mblocks      the memory that holds 10,000,000 blocks at the preset's layout (the multi-page
                   layout's 64-token pages: 10 TB on Nemotron-H; vLLM's one-page blocks: far more)

Prints one line per run (hit tokens, blocks, wall seconds, the process's peak RSS from `wait4`,
and `error=<its one-line message>` where it failed or `timeout`), then last:

    max_wall_s=<slowest run> max_rss_gib=<largest peak RSS> runs=<runs> failed=<runs that failed>

    .venv/bin/python benchmarks/bench_simulate_scale.py [--quick] [--budgets 64GiB,10Mblocks]

Times depend on the machine and its load (say which); hit tokens do not (seeded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridkv.catalog import find  # noqa: E402
from hybridkv.kvcache.options import PRESETS  # noqa: E402
from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.planner import GIB, PlannerOptions, plan  # noqa: E402
from hybridkv.simulate.generators import SESSION_OUTPUT_TOKENS  # noqa: E402
from hybridkv.simulate.sessions import SessionShape, sessions  # noqa: E402
from hybridkv.simulate.trace import write_mooncake  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hits import LAYOUTS, TARGET_LAYOUTS  # noqa: E402

#: the sessions generator scaled to the production trace's size (module docstring): long first messages,
#: 1.5 turns per session, 200 shared documents in a third of the sessions
SCALE_SHAPE = SessionShape(mean_turns=1.5, first_message_segments=19, turn_segments=4, documents=200,
                           document_segments=(2, 24), document_probability=0.33)
MAX_MODEL_LEN = 32768
BUDGETS = ("8GiB", "64GiB", "10Mblocks")


def write_trace(path: Path, *, num_requests: int, seed: int, shape: SessionShape) -> None:
    trace = sessions(num_requests, seed=seed, gap_ms=100.0, mean_output_tokens=SESSION_OUTPUT_TOKENS, shape=shape)
    write_mooncake(trace, path)


def memory_gib(model: str, preset: str, budget: str) -> float:
    """The --memory-gib of a budget: as given in GiB, or the memory of `N` blocks at the preset's layout."""
    if budget.endswith("GiB"):
        return float(budget[: -len("GiB")])
    blocks = int(float(budget[: -len("Mblocks")]) * 1_000_000)
    entry = find(model)
    assert entry is not None, model
    cache = PRESETS[preset]
    config = plan(model_spec_from_config(entry.config, name=entry.hf_id),
                  PlannerOptions(memory_bytes=64 * GIB, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=2048,
                                 mamba_cache_mode=cache.mamba_cache_mode, state_layout=cache.state_layout,
                                 running_state=cache.running_state)).config
    return blocks * (config.total_bytes / config.num_blocks) / GIB * (1 + 1e-9)


def run_one(trace: Path, model: str, preset: str, gib: float, timeout_s: float) -> dict[str, object]:
    """One `hybridkv simulate` process: its report's numbers, wall time, peak RSS, or its error line."""
    cmd = [sys.executable, "-m", "hybridkv", "simulate", model, "--trace", str(trace), "--preset", preset,
           "--memory-gib", f"{gib:.6f}", "--max-model-len", str(MAX_MODEL_LEN), "--json"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - started > timeout_s:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait again)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    row: dict[str, object] = {"wall_s": wall, "rss_gib": usage.ru_maxrss * 1024 / GIB,
                              "cpu_s": usage.ru_utime + usage.ru_stime}
    if timed_out:
        row["error"] = f"timeout after {timeout_s:g} s"
    elif proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        traceback = any(line.startswith("Traceback") for line in lines)
        row["error"] = ("TRACEBACK " if traceback else "") + (lines[-1].strip() if lines else f"exit {proc.returncode}")
    else:
        report = json.loads(stdout)
        row.update(hits=report["hit_tokens"], num_blocks=report["num_blocks"], prompt_tokens=report["prompt_tokens"],
                   ideal=report["ideal_tokens"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 12-request trace at 4 GiB (CI smoke)")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default=",".join(BUDGETS), help="comma-separated: NGiB or NMblocks")
    parser.add_argument("--layouts", default=",".join(TARGET_LAYOUTS))
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    args = parser.parse_args(argv)
    budgets = ["4GiB"] if args.quick else args.budgets.split(",")
    num_requests, shape = (12, SessionShape()) if args.quick else (args.num_requests, SCALE_SHAPE)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "sessions.jsonl"
        write_trace(trace, num_requests=num_requests, seed=args.seed, shape=shape)
        for layout in args.layouts.split(","):
            model = LAYOUTS[layout]
            for preset in args.presets.split(","):
                for budget in budgets:
                    row = run_one(trace, model, preset, memory_gib(model, preset, budget), args.timeout_s)
                    rows.append(row)
                    result = (f"hits={row['hits']} ideal={row['ideal']} prompt_tokens={row['prompt_tokens']} "
                              f"num_blocks={row['num_blocks']}" if "error" not in row else f"error={row['error']}")
                    print(f"layout={layout} preset={preset} budget={budget} {result} wall_s={row['wall_s']:.1f} "
                          f"cpu_s={row['cpu_s']:.1f} rss_gib={row['rss_gib']:.2f}", flush=True)
    failed = sum("error" in row for row in rows)
    walls = [float(str(row["wall_s"])) for row in rows]
    rss = [float(str(row["rss_gib"])) for row in rows]
    print(f"max_wall_s={max(walls):.1f} max_rss_gib={max(rss):.2f} runs={len(rows)} failed={failed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
