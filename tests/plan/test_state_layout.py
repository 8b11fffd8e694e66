"""The multi-page state layout (`StateLayout.MULTI_PAGE`) against hand-computed Qwen3.5-0.8B figures."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from hybridkv.catalog import find
from hybridkv.cli import app
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, KVCacheGroupSpec, PlannerOptions, StateLayout, plan
from hybridkv.plan.specs import AttentionSpec, SpecKind

# Qwen3.5-0.8B (catalog): 18 Gated DeltaNet + 6 full attention layers; bf16, recurrent state float32.
CONV_BYTES = 3 * (2 * 16 * 128 + 16 * 128) * 2  # (K-1) x (2 * k_heads * k_dim + v_heads * v_dim), bf16
RECURRENT_BYTES = 16 * 128 * 128 * 4  # v_heads x v_dim x k_dim, float32
STATE_BYTES = CONV_BYTES + RECURRENT_BYTES  # 1,085,440
ATTN_PER_TOKEN = 2 * 2 * 256 * 2  # K and V x 2 kv heads x head dim 256 x bf16
GROUP_SIZE = 6  # 6 full layers; 18 GDN layers -> 3 groups of 6


def qwen35_plan(layout: StateLayout, *, max_model_len: int = 512, memory_gib: float = 1.0):  # type: ignore[no-untyped-def]
    entry = find("Qwen/Qwen3.5-0.8B")
    assert entry is not None
    spec = model_spec_from_config(entry.config, name=entry.hf_id)
    return plan(spec, PlannerOptions(memory_bytes=int(memory_gib * GIB), max_model_len=max_model_len,
                                     state_layout=layout))


def test_multi_page_state_spans_k_pages_of_the_attention_page() -> None:
    result = qwen35_plan(StateLayout.MULTI_PAGE)
    cfg = result.config
    # the block doubles from 16 until a state spans at most 32 pages: 16 -> 34 pages, 32 -> 17
    page = 32 * ATTN_PER_TOKEN  # 65,536
    k = math.ceil(STATE_BYTES / page)  # 17
    assert (cfg.page_size_bytes, cfg.pages_per_state, cfg.attention_block_size) == (page, k, 32)
    states = [g for g in cfg.groups if g.kind is SpecKind.MAMBA]
    assert len(states) == 3 * k
    assert [g.state_page for g in states] == list(range(k)) * 3
    assert [g.group_id for g in cfg.groups] == list(range(len(cfg.groups)))
    assert all(g.block_size == 32 and g.state_pages == k for g in states)
    # the k page groups of one state share its layers; tensors list each layer once
    assert len({g.layer_indices for g in states}) == 3
    assert sorted(x for t in cfg.tensors for x in t.shared_by) == list(range(24))
    num_blocks = GIB // page // GROUP_SIZE
    assert cfg.num_blocks == num_blocks
    need = 3 * k * 2 + 512 // 32  # align mode: 2 states per group (each k pages) + 16 attention blocks
    assert sum(result.blocks_per_request) == need
    assert result.max_concurrency == pytest.approx((num_blocks - 1) / need)
    assert cfg.shortest_cacheable_prefix == 32


def test_one_page_layout_is_unchanged_and_both_are_reported() -> None:
    result = qwen35_plan(StateLayout.ONE_PAGE)
    block = 16 * math.ceil(STATE_BYTES / (16 * ATTN_PER_TOKEN))  # B = A * ceil(M / (A * P1)) = 544
    assert result.config.attention_block_size == block == 544
    assert result.config.pages_per_state == 1
    one, multi = result.state_layouts
    assert (one.state_layout, multi.state_layout) == (StateLayout.ONE_PAGE, StateLayout.MULTI_PAGE)
    one_blocks = GIB // (block * ATTN_PER_TOKEN) // GROUP_SIZE
    assert one.max_concurrency == pytest.approx((one_blocks - 1) / (3 * 2 + 1))
    assert (one.shortest_cacheable_prefix, multi.shortest_cacheable_prefix) == (544, 32)
    assert multi == qwen35_plan(StateLayout.MULTI_PAGE).state_layouts[0]


def test_models_without_states_ignore_the_layout() -> None:
    spec = model_spec_from_config(find("google/gemma-3-27b-it").config, name="g")  # type: ignore[union-attr]
    options = PlannerOptions(memory_bytes=16 * GIB, max_model_len=4096)
    one = plan(spec, options)
    multi = plan(spec, dataclasses.replace(options, state_layout=StateLayout.MULTI_PAGE))
    assert one.config == multi.config and not multi.state_layouts


def test_bad_state_pages_are_clear_errors() -> None:
    attn = AttentionSpec(kind=SpecKind.FULL, num_kv_heads=1, head_dim=8, dtype="float32")
    with pytest.raises(ConfigError, match="only a state group spans several"):
        KVCacheGroupSpec(group_id=0, spec=attn, layer_indices=(0,), block_size=16, state_pages=2)
    with pytest.raises(ConfigError, match="state page 3 of 2"):
        KVCacheGroupSpec(group_id=0, spec=attn, layer_indices=(0,), block_size=16, state_page=3, state_pages=2)
    with pytest.raises(ConfigError, match="state_layout must be one of"):
        PlannerOptions(memory_bytes=GIB, max_model_len=16, state_layout="multi_page")  # type: ignore[arg-type]


def test_plan_cli_reports_both_layouts() -> None:
    out = CliRunner().invoke(app, ["plan", "Qwen/Qwen3.5-0.8B", "--memory-gib", "1", "--max-model-len", "512",
                                   "--state-layout", "multi_page", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["state_layout"] == "multi_page" and report["pages_per_state"] == 17
    assert [s["shortest_cacheable_prefix"] for s in report["state_layouts"]] == [32, 544]
    last = report["groups"][16]  # the last page of the first state: the state's remaining bytes
    assert (last["state_page"], last["page_bytes_used"]) == (16, STATE_BYTES - 16 * 65536)
    text = CliRunner().invoke(app, ["plan", "Qwen/Qwen3.5-0.8B", "--memory-gib", "1", "--max-model-len", "512"])
    assert "State layouts" in text.output and "17 x 65,536 B" in text.output


def test_plan_vllm_flags_refuse_the_multi_page_layout() -> None:
    out = CliRunner().invoke(app, ["plan", "Qwen/Qwen3.5-0.8B", "--state-layout", "multi_page", "--vllm"])
    assert out.exit_code == 2 and "--state-layout one_page" in out.output
