"""Record vLLM 0.32's resolution of `prefix_match_unit` for a set of KV cache layouts.

Run inside the vLLM manager venv (`benchmarks/vllm_manager_venv.sh` builds it):

    ~/.cache/hybridkv-bench/vllm-manager-venv/bin/python tests/plan/vllm_fixtures/generate_match_units.py \
        --out tests/plan/vllm_fixtures/match_units.json

Each case: groups as (kind, block size), the Mamba cache mode, prefix caching, the option; vLLM's
answer: (scheduler block, hash block, hit alignment) from `resolve_kv_cache_block_sizes` and
`resolve_cache_hit_alignment_tokens`, or the error it raises.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import vllm_manager as vm
from vllm.v1.core.kv_cache_utils import (
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)

CASES: list[dict[str, Any]] = [
    {"groups": [["full", 16]], "unit": None},
    {"groups": [["full", 16]], "unit": 16},
    {"groups": [["full", 16]], "unit": 8},
    {"groups": [["full", 16]], "unit": 8, "caching": False},
    {"groups": [["full", 16], ["sliding", 16]], "unit": None},
    {"groups": [["full", 16], ["sliding", 16]], "unit": 8},
    {"groups": [["full", 16], ["sliding", 16]], "unit": 5},
    {"groups": [["full", 544], ["mamba", 544]], "unit": None},
    {"groups": [["full", 544], ["mamba", 544]], "unit": 32},
    {"groups": [["full", 544], ["mamba", 544]], "unit": 48},
    {"groups": [["full", 544], ["mamba", 544]], "unit": 544},
    {"groups": [["full", 544], ["mamba", 544]], "unit": 32, "mode": "all"},
    {"groups": [["full", 544], ["mamba", 544]], "unit": 32, "caching": False},
    {"groups": [["full", 1024], ["sliding", 1024], ["mamba", 1024]], "unit": 32},
    {"groups": [["full", 32], ["sliding", 32], ["mamba", 1024]], "unit": 32},
    {"groups": [["full", 16], ["mamba", 64]], "unit": None},
    {"groups": [["full", 16], ["mamba", 64]], "unit": 8},
    {"groups": [["full", 16], ["sliding", 32]], "unit": None},
]


def _spec(kind: str, block: int, mode: str) -> Any:
    if kind == "full":
        return vm.full(block)
    if kind == "sliding":
        return vm.sliding(block, 4 * block)
    return vm.state(block, mode)


def _resolve(case: dict[str, Any]) -> dict[str, Any]:
    mode = case.get("mode", "align")
    caching = case.get("caching", True)
    cfg = vm.config([_spec(k, b, mode) for k, b in case["groups"]], num_blocks=64)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=case["groups"][0][1], prefix_match_unit=case["unit"],
                                     enable_prefix_caching=caching),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1), kv_transfer_config=None)
    try:
        scheduler, hashed = resolve_kv_cache_block_sizes(cfg, vllm_config)
    except ValueError as exc:
        return {"error": str(exc)}
    alignment = resolve_cache_hit_alignment_tokens(cfg, vllm_config, scheduler, hashed)
    return {"scheduler_block": scheduler, "hash_block": hashed, "hit_alignment": alignment}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    records = [{**case, "vllm": _resolve(case)} for case in CASES]
    out.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
