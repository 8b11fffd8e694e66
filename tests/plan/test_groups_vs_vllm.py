"""KV cache groups, block sizes and page sizes of every planned model type against vLLM 0.32's own code.

For each model type hybridkv reads that transformers 5.23 can configure, the config transformers writes
for it (`AutoConfig.for_model(t)`, bfloat16) is read into layer specs and planned (16 GiB, block 16,
`max_model_len` the model's limit capped at 32768). The same specs (after the planner's own promotion
of windows longer than `max_model_len`) go through vLLM's `Platform._align_hybrid_block_size` (state
hybrids) and `get_kv_cache_groups` (`vllm_fixtures/generate_vllm_groups.py`). Each group's layers,
block size and page size must be equal.

- `test_groups_equal_vllms_recorded_groups`: against `vllm_fixtures/vllm_groups.json`, recorded by that
  generator with vLLM's code; the recorded input specs (a digest) must be today's (else: regenerate). Runs
  everywhere.
- `test_groups_equal_vllm_live`: runs the generator now where the vLLM manager venv exists
  (`benchmarks/vllm_manager_venv.sh` builds it:
  `~/.cache/hybridkv-bench/vllm-manager-venv` or `$HYBRIDKV_VLLM_VENV`); skipped otherwise.

Regenerate the fixture: `python -m tests.plan.test_groups_vs_vllm` (needs that venv).

Not compared here (their own tests pin them against vLLM's figures): sparse-attention layouts whose
kernels force the block size and mix indexer pages (deepseek_v32, glm_moe_dsa, hy_v4, minimax_m3_vl), and
DeepSeek-V4's packed layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from hybridkv.plan.kv_cache_config import PlannerOptions  # noqa: E402
from hybridkv.plan.model_specs import model_spec_from_config, supported_model_types  # noqa: E402
from hybridkv.plan.planner import build_kv_cache_config, effective_request  # noqa: E402
from hybridkv.plan.specs import AttentionSpec, LayerSpec, MambaSpec, MLASpec, ModelSpec, SpecKind  # noqa: E402
from hybridkv.plan.vllm_flags import VllmVersion, vllm_mamba_alignment  # noqa: E402

HERE = Path(__file__).parent
FIXTURE = HERE / "vllm_fixtures" / "vllm_groups.json"
GENERATOR = HERE / "vllm_fixtures" / "generate_vllm_groups.py"
VENV = Path(os.environ.get("HYBRIDKV_VLLM_VENV", Path.home() / ".cache/hybridkv-bench/vllm-manager-venv"))
VENV_034 = Path(os.environ.get("HYBRIDKV_VLLM034_VENV", Path.home() / ".cache/hybridkv-bench/vllm034-venv"))
GIB = 1 << 30
# Compared elsewhere (see the module docstring); kimi_k2 is deepseek_v3 to transformers.
NOT_COMPARED = {"deepseek_v32", "glm_moe_dsa", "hy_v4", "minimax_m3_vl", "minimax_m3_vl_text", "deepseek_v4", "kimi_k2"}
_KINDS = {SpecKind.FULL: "full", SpecKind.SLIDING_WINDOW: "sliding", SpecKind.CHUNKED_LOCAL: "chunked"}


def compared_types() -> list[str]:
    return [t for t in supported_model_types() if t not in NOT_COMPARED]


# Fields a default config lacks that the model cannot be built without (transformers' Lfm2MoeConfig has no
# layer list by default); taken from the LFM2-8B-A1B checkpoint.
_COMPLETED = {"lfm2_moe": {"full_attn_idxs": [2, 6, 10, 14, 18, 21]}}


def default_config(model_type: str) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config: dict[str, Any] = transformers.AutoConfig.for_model(model_type).to_dict()
    return {**config, **_COMPLETED.get(model_type, {}), "dtype": "bfloat16"}


def spec_json(spec: LayerSpec) -> dict[str, Any]:
    if isinstance(spec, AttentionSpec):
        return {"type": _KINDS[spec.kind], "num_kv_heads": spec.num_kv_heads, "head_size": spec.head_dim,
                "head_size_v": spec.value_head_dim or spec.head_dim, "dtype": spec.dtype,
                "window": spec.window_tokens, "chunk": spec.chunk_tokens}
    if isinstance(spec, MLASpec):
        return {"type": "mla", "head_size": spec.head_dim, "dtype": spec.dtype}
    assert isinstance(spec, MambaSpec), spec
    return {"type": "mamba", "shapes": [list(s) for s in spec.shapes], "dtypes": list(spec.dtypes)}


def planned(model_type: str, *, block_size: int = 16) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the case given to vLLM, our groups in the generator's output form), planned with vLLM's
    `block_size` and its alignment (`plan --vllm-version`: 16 for 0.32, 64 for 0.34)."""
    model: ModelSpec = model_spec_from_config(default_config(model_type), name=model_type)
    options = PlannerOptions(memory_bytes=16 * GIB, max_model_len=min(model.max_position_embeddings, 32768),
                             block_size=block_size, mamba_alignment=vllm_mamba_alignment(block_size))
    model, options, _ = effective_request(model, options)
    config = build_kv_cache_config(model, options)
    case = {"block_size": options.block_size,
            "layers": {f"layers.{i}": spec_json(spec) for i, spec in model.owned_layers()}}
    groups = [{"layers": [f"layers.{i}" for i in g.layer_indices], "block_size": g.block_size,
               "page_size_bytes": config.page_size_bytes} for g in config.groups]
    return case, groups


def digest(case: dict[str, Any]) -> str:
    """A short fingerprint of the specs a fixture entry was recorded for."""
    return hashlib.sha256(json.dumps(case, sort_keys=True).encode()).hexdigest()[:16]


def _comparable(groups: list[dict[str, Any]]) -> list[tuple[tuple[str, ...], int, int]]:
    return sorted((tuple(g["layers"]), g["block_size"], g["page_size_bytes"]) for g in groups)


def assert_equal(model_type: str, ours: list[dict[str, Any]], vllm: list[dict[str, Any]]) -> None:
    assert _comparable(ours) == _comparable(vllm), (
        f"{model_type}: ours {_comparable(ours)[:4]}... vLLM {_comparable(vllm)[:4]}...")


def run_generator(cases: dict[str, Any], venv: Path = VENV) -> dict[str, list[dict[str, Any]]]:
    done = subprocess.run([str(venv / "bin" / "python"), str(GENERATOR)], input=json.dumps(cases), text=True,
                          capture_output=True, timeout=600, check=False, cwd=HERE)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, list[dict[str, Any]]] = json.loads(done.stdout)
    return result


@functools.cache
def _recorded() -> dict[str, Any]:
    recorded: dict[str, Any] = json.loads(FIXTURE.read_text())
    return recorded


@pytest.mark.parametrize("model_type", compared_types())
def test_groups_equal_vllms_recorded_groups(model_type: str) -> None:
    recorded = _recorded()
    assert model_type in recorded["vllm"], f"{model_type} has no recorded vLLM groups: regenerate {FIXTURE.name}"
    case, ours = planned(model_type)
    assert recorded["cases"][model_type] == digest(case), f"{model_type}'s specs changed since recording: regenerate"
    assert_equal(model_type, ours, recorded["vllm"][model_type])


@pytest.mark.slow
@pytest.mark.skipif(not (VENV / "bin" / "python").exists(),
                    reason="the vLLM manager venv is not built (bash benchmarks/vllm_manager_venv.sh)")
def test_groups_equal_vllm_live() -> None:
    cases, ours = {}, {}
    for model_type in compared_types():
        cases[model_type], ours[model_type] = planned(model_type)
    vllm = run_generator(cases)
    for model_type in cases:
        assert_equal(model_type, ours[model_type], vllm[model_type])


@pytest.mark.slow
@pytest.mark.skipif(not (VENV_034 / "bin" / "python").exists(),
                    reason="the vLLM 0.34 venv is not built (bash benchmarks/vllm034_venv.sh)")
def test_groups_equal_vllm_034_live_with_its_default_block_size() -> None:
    """`plan --vllm-version 0.34`: vLLM 0.34's default block size (64) and its sizing code
    (`kv_cache_planning.get_kv_cache_groups`, `_align_hybrid_block_size`) give the planner's groups."""
    block_size = VllmVersion.V0_34.default_block_size
    cases, ours = {}, {}
    for model_type in compared_types():
        cases[model_type], ours[model_type] = planned(model_type, block_size=block_size)
    vllm = run_generator(cases, VENV_034)
    for model_type in cases:
        assert_equal(model_type, ours[model_type], vllm[model_type])


def main() -> None:
    cases = {model_type: planned(model_type)[0] for model_type in compared_types()}
    vllm = run_generator(cases)

    def section(values: dict[str, Any]) -> str:  # one model type per line: small, readable diffs
        return ",\n".join(f" {json.dumps(key)}: {json.dumps(values[key], separators=(',', ':'))}"
                           for key in sorted(values))

    digests = {model_type: digest(case) for model_type, case in cases.items()}
    FIXTURE.write_text(f'{{"cases": {{\n{section(digests)}\n}},\n"vllm": {{\n{section(vllm)}\n}}}}\n')
    print(f"wrote {FIXTURE} ({len(cases)} model types)", file=sys.stderr)


if __name__ == "__main__":
    main()
