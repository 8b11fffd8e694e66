"""`hybridkv run --json` end to end, in a subprocess, on the embedded default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    env = dict(os.environ, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="120")
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "run", "--json", *args],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.slow
def test_builtin_chat_report(tmp_path: Path) -> None:
    from hybridkv.scheduling.workload import builtin_chat

    report = _run(tmp_path, "--max-tokens", "8")
    assert report["requests"] == len(builtin_chat())
    assert report["generated_tokens"] <= 8 * report["requests"]
    assert report["prompt_tokens"] > 0 and report["generated_tok_per_s"] > 0 and report["mean_ttft_s"] > 0
    cache, kv = report["prefix_cache"], report["kv_memory"]
    assert cache["enabled"] and cache["hit_rate"] > 0.3  # later turns and the shared system prompt hit
    assert {g["kind"] for g in cache["groups"]} == {"sliding_window", "full"}
    assert all(g["hit_rate"] > 0 for g in cache["groups"])
    assert kv["allocated_bytes"] == kv["planned_bytes"]
    assert 0 < kv["peak_used_bytes"] < kv["uniform_layout_bytes_for_same_tokens"]
    # Shared system prompt and extended turns: sharing saves; 5 of 6 layers slide: the layout saves too.
    assert kv["peak_used_bytes"] < kv["peak_unshared_bytes"] < kv["uniform_layout_bytes_for_same_tokens"]
    assert kv["prefix_sharing_saving"] == round(1 - kv["peak_used_bytes"] / kv["peak_unshared_bytes"], 4)
    assert cache["hit_tokens"] < cache["prompt_tokens"] == report["prompt_tokens"]
    assert cache["repeated_lookups"]["preemptions"] == report["preemptions"] == 0
    assert "meaningless" in report["note"]


@pytest.mark.slow
def test_jsonl_workload_and_prefix_caching_off(tmp_path: Path) -> None:
    lines = [{"session": "a", "prompt": "Hello there"}, {"session": "a", "prompt": " and again"},
             {"prompt_token_ids": [2, 70, 71, 72], "max_tokens": 3}]
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    report = _run(tmp_path, "--workload", str(workload), "--prefix-caching", "off", "--max-tokens", "4")
    assert report["requests"] == 3 and report["rounds"] == 2
    assert report["prefix_cache"]["hit_tokens"] == 0 and not report["prefix_cache"]["enabled"]


def test_bad_option_exits_with_a_clear_error(tmp_path: Path) -> None:
    env = dict(os.environ, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "run", "--max-num-seqs", "0"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--max-num-seqs must be a positive integer, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_gated_deltanet_model_in_both_mamba_cache_modes(tmp_path: Path) -> None:
    """`--model` runs a Qwen3.5 checkpoint; later turns of a session hit in every group, state included."""
    import torch
    import transformers

    from tests.engine.conftest import COMMON, GATED_DELTANET

    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**COMMON, **GATED_DELTANET, architectures=["Qwen3_5ForCausalLM"])
    model_dir = tmp_path / "qwen3_5"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    lines = [{"session": "a", "prompt_token_ids": list(range(3, 60))}, {"session": "a", "prompt_token_ids": [7, 8, 9]}]
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in lines))
    for mode in ("align", "all"):
        report = _run(tmp_path, "--model", str(model_dir), "--workload", str(workload), "--mamba-cache-mode", mode,
                      "--max-tokens", "4", "--max-model-len", "256", "--kv-cache-memory-gib", "0.01")
        assert report["config"]["mamba_cache_mode"] == mode
        groups = report["prefix_cache"]["groups"]
        assert {g["kind"] for g in groups} == {"mamba", "full"}
        assert all(g["hit_rate"] > 0 for g in groups), groups
        assert report["kv_memory"]["allocated_bytes"] == report["kv_memory"]["planned_bytes"]
    plan = subprocess.run([sys.executable, "-m", "hybridkv.cli", "plan", str(model_dir), "--json", "--memory-gib",
                           "0.01", "--max-model-len", "256"], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(plan.stdout)["total_bytes"] == report["kv_memory"]["allocated_bytes"]  # plan and engine agree


@pytest.mark.slow
def test_notes_and_errors_name_the_workload_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model dir without tokenizer.json, a max_tokens over the length limit, a prompt over it."""
    import shutil

    from hybridkv.engine.default_model import ensure_default_model

    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "my-model"
    shutil.copytree(ensure_default_model(), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a model directory that ships no tokenizer
        (model / name).unlink()
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Hi", "max_tokens": 100000}) + "\n")
    args = ["run", "--json", "--model", str(model), "--workload", str(workload), "--max-model-len", "64"]
    proc = subprocess.run([sys.executable, "-m", "hybridkv", *args], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="200"), timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("has no tokenizer.json: text prompts use the byte-level tokenizer") == 1
    assert ("1 request(s) asked for more tokens than --max-model-len 64 holds, so generation stopped at that "
            "length (first: workload line 1: 3 prompt + 100000 max_tokens)") in proc.stderr
    report = json.loads(proc.stdout)
    assert report["max_tokens_capped_requests"] == 1 and report["prompt_tokens"] == 3  # bos + "H" + "i"
    assert report["generated_tokens"] <= 64 - 3
    workload.write_text("# two requests\n" + json.dumps({"prompt": "Hi"}) + "\n"
                        + json.dumps({"prompt_token_ids": [5] * 100}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "hybridkv", *args], capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="200"), timeout=240, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "workload line 3 has 100 tokens; expected at most --max-model-len 64" in proc.stderr


@pytest.mark.slow
def test_preemption_and_one_attention_type_report_honest_figures(tmp_path: Path) -> None:
    """Hit rate over prompt tokens even when requests are looked up again; no layout saving without sliding layers."""
    import shutil

    from hybridkv.engine.default_model import ensure_default_model

    squeezed = _run(tmp_path, "--kv-cache-memory-gib", "0.0012", "--max-tokens", "8")
    cache = squeezed["prefix_cache"]
    assert squeezed["preemptions"] >= 1 and cache["repeated_lookups"]["lookups"] > 0
    assert cache["hit_tokens"] <= cache["prompt_tokens"] == squeezed["prompt_tokens"]
    assert cache["hit_rate"] == round(cache["hit_tokens"] / cache["prompt_tokens"], 4)
    os.environ["HYBRIDKV_CACHE_DIR"] = str(tmp_path / "cache")
    try:
        source = ensure_default_model()
    finally:
        del os.environ["HYBRIDKV_CACHE_DIR"]
    full_only = tmp_path / "full-only"
    shutil.copytree(source, full_only)
    config = json.loads((full_only / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]  # same weights, one attention type
    (full_only / "config.json").write_text(json.dumps(config))
    kv = _run(tmp_path, "--model", str(full_only), "--max-tokens", "8")["kv_memory"]
    assert abs(kv["layout_saving"]) < 0.02, kv  # the hybrid layout of a one-type model is the uniform layout
    assert kv["prefix_sharing_saving"] > 0.3, kv  # the shared system prompt is what saves memory here
    assert kv["capacity_ratio"] == 1.0
