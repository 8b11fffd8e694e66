"""`running_state`: the planner's per-request need and max concurrency, by hand (Qwen3.5-0.8B, 1 GiB, 512).

Pool (6 tensors; tests/plan/test_state_layout.py derives the pages): one_page 160 blocks of 544 tokens,
multi_page 2,730 blocks of 32 tokens and 17 pages per state; 3 Gated DeltaNet groups, 1 full group.
MOVING (align mode) counts 2 states per state group, FIXED 1: its checkpoint blocks are taken from
the free blocks after a step's allocations and released at once, so they never count against a request.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridkv.catalog import find
from hybridkv.cli import app
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, RunningState, StateLayout, plan
from hybridkv.plan.specs import MambaCacheMode


def qwen35(layout: StateLayout, running: RunningState, max_model_len: int = 512):  # type: ignore[no-untyped-def]
    entry = find("Qwen/Qwen3.5-0.8B")
    assert entry is not None
    spec = model_spec_from_config(entry.config, name=entry.hf_id)
    return plan(spec, PlannerOptions(memory_bytes=GIB, max_model_len=max_model_len, state_layout=layout,
                                     running_state=running))


@pytest.mark.parametrize(("layout", "running", "need", "usable"), [
    (StateLayout.ONE_PAGE, RunningState.MOVING, 3 * 2 + 1, 159),  # 3 groups x 2 states + ceil(512 / 544)
    (StateLayout.ONE_PAGE, RunningState.FIXED, 3 * 1 + 1, 159),
    (StateLayout.MULTI_PAGE, RunningState.MOVING, 3 * 2 * 17 + 16, 2729),  # + 512 / 32 attention blocks
    (StateLayout.MULTI_PAGE, RunningState.FIXED, 3 * 1 * 17 + 16, 2729),
])
def test_need_and_concurrency(layout: StateLayout, running: RunningState, need: int, usable: int) -> None:
    result = qwen35(layout, running)
    assert sum(result.blocks_per_request) == need
    assert result.max_concurrency == pytest.approx(usable / need)
    assert result.state_layouts[0].max_concurrency == pytest.approx(usable / need)


def test_short_requests_fixed_multi_page_vs_vllm_one_page() -> None:
    """At 192 tokens: one_page MOVING needs 6 + 1 blocks (159 / 7 = 22.7); multi_page FIXED 51 + 6 pages
    (2,729 / 57 = 47.9): 2.1x."""
    vllm = qwen35(StateLayout.ONE_PAGE, RunningState.MOVING, 192).max_concurrency
    ours = qwen35(StateLayout.MULTI_PAGE, RunningState.FIXED, 192).max_concurrency
    assert (vllm, ours) == (pytest.approx(159 / 7), pytest.approx(2729 / 57))


def test_fixed_with_all_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match="mamba_cache_mode=all"):
        PlannerOptions(memory_bytes=GIB, max_model_len=16, mamba_cache_mode=MambaCacheMode.ALL,
                       running_state=RunningState.FIXED)
    with pytest.raises(ConfigError, match="running_state must be one of"):
        PlannerOptions(memory_bytes=GIB, max_model_len=16, running_state="fixed")  # type: ignore[arg-type]


def test_plan_cli_reports_the_running_state() -> None:
    args = ["plan", "Qwen/Qwen3.5-0.8B", "--memory-gib", "1", "--max-model-len", "512", "--json"]
    moving = json.loads(CliRunner().invoke(app, args).output)
    out = CliRunner().invoke(app, [*args, "--running-state", "fixed"])
    assert out.exit_code == 0, out.output
    fixed = json.loads(out.output)
    assert (moving["running_state"], fixed["running_state"]) == ("moving", "fixed")
    assert fixed["max_concurrency"] == pytest.approx(159 / 4) and moving["max_concurrency"] == pytest.approx(159 / 7)
    text = CliRunner().invoke(app, [*args[:-1], "--running-state", "fixed"]).output
    assert "--running-state fixed" in text
    refused = CliRunner().invoke(app, ["plan", "Qwen/Qwen3.5-0.8B", "--running-state", "fixed", "--vllm"])
    assert refused.exit_code == 2 and "--running-state moving" in refused.output
