#!/usr/bin/env python
"""Record vLLM 0.32's own KV cache grouping, block sizes and page sizes for layer specs given as JSON.

Runs under the vLLM manager venv (vLLM's real code, no model, no GPU; `benchmarks/vllm_manager_venv.sh`):

    ~/.cache/hybridkv-bench/vllm-manager-venv/bin/python \\
        tests/plan/vllm_fixtures/generate_vllm_groups.py < specs.json > groups.json

Input (written by tests/plan/test_groups_vs_vllm.py from the specs hybridkv reads for each model
type): {case: {"block_size": B, "layers": {name: spec}}}, each spec one of

    {"type": "full" | "sliding" | "chunked", "num_kv_heads", "head_size", "head_size_v", "dtype", "window", "chunk"}
    {"type": "mla", "head_size", "dtype"}
    {"type": "mamba", "shapes", "dtypes"}

For a model with state layers next to attention, the attention block size and the padded state page
come from vLLM's `Platform._align_hybrid_block_size` on a FlashAttention-like backend (kernel blocks
`MultipleOf(16)`), with the model class's state shapes and dtypes replaced by the given ones. Then
every layer becomes vLLM's own spec class and `get_kv_cache_groups` groups them. Output: {case:
[{"layers": [...], "kind": spec class name, "block_size", "page_size_bytes"}, ...]} in vLLM's group
order. Nothing from hybridkv is imported.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.model_executor.models import ModelRegistry
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import MultipleOf

try:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
except ImportError:  # vLLM 0.34 moved the sizing code to kv_cache_planning
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # type: ignore[no-redef]
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.float8_e4m3fn}


class FlashAttentionLike:
    """The backend facts `_align_hybrid_block_size` reads (FlashAttention on CUDA: kernel blocks of 16k)."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [MultipleOf(16)]

    @staticmethod
    def customize_spec(spec: Any) -> Any:
        return spec


def new_vllm_config() -> VllmConfig:
    """A default `VllmConfig` with the hybrid KV cache manager (vLLM 0.34 infers a device at construction:
    none here, so CPU, where its defaults turn the hybrid manager off)."""
    try:
        return VllmConfig()
    except RuntimeError:
        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        return config


def aligned_cache_config(layers: dict[str, dict[str, Any]], block_size: int) -> CacheConfig:
    """vLLM's hybrid block-size alignment for a model with these layers (no-op without a state layer)."""
    cache = CacheConfig(block_size=block_size, mamba_cache_mode="align")
    states = [s for s in layers.values() if s["type"] == "mamba"]
    attention = [s for s in layers.values() if s["type"] != "mamba"]
    if not states or not attention:
        return cache
    first = attention[0]
    use_mla = first["type"] == "mla"
    model_config = SimpleNamespace(
        use_mla=use_mla, dtype=DTYPES[first["dtype"]], architecture="Stub",
        get_num_kv_heads=lambda _parallel: 1 if use_mla else first["num_kv_heads"],
        get_head_size=lambda: first["head_size"])
    state = max(states, key=lambda s: MambaSpec(shapes=tuple(map(tuple, s["shapes"])),
                                                  dtypes=tuple(DTYPES[d] for d in s["dtypes"]),
                                                  block_size=-1).page_size_bytes)

    class StubModel:
        @staticmethod
        def get_mamba_state_shape_from_config(_config: Any) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(shape) for shape in state["shapes"])

        @staticmethod
        def get_mamba_state_dtype_from_config(_config: Any) -> tuple[torch.dtype, ...]:
            return tuple(DTYPES[d] for d in state["dtypes"])

    vllm_config = new_vllm_config()
    object.__setattr__(vllm_config, "cache_config", cache)
    object.__setattr__(vllm_config, "model_config", model_config)
    saved = ModelRegistry.resolve_model_cls, Platform._find_non_ssm_backends
    ModelRegistry.resolve_model_cls = lambda *_a, **_k: (StubModel, "Stub")  # type: ignore[method-assign]
    Platform._find_non_ssm_backends = classmethod(lambda _cls, _config: [FlashAttentionLike])  # type: ignore[method-assign]
    try:
        Platform._align_hybrid_block_size(vllm_config, FlashAttentionLike)
    finally:
        ModelRegistry.resolve_model_cls, Platform._find_non_ssm_backends = saved
    return cache


def vllm_spec(spec: dict[str, Any], cache: CacheConfig) -> Any:
    kind, block = spec["type"], cache.block_size
    if kind == "mamba":
        return MambaSpec(shapes=tuple(map(tuple, spec["shapes"])), dtypes=tuple(DTYPES[d] for d in spec["dtypes"]),
                         block_size=cache.mamba_block_size or block, page_size_padded=cache.mamba_page_size_padded,
                         mamba_cache_mode="align")
    if kind == "mla":
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=spec["head_size"],
                                dtype=DTYPES[spec["dtype"]], cache_dtype_str="auto")
    common = {"block_size": block, "num_kv_heads": spec["num_kv_heads"], "head_size": spec["head_size"],
              "head_size_v": spec["head_size_v"], "dtype": DTYPES[spec["dtype"]]}
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=spec["window"])
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec["chunk"])
    return FullAttentionSpec(**common)


def groups_of(case: dict[str, Any]) -> list[dict[str, Any]]:
    cache = aligned_cache_config(case["layers"], case["block_size"])
    vllm_config = new_vllm_config()
    cache.kv_cache_layout = "LBHNC"  # the default, not block-outermost: no packed groups
    object.__setattr__(vllm_config, "cache_config", cache)
    specs = {name: vllm_spec(spec, cache) for name, spec in case["layers"].items()}
    return [{"layers": list(g.layer_names), "kind": type(g.kv_cache_spec).__name__,
             "block_size": g.kv_cache_spec.block_size, "page_size_bytes": g.kv_cache_spec.page_size_bytes}
            for g in get_kv_cache_groups(vllm_config, specs)]


def main() -> None:
    cases = json.load(sys.stdin)
    json.dump({name: groups_of(case) for name, case in sorted(cases.items())}, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
