"""`hybridkv plan`'s caching options: prefix_match_unit checked against the planned block sizes,
the hit granularity reported (vLLM 0.32's rule, tests/plan/test_match_unit.py), the options passed
on in `--vllm`'s flags."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()


def test_json_reports_the_hit_granularity_and_vllm_flags() -> None:
    result = runner.invoke(app, ["plan", "qwen3.5-0.8b", "--prefix-match-unit", "32",
                                 "--prefix-cache-retention-interval", "0", "--vllm", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    # Qwen3.5: full attention + Gated DeltaNet in align mode, unified 544-token block: 32 divides it
    # and both kinds look up inside a block, so hits land every 32 tokens
    assert report["prefix_caching"] == {"prefix_match_unit": 32, "hash_unit_tokens": 32,
                                        "hit_granularity_tokens": 32, "sub_block_hits": True,
                                        "prefix_cache_retention_interval": 0, "mamba_cache_mode": "align"}
    flags = report["vllm"]["vllm_flags"]
    assert flags[flags.index("--prefix-match-unit") + 1] == "32"
    assert flags[flags.index("--prefix-cache-retention-interval") + 1] == "0"


def test_sliding_window_keeps_hits_on_the_block() -> None:
    result = runner.invoke(app, ["plan", "gemma-3-27b", "--prefix-match-unit", "8", "--json"])
    assert result.exit_code == 0, result.output
    caching = json.loads(result.output)["prefix_caching"]
    assert (caching["hash_unit_tokens"], caching["hit_granularity_tokens"], caching["sub_block_hits"]) == (8, 16, False)


def test_mamba_cache_mode_all_reaches_the_vllm_flags() -> None:
    result = runner.invoke(app, ["plan", "qwen3.5-0.8b", "--mamba-cache-mode", "all", "--vllm", "--json"])
    flags = json.loads(result.output)["vllm"]["vllm_flags"]
    assert flags[flags.index("--mamba-cache-mode") + 1] == "all"


def test_a_unit_that_does_not_divide_the_blocks_is_refused() -> None:
    result = runner.invoke(app, ["plan", "qwen3.5-0.8b", "--prefix-match-unit", "48"])
    assert result.exit_code == 2
    assert "prefix_match_unit=48 is invalid" in result.output and "[544, 544, 544, 544]" in result.output
    table = runner.invoke(app, ["plan", "qwen3.5-0.8b", "--prefix-match-unit", "32"])
    assert "hits every 32 tokens (sub-block hits" in table.output
