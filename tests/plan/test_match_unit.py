"""`prefix_match_unit` resolved as vLLM 0.32 resolves it, layout by layout.

- `test_resolution_equals_vllm_recorded`: against vLLM's own answers, recorded by
  `vllm_fixtures/generate_match_units.py` (vLLM's `resolve_kv_cache_block_sizes` and
  `resolve_cache_hit_alignment_tokens`), errors included.
- `test_resolution_equals_vllm_live`: the generator run now, where the vLLM manager venv exists.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hybridkv.errors import ConfigError
from hybridkv.plan.match_unit import MatchUnit, check_prefix_match_unit, resolve_match_unit
from hybridkv.plan.specs import MambaCacheMode
from tests.factories import make_config, make_group

FIXTURES = Path(__file__).parent / "vllm_fixtures"
RECORDED = FIXTURES / "match_units.json"
VENV = Path(os.environ.get("HYBRIDKV_VLLM_VENV", Path.home() / ".cache/hybridkv-bench/vllm-manager-venv"))
KINDS = {"full": "full", "sliding": "sliding_window", "mamba": "mamba"}


def _ours(case: dict[str, Any]) -> dict[str, Any]:
    groups = [make_group(kind=KINDS[k], block_size=b, window_tokens=4 * b if k == "sliding" else 0)
              for k, b in case["groups"]]
    config = make_config(groups=groups)
    try:
        unit = resolve_match_unit(config.groups, case["unit"], caching=case.get("caching", True),
                                  mamba_cache_mode=MambaCacheMode(case.get("mode", "align")))
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"scheduler_block": unit.scheduler_block_tokens, "hash_block": unit.hash_unit_tokens,
            "hit_alignment": unit.hit_alignment_tokens}


def _check(records: list[dict[str, Any]]) -> None:
    for record in records:
        ours, theirs = _ours(record), record["vllm"]
        if "error" in theirs:
            assert "error" in ours, (record, ours)
            assert f"prefix_match_unit={record['unit']}" in ours["error"]
        else:
            assert ours == theirs, record


def test_resolution_equals_vllm_recorded() -> None:
    records = json.loads(RECORDED.read_text(encoding="utf-8"))
    assert len(records) >= 15
    _check(records)


@pytest.mark.slow
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                    reason="the vLLM manager venv is not built (bash benchmarks/vllm_manager_venv.sh)")
def test_resolution_equals_vllm_live(tmp_path: Path) -> None:
    out = tmp_path / "units.json"
    subprocess.run([str(VENV / "bin" / "python"), str(FIXTURES / "generate_match_units.py"), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    _check(json.loads(out.read_text(encoding="utf-8")))


def test_partial_hits_only_with_an_align_state_group_and_fine_grained_peers() -> None:
    # hand-derived from the rule: a 1,024-token state block, 32-token unit, full attention beside it
    groups = make_config(groups=[make_group(kind="full", block_size=1024),
                                 make_group(kind="mamba", block_size=1024)]).groups
    unit = resolve_match_unit(groups, 32, caching=True, mamba_cache_mode=MambaCacheMode.ALIGN)
    assert unit == MatchUnit(scheduler_block_tokens=1024, hash_unit_tokens=32, hit_alignment_tokens=32,
                             partial_hits=True)
    swa = make_config(groups=[make_group(kind="full", block_size=1024),
                              make_group(kind="sliding_window", block_size=1024, window_tokens=4096),
                              make_group(kind="mamba", block_size=1024)]).groups
    assert not resolve_match_unit(swa, 32, caching=True, mamba_cache_mode=MambaCacheMode.ALIGN).partial_hits


@pytest.mark.parametrize("value", [0, -32, 1.5, True, "32"])
def test_bad_option_values_are_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="prefix_match_unit must be None or a positive integer"):
        check_prefix_match_unit(value)
