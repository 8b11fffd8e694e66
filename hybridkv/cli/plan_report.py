"""`hybridkv plan`: resolve a model, run the planner, and show the result as tables or JSON.

A MODEL argument is a catalog name (hf id or alias), a config.json path or a HF model directory.
The JSON shape is documented in the README ("Planning a real model"); keep the two in step.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement

from hybridkv.catalog import catalog, find
from hybridkv.cli.tables import SHORT_LAYER_LIST, layer_list, new_table, print_table
from hybridkv.errors import ConfigError
from hybridkv.plan.model_specs import SpecOptions, load_config, model_spec_from_config
from hybridkv.plan.planner import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    KVCacheConfig,
    KVCacheGroupSpec,
    Plan,
    PlannerOptions,
    RunningState,
    StateLayout,
    StateLayoutSummary,
    memory_gib_to_bytes,
    plan,
    resolve_max_model_len,
)
from hybridkv.plan.specs import (
    AttentionSpec,
    CompressedMLASpec,
    IndexerSpec,
    LayerSpec,
    MambaCacheMode,
    MambaSpec,
    MambaType,
    MLASpec,
    ModelSpec,
    SpecKind,
)

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
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    state_layout: StateLayout = StateLayout.ONE_PAGE
    running_state: RunningState = RunningState.MOVING

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
    names = [n for e in catalog() for n in (e.hf_id, *e.aliases)]
    close = difflib.get_close_matches(name.lower(), {n.lower(): n for n in names}, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"model {name!r} is neither a catalog name nor an existing config.json path or model directory{hint} "
        "(`hybridkv plan --list` shows the catalog)"
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
        mamba_alignment=request.mamba_alignment, mamba_cache_mode=request.mamba_cache_mode,
        state_layout=request.state_layout, running_state=request.running_state,
    )
    return spec, plan(spec, options)


def cache_name(spec: LayerSpec) -> str:
    """What one cache slot holds: `kv` (K and V), `mla` (latent), `indexer` (keys only) or `state`;
    a DeepSeek-V4 cache is named by its role (`swa`, `compressed`, `compressor`, `indexer`, `indexer-compressor`)."""
    if isinstance(spec, AttentionSpec):
        return "kv"
    if isinstance(spec, CompressedMLASpec):
        return spec.role.value
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
    names = layer_names(spec)
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
        "page_layout": cfg.page_layout.value,
        "num_blocks": cfg.num_blocks,
        "group_size": cfg.group_size,
        "groups": [
            {
                "group_id": g.group_id, "kind": g.kind.value, "layers": list(g.layer_indices),
                "block_size": g.block_size, "window_tokens": g.window_tokens or None,
                "chunk_tokens": g.chunk_tokens or None, "padding_layers": g.padding_layers,
                "page_bytes_used": _page_bytes_used(cfg, g), "state_page": g.state_page, "state_pages": g.state_pages,
                "blocks_per_request": need, "mixed_pages": g.mixed_pages, "layer_pages": layer_pages(spec, g),
                "layer_names": [names[i] for i in g.layer_indices],
            }
            for g, need in zip(cfg.groups, result.blocks_per_request, strict=True)
        ],
        "tensors": [{"size_bytes": t.size_bytes, "shared_by": list(t.shared_by),
                     "shared_by_names": [names[i] for i in t.shared_by]} for t in cfg.tensors],
        "kv_shared_layers": {str(k): v for k, v in sorted(cfg.kv_shared_from.items())},
        "cacheless_layers": list(spec.cacheless_layers),
        "total_bytes": cfg.total_bytes,
        "padding_waste_bytes": result.padding_waste_bytes,
        "max_concurrency": round(result.max_concurrency, 4),
        "vllm_max_concurrency": round(result.vllm_max_concurrency, 4),
        "runnable": result.runnable,
        "reason": result.reason or None,
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
        "notes": list(result.notes),
        "state_layout": cfg.state_layout.value,
        "pages_per_state": cfg.pages_per_state,
        "running_state": result.options.running_state.value,
        "state_layouts": [_summary_json(s) for s in result.state_layouts],
    }


def _page_bytes_used(cfg: KVCacheConfig, g: KVCacheGroupSpec) -> int:
    """Bytes of the group's page that hold data (a multi-page state's last page holds the rest)."""
    if g.mixed_pages:
        return sum(g.layer_page_bytes())
    used = g.spec.page_size_bytes(g.block_size)
    if g.state_pages > 1:
        return min(cfg.page_size_bytes, used - g.state_page * cfg.page_size_bytes)
    return used


def _summary_json(summary: StateLayoutSummary) -> dict[str, Any]:
    return {"state_layout": summary.state_layout.value, "attention_block_size": summary.attention_block_size,
            "state_block_tokens": summary.state_block_tokens, "page_size_bytes": summary.page_size_bytes,
            "pages_per_state": summary.pages_per_state, "num_blocks": summary.num_blocks,
            "max_concurrency": round(summary.max_concurrency, 4), "bytes_per_request": summary.bytes_per_request,
            "shortest_cacheable_prefix": summary.shortest_cacheable_prefix}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _concurrency(value: float, runnable: bool) -> str:
    """One precision for every concurrency; below one request it says so."""
    return f"{value:.2f}" if runnable else f"{value:.2f} (< 1 request)"


def _short_concurrency(value: float, runnable: bool) -> str:
    return f"{value:.2f}" if runnable else f"{value:.2f} (<1)"


def _ratio(result: Plan) -> str:
    return "-" if math.isinf(result.capacity_ratio) else f"{result.capacity_ratio:.2f}x"


def _part(layer_spec: LayerSpec) -> str:
    if isinstance(layer_spec, AttentionSpec):
        return "attn"
    if isinstance(layer_spec, MLASpec | IndexerSpec | CompressedMLASpec):
        return cache_name(layer_spec).split(" ")[0]
    return "mamba"


def layer_names(spec: ModelSpec) -> dict[int, str]:
    """Cache slot -> the layer a user reads: `7`, or `7.attn` / `7.mamba` for a layer with two caches.

    A decoder layer with two caches (Falcon-H1, Zamba2 hybrid layers, sparse-attention indexers)
    keeps its first cache at slot = its index and the second in an extra slot after the decoder
    layers (`extra_state_slots` in the JSON); both are named by the decoder layer and the part.
    """
    two_caches = set(spec.decoder_layer_of.values())
    names: dict[int, str] = {}
    for slot, layer_spec in enumerate(spec.layers):
        layer = spec.decoder_layer_of.get(slot, slot)
        names[slot] = f"{layer}.{_part(layer_spec)}" if layer in two_caches and layer_spec else str(layer)
    return names


# state kinds beyond Mamba / Gated DeltaNet, named in the layer-type table (all hit by the Mamba rules)
_STATE_LABELS = {MambaType.SHORT_CONV: "short conv", MambaType.KDA: "KDA", MambaType.LIGHTNING: "lightning",
                 MambaType.RG_LRU: "RG-LRU"}


def _kind_label(layer_spec: LayerSpec) -> str:
    if isinstance(layer_spec, MLASpec | IndexerSpec | CompressedMLASpec):
        return f"{layer_spec.kind.value} ({cache_name(layer_spec)})"
    if isinstance(layer_spec, MambaSpec) and layer_spec.mamba_type in _STATE_LABELS:
        return f"{layer_spec.kind.value} ({_STATE_LABELS[layer_spec.mamba_type]})"
    return layer_spec.kind.value


def layer_type_counts(spec: ModelSpec) -> dict[str, int]:
    """Decoder layers by what they cache, each layer counted once (the counts sum to the layers)."""
    slots_of: dict[int, list[int]] = {}
    for slot, layer in spec.decoder_layer_of.items():
        slots_of.setdefault(layer, []).append(slot)
    counts: dict[str, int] = {}
    for layer in range(spec.num_decoder_layers):
        specs = [s for s in (spec.layers[i] for i in [layer, *slots_of.get(layer, [])]) if s is not None]
        if layer in spec.kv_shared_from:
            key = f"{' + '.join(map(_kind_label, specs))}, KV shared (no memory)"
        else:
            key = " + ".join(map(_kind_label, specs)) or "no cache"
        counts[key] = counts.get(key, 0) + 1
    return counts


def render_plan(console: Console, spec: ModelSpec, result: Plan) -> None:
    """Tables for one model: layers by type, groups, tensors, hybrid vs uniform capacity."""
    cfg = result.config
    names = layer_names(spec)
    layers = new_table("layer type", ("layers", "right"), compact=True)
    for key, count in layer_type_counts(spec).items():
        layers.add_row(key, str(count))
    print_table(console, layers, title=f"{spec.name} ({spec.model_type}): {spec.num_decoder_layers} layers")

    mixed = [g for g in cfg.groups if g.mixed_pages]
    caption = "; ".join([*(f"group {g.group_id} block = {_page_summary(spec, g)} bytes" for g in mixed),
                         *([cfg.block_size_note] if cfg.block_size_note else []), *result.notes])
    groups = new_table(("group", "right"), "kind", "layers", ("block", "right"), ("window", "right"),
                       ("padding", "right"), ("blocks/req", "right"), compact=True)
    for ids, g, need in _group_rows(cfg, result.blocks_per_request):
        extent = g.window_tokens or g.chunk_tokens
        kind = g.kind.value if g.state_pages == 1 else f"{g.kind.value} ({g.state_pages} pages)"
        groups.add_row(ids, kind, layer_list([names[i] for i in g.layer_indices]),
                       str(g.block_size), str(extent) if extent else "-", str(g.padding_layers), str(need))
    lists = [layer_list([names[i] for i in g.layer_indices]) for g in cfg.groups]
    legend = ("layers a-b/k: every k-th layer from a to b; " if any("/" in x for x in lists) else "") + \
        "window: sliding window or local chunk in tokens; blocks/req: blocks one max_model_len request needs"
    print_table(console, groups, title=f"KV cache groups (page {cfg.page_size_bytes:,} bytes, {cfg.num_blocks:,} "
                                       f"blocks)", caption="; ".join([*([caption] if caption else []), legend]))

    sizes = sorted({t.size_bytes for t in cfg.tensors})
    tensors = new_table(("tensor", "right"), ("size", "right"), "shared by layers", compact=True)
    for i, t in enumerate(cfg.tensors):
        plain = ",".join(names[j] for j in t.shared_by)
        tensors.add_row(str(i), _gib(t.size_bytes),
                        plain if len(plain) <= SHORT_LAYER_LIST else layer_list([names[j] for j in t.shared_by]))
    print_table(console, tensors, title=f"KV cache tensors ({len(cfg.tensors)} x "
                                        f"{' / '.join(_gib(n) for n in sizes)})")
    _render_capacity(console, result)
    if result.state_layouts:
        _render_state_layouts(console, result)


def _group_rows(cfg: KVCacheConfig, need: tuple[int, ...]) -> list[tuple[str, KVCacheGroupSpec, int]]:
    """One row per group, the page groups of one multi-page state as one row `a-b` (need per state)."""
    rows: list[tuple[str, KVCacheGroupSpec, int]] = []
    for g, n in zip(cfg.groups, need, strict=True):
        if g.state_lead:
            last = g.group_id + g.state_pages - 1
            rows.append((f"{g.group_id}-{last}" if last > g.group_id else str(g.group_id), g, n))
    return rows


def _render_state_layouts(console: Console, result: Plan) -> None:
    """A Mamba hybrid's two state layouts side by side (`StateLayout`)."""
    table = new_table("state layout", ("attention block", "right"), ("state", "right"),
                      ("max concurrency", "right"), ("per request", "right"), ("shortest hit", "right"),
                      compact=True)
    for s in result.state_layouts:
        state = f"{s.pages_per_state} x {s.page_size_bytes:,} B" if s.pages_per_state > 1 else \
            f"1 page of {s.page_size_bytes:,} B"
        table.add_row(s.state_layout.value + (" (planned)" if s is result.state_layouts[0] else ""),
                      str(s.attention_block_size), state, f"{s.max_concurrency:.2f}", _gib(s.bytes_per_request),
                      f"{s.shortest_cacheable_prefix:,} tokens")
    print_table(console, table, title=f"State layouts (--state-layout; --running-state "
                                      f"{result.options.running_state.value})",
                caption="state: pages one layer's state spans; shortest hit: no shorter prefix is ever a "
                        "prefix-cache hit (a state checkpoint every state block)")


def block_sizes_text(cfg: KVCacheConfig) -> str:
    """The attention groups' block size, or each distinct one where they differ (DeepSeek-V4: `4/8/64/256`)."""
    sizes = sorted({g.block_size for g in cfg.groups if g.kind is not SpecKind.MAMBA})
    return "/".join(map(str, sizes)) if len(sizes) > 1 else str(cfg.attention_block_size)


def _render_capacity(console: Console, result: Plan) -> None:
    cfg, u = result.config, result.uniform
    reasons = [*([f"hybrid: {result.reason}"] if not result.runnable else []), f"uniform: {u.reason}"]
    options = result.options
    cap = new_table("layout", ("block size", "right"), ("max concurrency", "right"),
                    ("KV capacity (tokens)", "right"), ("per request", "right"), compact=True)
    cap.add_row("hybrid", block_sizes_text(cfg), _concurrency(result.max_concurrency, result.runnable),
                f"{result.kv_capacity_tokens:,}", _gib(result.bytes_per_request))
    supported = u.num_blocks > 0
    cap.add_row("uniform", str(u.block_size), _concurrency(u.max_concurrency, u.runnable) if supported else "can't run",
                f"{u.kv_capacity_tokens:,}" if supported else "-", _gib(u.bytes_per_request) if supported else "-")
    cap.add_row("ratio", "", _ratio(result), "", "")
    print_table(console, cap, title=f"Capacity at {_gib(options.memory_bytes)}, max_model_len {options.max_model_len}",
                caption=f"{'. '.join(reasons)}. Padding waste {_gib(result.padding_waste_bytes)}; "
                        f"KV-server chunk size {result.recommended_chunk_size}.")


COMPARISON_HEADERS = ("max len", "layers", "block", "hybrid", "uniform", "ratio", "waste")
MIN_NAME_WIDTH = 10  # a model column narrower than this reads badly: list the models one by one instead


def render_comparison(console: Console, plans: list[tuple[ModelSpec, Plan]]) -> None:
    """One row per model: the hybrid layout against the uniform one, each at its own max_model_len.
    On a console too narrow for the figures beside a readable model column, one small table per model."""
    first = plans[0][1].options
    rows = [(spec.name, _comparison_figures(spec, result)) for spec, result in plans]
    title = f"Max concurrency, hybrid vs uniform layout ({_gib(first.memory_bytes)})"
    caption = ("hybrid / uniform: requests of `max len` tokens held at once (<1: not even one); "
               "waste: GiB of padding in short groups")
    figures = new_table(*((h, "right") for h in COMPARISON_HEADERS), compact=True)
    for _, values in rows:
        figures.add_row(*values)
    if Measurement.get(console, console.options, figures).maximum + MIN_NAME_WIDTH + 3 <= console.width:
        table = new_table("model", *((h, "right") for h in COMPARISON_HEADERS), compact=True)
        for name, values in rows:
            table.add_row(name, *values)
        print_table(console, table, title=title, caption=caption)
        return
    console.print(f"[bold]{escape(title)}[/]", highlight=False)
    for name, values in rows:
        table = new_table("", ("", "right"), show_header=False, compact=True)
        for header, value in zip(COMPARISON_HEADERS, values, strict=True):
            table.add_row(header, value)
        console.print(name, highlight=False, markup=False, soft_wrap=True)
        console.print(table)
    console.print(caption, highlight=False, markup=False)


def _comparison_figures(spec: ModelSpec, result: Plan) -> list[str]:
    u = result.uniform
    return [str(result.options.max_model_len), str(spec.num_decoder_layers), block_sizes_text(result.config),
            _short_concurrency(result.max_concurrency, result.runnable),
            _short_concurrency(u.max_concurrency, u.runnable) if u.num_blocks else "can't run",
            _ratio(result), f"{result.padding_waste_bytes / GIB:.2f}"]


def render_catalog(console: Console) -> None:
    """The shipped catalog: names a user can pass as MODEL."""
    table = new_table("hf id", "aliases", "model_type", compact=True)
    for entry in catalog():
        table.add_row(entry.hf_id, ", ".join(entry.aliases), str(entry.config.get("model_type", "?")))
    print_table(console, table, title="Catalog (hybridkv plan NAME)")
