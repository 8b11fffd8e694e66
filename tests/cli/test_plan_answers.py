"""`hybridkv plan` answers that used to be wrong or silent, each checked against hand arithmetic."""

from __future__ import annotations

import copy
import io
import json
import math
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from hybridkv.catalog import catalog, find
from hybridkv.cli import app
from hybridkv.cli.plan_report import PlanRequest, layer_type_counts, make_plan, render_comparison, render_plan
from hybridkv.kvcache.manager import KVCacheManager
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, plan

runner = CliRunner()


def plan_json(*args: str) -> Any:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_layer_type_counts_count_each_decoder_layer_once() -> None:
    for entry in catalog():
        spec, _ = make_plan(PlanRequest(model=entry.hf_id))
        assert sum(layer_type_counts(spec).values()) == spec.num_decoder_layers, entry.hf_id
    gemma3n, _ = make_plan(PlanRequest(model="gemma-3n-e4b"))
    # 35 layers, the last 15 read earlier layers' KV (12 sliding, 3 full); 4 of every 5 slide.
    assert layer_type_counts(gemma3n) == {"sliding_window": 16, "full": 4, "sliding_window, KV shared (no memory)": 12,
                                          "full, KV shared (no memory)": 3}


def test_layers_with_two_caches_are_named_by_their_real_index() -> None:
    report = plan_json("falcon-h1-7b")
    names = {g["kind"]: g["layer_names"] for g in report["groups"]}
    assert names == {"full": [f"{i}.attn" for i in range(44)], "mamba": [f"{i}.mamba" for i in range(44)]}
    assert report["tensors"][3]["shared_by_names"] == ["3.attn", "3.mamba"]
    table = runner.invoke(app, ["plan", "falcon-h1-7b"]).output
    assert "0-43.attn" in table and "0-43.mamba" in table and "87" not in table


def test_no_model_loses_capacity_to_the_hybrid_layout() -> None:
    for entry in catalog():
        for length in (4096, None):  # None: the model's limit, at most 32768
            _, result = make_plan(PlanRequest(model=entry.hf_id, max_model_len=length))
            if result.uniform.num_blocks:
                assert result.capacity_ratio >= 1, (entry.hf_id, length, result.capacity_ratio)
    ministral = plan_json("ministral-8b", "--max-model-len", "32768")  # window 32768 = max_model_len
    assert [g["kind"] for g in ministral["groups"]] == ["full"]
    assert ministral["capacity_ratio"] == 1.0 and "full attention at this length" in ministral["notes"][0]
    shorter = plan_json("ministral-8b", "--max-model-len", "8192")
    assert [g["kind"] for g in shorter["groups"]] == ["full"]


@pytest.mark.parametrize("chunk", [24, 40])
def test_llama4_chunk_not_a_multiple_of_16_gets_a_block_that_divides_it(chunk: int) -> None:
    config = copy.deepcopy(find("llama-4-scout").config)  # type: ignore[union-attr]
    config["text_config"]["attention_chunk_size"] = chunk
    result = plan(model_spec_from_config(config, name="scout"), PlannerOptions(memory_bytes=GIB, max_model_len=8192))
    assert {g.block_size for g in result.config.groups} == {math.gcd(16, chunk)} == {8}
    assert result.notes == (f"block size 8 instead of 16: a local-attention chunk of {chunk} tokens must be a "
                            "whole number of blocks",)
    KVCacheManager(result.config, max_model_len=8192)  # the chunked manager accepts the layout


def test_a_budget_below_one_request_is_not_runnable_for_either_layout() -> None:
    report = plan_json("gemma-4-31b")  # 16 GiB, 32768 tokens: uniform holds 0.58 requests
    uniform = report["uniform"]
    assert uniform["max_concurrency"] == pytest.approx(0.58, abs=0.01) and uniform["runnable"] is False
    assert uniform["reason"].startswith("the 16.00 GiB budget holds 0.58 of one 32768-token request")
    assert report["runnable"] is True and report["reason"] is None
    short = runner.invoke(app, ["plan", "gemma-3-27b", "--memory-gib", "0.1", "--json"])
    assert short.exit_code == 1  # a script can test it: the budget holds no request (docs/plan_cli.md)
    assert "note: the budget holds no request of max_model_len tokens for google/gemma-3-27b-it" in short.stderr
    tiny = json.loads(short.stdout)
    assert tiny["runnable"] is False and tiny["max_concurrency"] < 1
    assert tiny["reason"].startswith("the 0.10 GiB budget holds") and tiny["uniform"]["reason"].startswith("the 0.10")
    table = runner.invoke(app, ["plan", "gemma-3-27b", "--memory-gib", "0.1"])
    assert table.exit_code == 1
    assert "(< 1 request)" in table.stdout and "hybrid: the 0.10 GiB budget holds" in " ".join(table.stdout.split())
    assert runner.invoke(app, ["plan", "gemma-3-27b", "gemma-4-31b"]).exit_code == 0  # every model holds one


def test_comparison_shows_each_rows_own_length_and_never_cuts_an_id() -> None:
    plans = [make_plan(PlanRequest(model=m)) for m in ("llama-4-scout", "gemma-2-27b", "qwen3-next-80b")]
    for width in (80, 200):
        out = io.StringIO()
        console = Console(file=out, width=width)
        render_comparison(console, plans)
        render_plan(console, *plans[0])
        text = out.getvalue()
        assert "…" not in text and "..." not in text
    lines = runner.invoke(app, ["plan", "llama-4-scout", "gemma-2-27b"]).output.splitlines()  # piped: full width
    row = next(line for line in lines if "meta-llama/Llama-4-Scout-17B-16E-Instruct" in line)
    assert row.split()[1] == "32768"
    assert next(line for line in lines if "google/gemma-2-27b-it" in line).split()[1] == "8192"
