"""`hybridkv plan`: resolve a model, run the planner, and show the result as tables or JSON.

A MODEL argument is a catalog name (hf id or alias), a config.json path or a HF model directory.
The JSON shape is documented in the README ("Planning a real model"); keep the two in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hybridkv.catalog import catalog, find
from hybridkv.core.errors import ConfigError
from hybridkv.core.model_specs import SpecOptions, load_config, model_spec_from_config
from hybridkv.core.planner import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    KVCacheGroupSpec,
    Plan,
    PlannerOptions,
    memory_gib_to_bytes,
    plan,
    resolve_max_model_len,
)
from hybridkv.core.specs import AttentionSpec, IndexerSpec, LayerSpec, MLASpec, ModelSpec

DEFAULT_MAX_MODEL_LEN = 32768


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRequest:
    """Everything `hybridkv plan` was asked, before the model's own limits are applied."""

    model: str
    memory_gib: float = 16.0
    max_model_len: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    mamba_alignment: int = 16
    spec_options: SpecOptions = field(default_factory=SpecOptions)

    def __post_init__(self) -> None:
        memory_gib_to_bytes(self.memory_gib, option="--memory-gib")


def resolve_model(name: str) -> tuple[str, dict[str, Any]]:
    """(display name, config dict) for a catalog name, a config.json path or a model directory."""
    entry = find(name)
    if entry is not None:
        return entry.hf_id, entry.config
    path = Path(name)
    if path.exists():
        return (path.parent.name if path.is_file() else path.name) or name, load_config(path)
    known = ", ".join(sorted(a for e in catalog() for a in e.aliases))
    raise ConfigError(
        f"model {name!r} is neither a catalog name nor an existing config.json path or model directory; "
        f"catalog names: {known} (see `hybridkv plan --list`)"
    )


def make_plan(request: PlanRequest) -> tuple[ModelSpec, Plan]:
    """Read the model's specs and plan it under the requested budget."""
    name, config = resolve_model(request.model)
    spec = model_spec_from_config(config, name=name, options=request.spec_options)
    max_len = resolve_max_model_len(request.max_model_len, model=spec.name, model_limit=spec.max_position_embeddings,
                                    default_cap=DEFAULT_MAX_MODEL_LEN)
    options = PlannerOptions(
        memory_bytes=memory_gib_to_bytes(request.memory_gib, option="--memory-gib"), max_model_len=max_len,
        max_num_batched_tokens=request.max_num_batched_tokens, block_size=request.block_size,
        mamba_alignment=request.mamba_alignment,
    )
    return spec, plan(spec, options)


def cache_name(spec: LayerSpec) -> str:
    """What one cache slot holds: `kv` (K and V), `mla` (latent), `indexer` (keys only) or `state`."""
    if isinstance(spec, AttentionSpec):
        return "kv"
    if isinstance(spec, MLASpec):
        return "mla" if spec.cache_format.value == "native" else f"mla ({spec.cache_format.value})"
    return "indexer" if isinstance(spec, IndexerSpec) else "state"


def layer_pages(spec: ModelSpec, group: KVCacheGroupSpec) -> list[dict[str, Any]]:
    """Per cache slot of `group`: its decoder layer, what it caches and its (unpadded) page bytes."""
    return [
        {"layer": layer, "decoder_layer": spec.decoder_layer_of.get(layer, layer),
         "cache": cache_name(group.spec_of(layer)), "page_bytes": page}
        for layer, page in zip(group.layer_indices, group.layer_page_bytes(), strict=True)
    ]


def _page_summary(spec: ModelSpec, group: KVCacheGroupSpec) -> str:
    """`61 x mla 73,728 + 61 x indexer 8,448` for a group's pages."""
    counts: dict[tuple[str, int], int] = {}
    for entry in layer_pages(spec, group):
        key = (entry["cache"], entry["page_bytes"])
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{n} x {name} {page:,}" for (name, page), n in counts.items())


def plan_to_json(spec: ModelSpec, result: Plan) -> dict[str, Any]:
    """The documented JSON report of one plan."""
    cfg = result.config
    uniform = result.uniform
    return {
        "model": spec.name,
        "model_type": spec.model_type,
        "num_layers": spec.num_decoder_layers,
        "num_cache_slots": spec.num_layers,
        "extra_state_slots": {str(slot): layer for slot, layer in sorted(spec.decoder_layer_of.items())},
        "memory_bytes": result.options.memory_bytes,
        "max_model_len": result.options.max_model_len,
        "max_num_batched_tokens": result.options.max_num_batched_tokens,
        "attention_block_size": cfg.attention_block_size,
        "page_size_bytes": cfg.page_size_bytes,
        "num_blocks": cfg.num_blocks,
        "group_size": cfg.group_size,
        "groups": [
            {
                "group_id": g.group_id, "kind": g.kind.value, "layers": list(g.layer_indices),
                "block_size": g.block_size, "window_tokens": g.window_tokens or None,
                "chunk_tokens": g.chunk_tokens or None, "padding_layers": g.padding_layers,
                "page_bytes_used": sum(g.layer_page_bytes()) if g.mixed_pages else g.spec.page_size_bytes(g.block_size),
                "blocks_per_request": need, "mixed_pages": g.mixed_pages, "layer_pages": layer_pages(spec, g),
            }
            for g, need in zip(cfg.groups, result.blocks_per_request, strict=True)
        ],
        "tensors": [{"size_bytes": t.size_bytes, "shared_by": list(t.shared_by)} for t in cfg.tensors],
        "kv_shared_layers": {str(k): v for k, v in sorted(cfg.kv_shared_from.items())},
        "cacheless_layers": list(spec.cacheless_layers),
        "total_bytes": cfg.total_bytes,
        "padding_waste_bytes": result.padding_waste_bytes,
        "max_concurrency": round(result.max_concurrency, 4),
        "kv_capacity_tokens": result.kv_capacity_tokens,
        "bytes_per_request": result.bytes_per_request,
        "uniform": {
            "runnable": uniform.runnable, "block_size": uniform.block_size, "num_blocks": uniform.num_blocks,
            "max_concurrency": round(uniform.max_concurrency, 4),
            "kv_capacity_tokens": uniform.kv_capacity_tokens, "bytes_per_request": uniform.bytes_per_request,
            "reason": uniform.reason,
        },
        "capacity_ratio": None if math.isinf(result.capacity_ratio) else round(result.capacity_ratio, 4),
        "recommended_chunk_size": result.recommended_chunk_size,
        "block_size_note": cfg.block_size_note or None,
    }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _ratio(result: Plan) -> str:
    return "-" if math.isinf(result.capacity_ratio) else f"{result.capacity_ratio:.2f}x"


def render_plan(console: Console, spec: ModelSpec, result: Plan) -> None:
    """Tables for one model: layers by type, groups, tensors, hybrid vs uniform capacity."""
    cfg = result.config
    kinds: dict[str, int] = {}
    for layer_spec in spec.layers:
        if layer_spec is None:
            key = "no cache"
        elif isinstance(layer_spec, MLASpec | IndexerSpec):
            key = f"{layer_spec.kind.value} ({cache_name(layer_spec)})"
        else:
            key = layer_spec.kind.value
        kinds[key] = kinds.get(key, 0) + 1
    layers = Table(title=f"{spec.name} ({spec.model_type}): {spec.num_decoder_layers} layers")
    layers.add_column("layer type")
    layers.add_column("layers", justify="right")
    for key, count in kinds.items():
        layers.add_row(key, str(count))
    if cfg.kv_shared_from:
        layers.add_row("KV shared (no memory)", str(len(cfg.kv_shared_from)))
    console.print(layers)

    mixed = [g for g in cfg.groups if g.mixed_pages]
    caption = "; ".join([*(f"group {g.group_id} block = {_page_summary(spec, g)} bytes" for g in mixed),
                         *([cfg.block_size_note] if cfg.block_size_note else [])])
    groups = Table(title=f"KV cache groups (page {cfg.page_size_bytes:,} bytes, {cfg.num_blocks:,} blocks)",
                   caption=caption or None)
    for col in ("group", "kind", "layers", "block size", "window/chunk", "padding", "blocks/request"):
        groups.add_column(col, justify="right" if col not in ("kind", "layers") else "left")
    for g, need in zip(cfg.groups, result.blocks_per_request, strict=True):
        extent = g.window_tokens or g.chunk_tokens
        groups.add_row(str(g.group_id), g.kind.value, _short(g.layer_indices), str(g.block_size),
                       str(extent) if extent else "-", str(g.padding_layers), str(need))
    console.print(groups)

    sizes = sorted({t.size_bytes for t in cfg.tensors})
    tensors = Table(title=f"KV cache tensors ({len(cfg.tensors)} x {' / '.join(_gib(n) for n in sizes)})")
    tensors.add_column("tensor", justify="right")
    tensors.add_column("size", justify="right")
    tensors.add_column("shared by layers")
    for i, t in enumerate(cfg.tensors):
        tensors.add_row(str(i), _gib(t.size_bytes), _short(t.shared_by))
    console.print(tensors)

    u = result.uniform
    cap = Table(
        title=f"Capacity at {_gib(result.options.memory_bytes)}, max_model_len {result.options.max_model_len}",
        caption=f"uniform: {u.reason}. Padding waste {_gib(result.padding_waste_bytes)}; "
                f"KV-server chunk size {result.recommended_chunk_size}.",
    )
    for col in ("layout", "block size", "max concurrency", "KV capacity (tokens)", "per request"):
        cap.add_column(col, justify="left" if col == "layout" else "right")
    cap.add_row("hybrid", str(cfg.attention_block_size), f"{result.max_concurrency:.2f}",
                f"{result.kv_capacity_tokens:,}", _gib(result.bytes_per_request))
    cap.add_row("uniform", str(u.block_size), f"{u.max_concurrency:.2f}" if u.runnable else "can't run",
                f"{u.kv_capacity_tokens:,}" if u.runnable else "-", _gib(u.bytes_per_request) if u.runnable else "-")
    cap.add_row("ratio", "", _ratio(result), "", "")
    console.print(cap)


def render_comparison(console: Console, plans: list[tuple[ModelSpec, Plan]]) -> None:
    """One row per model: the hybrid layout against the uniform one."""
    first = plans[0][1].options
    table = Table(title=f"Max concurrency, hybrid vs uniform layout ({_gib(first.memory_bytes)}, "
                        f"max_model_len <= {first.max_model_len})")
    cols = ("model", "layers", "groups", "block", "hybrid", "uniform", "ratio", "waste GiB")
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=col == "model")
    for spec, result in plans:
        u = result.uniform
        table.add_row(spec.name.split("/")[-1][:24], str(spec.num_decoder_layers), str(len(result.config.groups)),
                      str(result.config.attention_block_size), f"{result.max_concurrency:.2f}",
                      f"{u.max_concurrency:.2f}" if u.runnable else "can't run",
                      "-" if math.isinf(result.capacity_ratio) else f"{result.capacity_ratio:.2f}x",
                      f"{result.padding_waste_bytes / GIB:.2f}")
    console.print(table)


def render_catalog(console: Console) -> None:
    """The shipped catalog: names a user can pass as MODEL."""
    table = Table(title="Catalog (hybridkv plan NAME)")
    for col in ("hf id", "aliases", "model_type"):
        table.add_column(col)
    for entry in catalog():
        table.add_row(entry.hf_id, ", ".join(entry.aliases), str(entry.config.get("model_type", "?")))
    console.print(table)


def _short(layers: tuple[int, ...]) -> str:
    text = ",".join(map(str, layers))
    return text if len(text) <= 48 else text[:45] + "..."

