#!/usr/bin/env python
"""Prefix-hit tokens of our KV cache manager vs vLLM 0.32's real one, and vs an infinite cache.

Per layout (Gemma 3: full + sliding window; Qwen3.5: full + Gated DeltaNet; Nemotron-H: full +
Mamba2, each planned by our planner from the catalog config) and per seeded trace generator
(and per `prefix_cache_retention_interval`: dense everywhere, 0 everywhere, 4096 on Gemma 3; and
EAGLE on Gemma 3 and on a full-attention model),
the same trace runs through `hybridkv simulate`'s loop -- the engine's own scheduler -- twice:
over our manager, and over vLLM's manager (`vllm_hits_driver.py` under the vLLM venv, every
option at the same setting). Prints one line per run (hit tokens, requests whose hit differs,
simulate's wall time) and last:

    hits_vs_vllm=<our hit tokens / vLLM's> hits_vs_ideal=<our hit tokens / the infinite cache's>

    .venv/bin/python benchmarks/bench_hits.py [--quick] [--venv ~/.cache/hybridkv-bench/vllm-manager-venv]

Without the vLLM venv (`$HYBRIDKV_VLLM_VENV` or the default path) the vLLM side is skipped and
`hits_vs_vllm=skipped`. vLLM's venv lacks xxhash (our hashing imports it): it is installed into
`~/.cache/hybridkv-bench/xxhash-overlay` with the venv's pip on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hybridkv.catalog import find  # noqa: E402
from hybridkv.errors import CapacityError  # noqa: E402
from hybridkv.kvcache.manager import (  # noqa: E402
    MambaCacheMode,
    ReleaseOrder,
)
from hybridkv.kvcache.options import MECHANISM_DEFAULTS, PRESETS, CacheOptions, options_from  # noqa: E402
from hybridkv.plan.kv_cache_config import StateLayout  # noqa: E402
from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.planner import GIB, KVCacheConfig, PlannerOptions, plan  # noqa: E402
from hybridkv.simulate.generators import SHORT, Generator, GeneratorOptions, generate  # noqa: E402
from hybridkv.simulate.simulator import SimOptions, simulate  # noqa: E402
from hybridkv.simulate.trace import TraceRequest, read_mooncake  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mooncake_trace  # noqa: E402

LAYOUTS = {"gemma3": "gemma-3-27b-it", "qwen3.5": "qwen3.5-27b", "mamba2": "nemotron-nano-9b-v2",
           "full": "Llama-3.1-8B-Instruct"}
VENV = Path(os.environ.get("HYBRIDKV_VLLM_VENV", Path.home() / ".cache/hybridkv-bench/vllm-manager-venv"))
OVERLAY = Path.home() / ".cache/hybridkv-bench/xxhash-overlay"


#: the job fields that are CacheOptions fields taken as given (the rest are mapped in `materialize`)
CACHE_JOB_FIELDS = ("eviction", "checkpoint_placement", "checkpoint_interval_tokens", "decode_checkpoints",
                    "admission_headroom", "queue_order", "turn_checkpoints", "running_state",
                    "cache_aware_admission_window", "cache_aware_admission_threshold", "online_choice")


def _job_value(value: object) -> object:
    """A CacheOptions value as a job's JSON field (an enum by its value)."""
    return getattr(value, "value", value)


def materialize(job: dict[str, Any]) -> tuple[KVCacheConfig, list[TraceRequest], SimOptions]:
    """(our plan's config, the trace, the scheduler options) of a job: the same on both sides."""
    entry = find(job["model"])
    assert entry is not None, job["model"]
    mode = MambaCacheMode(job["mamba_cache_mode"])
    planned = plan(model_spec_from_config(entry.config, name=entry.hf_id),
                   PlannerOptions(memory_bytes=int(job["memory_gib"] * GIB), max_model_len=job["max_model_len"],
                                  max_num_batched_tokens=job["max_num_batched_tokens"], mamba_cache_mode=mode,
                                  state_layout=StateLayout(job.get("state_layout", "one_page")),
                                  block_size=job.get("block_size", 16)))
    if job["generator"] == "file":  # a Mooncake trace on disk (bench_hits_scale.py)
        trace = read_mooncake(Path(job["generator_options"]["path"]))
    elif job["generator"] == "mooncake":
        with tempfile.TemporaryDirectory() as tmp:
            path = mooncake_trace.write(Path(tmp) / "mooncake.jsonl", **job["generator_options"])
            trace = read_mooncake(path)
    else:
        trace = generate(Generator(job["generator"]), GeneratorOptions(**job["generator_options"]))
    config = planned.config
    if job.get("num_blocks"):
        config = dataclasses.replace(config, num_blocks=job["num_blocks"])
    elif job.get("pool_bytes"):  # the same bytes whatever the layout's page size
        config = dataclasses.replace(config, num_blocks=max(2, int(job["pool_bytes"] // bytes_per_block(config))))
    cache = options_from(MECHANISM_DEFAULTS, {
        "mamba_cache_mode": mode, "prefix_cache_retention_interval": job["retention"],
        "release_order": job["release_order"], "spec_decode": job["spec_decode"],
        "prefix_match_unit": match_unit(job, planned.config),
        **{name: job[name] for name in CACHE_JOB_FIELDS if name in job}})
    options = SimOptions(max_model_len=job["max_model_len"], max_num_batched_tokens=job["max_num_batched_tokens"],
                         max_num_seqs=job["max_num_seqs"], ms_per_token=job.get("ms_per_token", 0.0), cache=cache)
    return config, trace, options


def bytes_per_block(config: KVCacheConfig) -> float:
    """KV cache bytes one block id stands for (every tensor's page of it)."""
    return config.total_bytes / config.num_blocks


def match_unit(job: dict[str, Any], config: KVCacheConfig) -> int | None:
    """The job's prefix_match_unit in tokens ("block": the planned scheduler block)."""
    unit = job.get("prefix_match_unit")
    return math.lcm(*(g.block_size for g in config.groups)) if unit == "block" else unit


def jobs(quick: bool, release_order: str = "by_group") -> list[dict[str, Any]]:
    """Every layout x generator at dense retention, then Gemma 3 (sliding window) at vLLM's
    retention intervals 0 and 4096 (quick: one generator per layout, and retention 0 once)."""
    n = 30 if quick else 100
    generators = [Generator.CHAT] if quick else list(SHORT)
    runs = [(layout, g, None, "off") for layout in ("gemma3", "qwen3.5", "mamba2") for g in generators]
    runs += [("gemma3", g, r, "off") for r in ((0,) if quick else (0, 4096)) for g in generators]
    runs += [(layout, g, 0, "off") for layout in ("qwen3.5", "mamba2") for g in generators]
    runs += [(layout, g, r, "eagle") for layout, r in (("gemma3", None), ("gemma3", 0), ("full", None))
             for g in generators]
    batch = [{"layout": layout, "model": LAYOUTS[layout], "memory_gib": 8.0, "max_model_len": 32768,
              "max_num_batched_tokens": 2048, "max_num_seqs": 64, "mamba_cache_mode": "align",
              "retention": retention, "release_order": release_order, "spec_decode": spec,
              "generator": generator.value, "generator_options": {"num_requests": n, "seed": 0}}
             for layout, generator, retention, spec in runs]
    # prefix_match_unit: finer keys on Gemma 3 (hits stay on the block: its sliding window cannot look
    # up inside a block); the state block itself on Qwen3.5 and the Mamba2 hybrid
    units: dict[str, int | str] = {"gemma3": 8, "qwen3.5": "block", "mamba2": "block"}
    plain = [job for job in batch if job["retention"] is None and job["spec_decode"] == "off"]
    # and a unit below the state block on both (hits land inside blocks: partial hits, copy on write)
    partial = [{**job, "prefix_match_unit": 16} for job in plain if job["layout"] in ("qwen3.5", "mamba2")]
    # partial hits with vLLM's sparse retention (0: states at the replay boundary and junction only)
    partial += [{**job, "retention": 0} for job in partial]
    block = [{**job, "prefix_match_unit": units[job["layout"]]} for job in plain if job["layout"] in units]
    return batch + block + partial


def vllm_side(batch: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    python = VENV / "bin" / "python"
    if not python.exists():
        return None
    paths = [str(REPO)]
    probe = subprocess.run([str(python), "-c", "import xxhash"], capture_output=True)
    if probe.returncode:
        if not (OVERLAY / "xxhash").exists():
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--target", str(OVERLAY), "xxhash==4.1.0"],
                           check=True)
        paths.append(str(OVERLAY))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    done = subprocess.run([str(python), str(REPO / "benchmarks" / "vllm_hits_driver.py")], input=json.dumps(batch),
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"vLLM driver failed:\n{done.stderr[-3000:]}")
    result: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def job_name(job: dict[str, Any]) -> str:
    name = "{layout}:{generator}:{n}:{release_order}:retention={retention}:spec={spec_decode}".format(
        n=job["generator_options"]["num_requests"], **job)
    unit = job.get("prefix_match_unit")
    return name if unit is None else f"{name}:prefix_match_unit={unit}"


def record(path: Path) -> None:
    """Write vLLM's per-request hits for the quick and the full job lists (the CI fixture)."""
    batch = jobs(True) + jobs(False)
    theirs = vllm_side(batch)
    if theirs is None:
        raise SystemExit(f"no vLLM venv at {VENV}")
    version = subprocess.run([str(VENV / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    runs = {job_name(job): result["request_hits"] for job, result in zip(batch, theirs, strict=True)}
    path.write_text(json.dumps({"vllm_version": version, "runs": runs}, separators=(",", ":")) + "\n")


TARGET_LAYOUTS = ("qwen3.5", "mamba2", "gemma3")
TARGET_TRACES = (*(g.value for g in Generator), "mooncake")  # the short generators, sessions, a Mooncake trace
#: our setting: small attention blocks with a state over several pages (Mamba hybrids; one page otherwise),
#: one running state per request (checkpoints by copy; a hit on a finished request's end moved into it),
#: value-aware eviction, placed checkpoints, one decode checkpoint per request, admission headroom that keeps
#: the waiting requests' hits, the cache-aware queue
#: order (the longest cached prefix first), and checkpoints at the chat-message ends the trace carries
#: the project's best setting (`--preset hybridkv`) as job fields: where it differs from `--preset vllm`
OURS = {f.name: _job_value(getattr(PRESETS["hybridkv"], f.name)) for f in dataclasses.fields(CacheOptions)
        if getattr(PRESETS["hybridkv"], f.name) != getattr(PRESETS["vllm"], f.name)}


#: vLLM's settings tried per layout, the best taken: 0.32's dense retention and retention 0 (vLLM's engine
#: default), on the state layouts sub-block hits (prefix_match_unit 16: hits every 16 tokens inside the 784 /
#: 1312-token blocks), and 0.34's cache-aware admission (window 16, threshold 0.5: the first 16 waiting requests
#: deepest cached prefix first once half the pool is held; `engine/queue_order.py` models 0.34's rule exactly)
#: with either retention
VLLM_SETTINGS: dict[str, tuple[dict[str, Any], ...]] = {
    layout: ({"retention": None}, {"retention": 0},
             *(({"retention": None, "prefix_match_unit": 16},) if layout != "gemma3" else ()),
             {"retention": None, "cache_aware_admission_window": 16},
             {"retention": 0, "cache_aware_admission_window": 16})
    for layout in TARGET_LAYOUTS}
#: one GPU's KV cache memory (GiB): each layout planned at it, ours at our layout, vLLM's at its own
GPU_BUDGETS_GIB = (40.0, 64.0, 128.0)


def setting_name(setting: dict[str, Any]) -> str:
    unit = setting.get("prefix_match_unit")
    window = setting.get("cache_aware_admission_window")
    return (f"retention {setting['retention']}" + (f" unit {unit}" if unit else "")
            + (f" window {window}" if window else ""))


def budget_blocks(config: KVCacheConfig, distinct_tokens: int, fraction: float) -> int:
    """Blocks holding `fraction` of the distinct tokens with every group caching every block."""
    return 1 + math.ceil(fraction * distinct_tokens * sum(1 / g.block_size for g in config.groups))


def targets(seed: int, num_requests: int, ms_per_token: float = 0.0, *, quick: bool = False,
            no_vllm: bool = False) -> int:
    """Per layout x trace x budget: our manager at OURS (the hybridkv preset) vs vLLM's best setting
    (`VLLM_SETTINGS`: 0.32's manager, our scheduler with 0.34's admission window where set), and vs the
    infinite cache; and the prompt tokens each side computed (recompute after preemption included).
    Budgets: pools holding 25% / 100% of each trace's distinct tokens (the same bytes on both sides),
    and one GPU's KV memory (`GPU_BUDGETS_GIB`; each side planned at it). Ours runs twice: at OURS,
    and at OURS in FCFS order (`fcfs_hits`: the manager's policies alone). Prints per cell a line, then
    per layout the medians over the traces, then `best_vs_vllm_25pct=<min over layouts>
    hits_vs_ideal_100pct=<min over layouts>`, and last `min_cell_vs_vllm=<the minimum over every cell>`
    (quick: two traces, 64 GiB only)."""
    rows: list[tuple[str, str, str, int, int, int, int, float, int]] = []  # ..., nb, ours, vllm, ideal, prefill, fcfs
    batch: list[dict[str, Any]] = []
    ours: list[Any] = []
    traces = ("chat", "sessions") if quick else TARGET_TRACES
    gpu = (64.0,) if quick else GPU_BUDGETS_GIB
    for layout in TARGET_LAYOUTS:
        for trace_name in traces:
            base = {"layout": layout, "model": LAYOUTS[layout], "memory_gib": 8.0, "max_model_len": 32768,
                    "max_num_batched_tokens": 2048, "max_num_seqs": 64, "mamba_cache_mode": "align",
                    "retention": None, "release_order": "by_group", "spec_decode": "off", "generator": trace_name,
                    "generator_options": {"num_requests": num_requests, "seed": seed}, "ms_per_token": ms_per_token}
            config, trace, options = materialize(base)
            distinct = simulate(trace, config, options).distinct_tokens
            for budget, value in [("25%", 0.25), ("100%", 1.0), *((f"{g:g}GiB", g) for g in gpu)]:
                gib = budget.endswith("GiB")
                nb = 0 if gib else budget_blocks(config, distinct, value)
                while True:  # the same bytes on both sides: vLLM's blocks, ours at our layout's page size
                    job = ({**base, **OURS, "memory_gib": value} if gib
                           else {**base, **OURS, "pool_bytes": nb * bytes_per_block(config)})
                    try:
                        config_b, trace_b, options_b = materialize(job)
                        report = simulate(trace_b, config_b, options_b)
                        break
                    except CapacityError:
                        if gib:
                            raise
                        nb = nb * 5 // 4 + 1  # a request alone does not fit: the smallest pool that runs it
                fcfs_job = {**job, "queue_order": "fcfs"}  # the manager's policies alone, in vLLM's queue order
                config_f, trace_f, options_f = materialize(fcfs_job)
                fcfs = simulate(trace_f, config_f, options_f).hit_tokens
                ours.append((layout, trace_name, budget, nb or config_b.num_blocks, report, fcfs))
                theirs_pool = {"memory_gib": value} if gib else {"num_blocks": nb}
                batch += [{**base, **theirs_pool, **setting} for setting in VLLM_SETTINGS[layout]]
    theirs = None if no_vllm else vllm_side(batch)
    source = "vllm"
    if theirs is None:  # our manager at vLLM's settings: equal to vLLM's hits request by request (docs)
        source = "ours-at-vllm-settings"
        theirs = []
        for job in batch:
            config, trace, options = materialize(job)
            theirs.append(dataclasses.asdict(simulate(trace, config, options)))
    start = 0
    for layout, trace_name, budget, nb, report, fcfs in ours:
        settings = VLLM_SETTINGS[layout]
        tried = theirs[start : start + len(settings)]
        start += len(settings)
        other = max(tried, key=lambda t: t["hit_tokens"])
        best = other["hit_tokens"]
        tried_list = ", ".join(f"{setting_name(s)} {t['hit_tokens']}" for s, t in zip(settings, tried, strict=True))
        prefill = report.prefill_tokens / max(1, other["prefill_tokens"])
        rows.append((layout, trace_name, budget, nb, report.hit_tokens, best, report.ideal_tokens, prefill, fcfs))
        print(f"layout={layout} trace={trace_name} budget={budget} num_blocks={nb} hits={report.hit_tokens} "
              f"vs_{source}={report.hit_tokens / max(1, best):.3f} fcfs_hits={fcfs} {source}_best={best} "
              f"({tried_list}) "
              f"ideal={report.ideal_tokens} preemptions={report.preemptions}/{other['preemptions']} "
              f"prefill_tokens={report.prefill_tokens}/{other['prefill_tokens']} "
              f"held={report.mean_held_fraction:.2f}/{other['mean_held_fraction']:.2f} "
              f"wait_ms={report.mean_wait_ms:.0f}/{other['mean_wait_ms']:.0f} "
              f"p95_wait_ms={report.p95_wait_ms:.0f}/{other['p95_wait_ms']:.0f}")
    _summaries(rows, source, seed)
    return 0


def _summaries(rows: list[tuple[str, str, str, int, int, int, int, float, int]], source: str, seed: int) -> None:
    """Per layout the medians over the traces; then the minima over layouts; last the minimum cell."""
    vs_vllm, vs_ideal = {}, {}
    for layout in TARGET_LAYOUTS:
        mine = [r for r in rows if r[0] == layout]
        vs_vllm[layout] = statistics.median(r[4] / max(1, r[5]) for r in mine if r[2] == "25%")
        vs_ideal[layout] = statistics.median(r[4] / max(1, r[6]) for r in mine if r[2] == "100%")
        prefill = statistics.median(r[7] for r in mine if r[2] == "25%")
        fcfs = statistics.median(r[8] / max(1, r[5]) for r in mine if r[2] == "25%")
        gpu = " ".join(f"median_vs_{source}_{b}={statistics.median(r[4] / max(1, r[5]) for r in mine if r[2] == b):.3f}"
                       for b in dict.fromkeys(r[2] for r in mine if r[2].endswith("GiB")))
        print(f"layout={layout} median_vs_{source}_25pct={vs_vllm[layout]:.3f} "
              f"median_vs_ideal_100pct={vs_ideal[layout]:.3f} median_prefill_vs_{source}_25pct={prefill:.3f} "
              f"median_fcfs_vs_{source}_25pct={fcfs:.3f} {gpu}")
    print(f"best_vs_vllm_25pct={min(vs_vllm.values()):.3f} hits_vs_ideal_100pct={min(vs_ideal.values()):.3f} "
          f"seed={seed} vllm_side={source}")
    worst = min(rows, key=lambda r: (r[4] + 1) / (r[5] + 1))  # (+1: a cell where neither side hits is even)
    print(f"min_cell_vs_vllm={(worst[4] + 1) / (worst[5] + 1):.3f} layout={worst[0]} trace={worst[1]} "
          f"budget={worst[2]} hits={worst[4]} vllm_best={worst[5]} cells={len(rows)} seed={seed} vllm_side={source}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prefix hits: ours vs vLLM 0.32 vs an infinite cache")
    parser.add_argument("--quick", action="store_true", help="one short trace per layout (CI smoke)")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's side")
    parser.add_argument("--record", type=Path, help="write vLLM's hits for every job to this JSON file and exit")
    parser.add_argument("--release-order", choices=[o.value for o in ReleaseOrder], default="by_group",
                        help="our manager's free order (by_group: vLLM's, the parity setting)")
    parser.add_argument("--targets", action="store_true",
                        help="ours (the hybridkv preset) vs vLLM's best at 25%% / 100%% of each trace's distinct "
                             "tokens and at one GPU's KV memory (40 / 64 / 128 GiB); the minimum cell last")
    parser.add_argument("--seed", type=int, default=0, help="--targets: the traces' seed")
    parser.add_argument("--ms-per-token", type=float, default=0.0,
                        help="--targets: simulated ms each computed token adds to its step, both sides (0: 30 ms "
                             "steps whatever they compute)")
    args = parser.parse_args(argv)
    if args.targets:
        return targets(args.seed, 30 if args.quick else 100, args.ms_per_token, quick=args.quick, no_vllm=args.no_vllm)
    if args.record:
        record(args.record)
        return 0
    batch = jobs(args.quick, args.release_order)
    ours = []
    for job in batch:
        config, trace, options = materialize(job)
        ours.append(simulate(trace, config, options))
    theirs = None if args.no_vllm else vllm_side(batch)
    total_ours = sum(r.hit_tokens for r in ours)
    total_ideal = sum(r.ideal_tokens for r in ours)
    for i, (job, report) in enumerate(zip(batch, ours, strict=True)):
        line = (f"layout={job['layout']} trace={job['generator']} retention={job['retention']} "
                f"spec_decode={job['spec_decode']} prefix_match_unit={job.get('prefix_match_unit')} "
                f"requests={report.requests} "
                f"hits={report.hit_tokens} ideal={report.ideal_tokens} preemptions={report.preemptions} "
                f"simulate_s={report.wall_s:.2f}")
        if theirs is not None:
            other = theirs[i]
            differ = sum(a != b for a, b in zip(report.request_hits, other["request_hits"], strict=True))
            line += f" vllm_hits={other['hit_tokens']} requests_differing={differ}"
        print(line)
    vs_vllm = (f"{total_ours / max(1, sum(t['hit_tokens'] for t in theirs)):.3f}" if theirs is not None
               else "skipped")
    print(f"hits_vs_vllm={vs_vllm} hits_vs_ideal={total_ours / max(1, total_ideal):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
