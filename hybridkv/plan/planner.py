"""The KV cache planner: layer specs + memory budget -> groups, block size, tensors, capacity.

It reproduces the vLLM hybrid KV cache layout exactly (docs/design.md §3) and, for
comparison, the uniform layout an engine falls back to when the hybrid manager is off.

    bucket layers by spec --> group_size (1.5x rule) --> strided split into groups
        --> one block size per group so every page has the same size
        --> group_size tensors, tensor i shared by layer i of every group
        --> num_blocks = memory // page_size // group_size   (block 0 is the null block)
"""

from __future__ import annotations

import dataclasses
import math

from hybridkv.errors import CapacityError, ConfigError
from hybridkv.plan.kv_cache_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    GIB,
    MIN_CHUNK_TOKENS,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    PageLayout,
    Plan,
    PlannerOptions,
    RunningState,
    StateLayout,
    StateLayoutSummary,
    UniformLayout,
    budget_reason,
    memory_gib_to_bytes,
    resolve_max_model_len,
)
from hybridkv.plan.packed_layout import packed_groups
from hybridkv.plan.specs import (
    AttentionSpec,
    CompressedMLASpec,
    IndexerSpec,
    LayerSpec,
    MambaCacheMode,
    MambaSpec,
    MLASpec,
    ModelSpec,
    SpecKind,
)

__all__ = [  # the planner's types live in kv_cache_config; importing them from here keeps working
    "DEFAULT_MAX_NUM_BATCHED_TOKENS", "GIB", "MIN_CHUNK_TOKENS", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor",
    "PageLayout", "Plan", "PlannerOptions", "RunningState", "StateLayout", "StateLayoutSummary", "UniformLayout",
    "budget_reason", "build_kv_cache_config",
    "effective_request", "group_layers", "mamba_block_size", "memory_gib_to_bytes", "plan", "recommended_chunk_size",
    "resolve_max_model_len",
]

def group_layers(buckets: list[list[int]]) -> tuple[int, list[list[int]]]:
    """Split spec buckets (lists of layer indices) into groups; returns (group_size, groups).

    group_size is the smallest bucket, or the largest when max < 1.5 * min; a bucket of n
    layers becomes ceil(n / group_size) groups by stride, `layers[i::k]`.
    """
    sizes = [len(b) for b in buckets]
    smallest, largest = min(sizes), max(sizes)
    group_size = largest if largest < 1.5 * smallest else smallest
    groups: list[list[int]] = []
    for bucket in buckets:
        k = math.ceil(len(bucket) / group_size)
        groups.extend(bucket[i::k] for i in range(k))
    return group_size, groups


MLA_STATE_ALIGNMENT = 128
#: The multi-page layout doubles the attention block until a state spans at most this many pages. The KV cache
#: manager keeps one page group per state page, so its work per request grows with the pages: 16-token blocks
#: make a Nemotron-H state 82 pages (574 page groups). Bigger blocks cost hits where shared prefixes end inside
#: a block, and pad a state more (Nemotron-H: 2% at 64 tokens, 7% at 128): docs/state_layout.md measures it.
MAX_STATE_PAGES = 32


def mamba_block_size(*, state_bytes: int, attn_bytes_per_token: int, alignment: int) -> int:
    """Attention block size that makes one attention page hold a whole Mamba state.

    B = A * ceil(M / (A * P1)); M = state bytes, P1 = attention bytes per token per layer.
    """
    return alignment * math.ceil(state_bytes / (alignment * attn_bytes_per_token))


def _block_sizes(specs: list[LayerSpec], base_block_size: int, options: PlannerOptions) -> tuple[list[int], int]:
    """Block size per distinct spec and the common page size.

    One-page state layout: the attention block grows until an attention page holds a whole state.
    Multi-page: it doubles from the base block size until a state spans at most `MAX_STATE_PAGES` pages
    (`_state_pages`).
    """
    attention = [s for s in specs if not isinstance(s, MambaSpec)]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    base = base_block_size
    if mamba and attention and options.state_layout is StateLayout.MULTI_PAGE:
        if any(isinstance(s, MLASpec) for s in attention):
            base = max(base, MLA_STATE_ALIGNMENT)
        state = max(s.state_bytes for s in mamba)
        while math.ceil(state / max(s.page_size_bytes(base) for s in attention)) > MAX_STATE_PAGES:
            base *= 2
    elif mamba and attention:
        per_token = max(s.bytes_per_token for s in attention)
        state = max(s.state_bytes for s in mamba)
        # vLLM's `_align_hybrid_block_size`: a multiple of the kernel block and of the asked block size;
        # MLA decode kernels want 128-token multiples next to a state (Kimi-Linear)
        alignment = max(options.mamba_alignment, base)
        if any(isinstance(s, MLASpec) for s in attention):
            alignment = max(alignment, MLA_STATE_ALIGNMENT)
        base = max(base, mamba_block_size(state_bytes=state, attn_bytes_per_token=per_token, alignment=alignment))
    pages = [s.page_size_bytes(base) for s in (attention if options.state_layout is StateLayout.MULTI_PAGE
                                               and attention else specs)]
    page = max(pages)
    sizes: list[int] = []
    for spec in specs:
        if isinstance(spec, MambaSpec):
            sizes.append(base)  # the state page is padded up to `page`
            continue
        own = spec.bytes_per_token * base
        if page % own and isinstance(spec, AttentionSpec):  # vLLM keeps the block and pads the page
            sizes.append(base)
            continue
        if page % spec.bytes_per_token:
            what = "an MLA" if isinstance(spec, MLASpec | IndexerSpec) else f"a {spec.kind.value}"
            raise ConfigError(
                f"cannot unify page sizes: the largest page is {page} bytes but {what} layer has "
                f"{spec.bytes_per_token} bytes per token, which does not divide it (vLLM raises here too; "
                f"MLA pages are never padded)"
            )
        sizes.append(page // spec.bytes_per_token)
    return sizes, page


def _state_pages(spec: LayerSpec, page_bytes: int) -> int:
    """Pages one layer's state spans (1 for attention, and for a state that fits one page)."""
    return math.ceil(spec.state_bytes / page_bytes) if isinstance(spec, MambaSpec) else 1


def _type_key(spec: LayerSpec) -> tuple[SpecKind, int, int]:
    """What makes two layers 'the same type' for vLLM's UniformTypeKVCacheSpecs."""
    if isinstance(spec, AttentionSpec):
        return spec.kind, spec.window_tokens, spec.chunk_tokens
    if isinstance(spec, MLASpec):
        return spec.kind, spec.window_tokens, 0
    return spec.kind, 0, 0


def _is_uniform_type(specs: list[LayerSpec]) -> bool:
    """Several specs of one attention type (same window or chunk): vLLM makes one group of them."""
    if len(specs) < 2 or any(isinstance(s, MambaSpec) for s in specs):
        return False
    return len({_type_key(s) for s in specs}) == 1


def _base_block_size(model: ModelSpec, options: PlannerOptions) -> tuple[int, str]:
    """The block size every group starts from, and a note when the model's kernels force it."""
    forced = model.kernel_block_size
    if forced is None or forced == options.block_size:
        return options.block_size, ("" if forced is None else
                                    f"block size {forced} is the one the {model.kernel_backend} backend requires")
    return forced, (f"Setting kv cache block size to {forced} for the {model.kernel_backend} backend "
                    f"(asked for {options.block_size}; as vLLM does)")


def _num_blocks(memory_bytes: int, page: int, group_size: int) -> int:
    num_blocks = memory_bytes // page // group_size
    if num_blocks < 2:
        need = 2 * page * group_size
        blocks = "1 block" if num_blocks == 1 else f"{num_blocks} blocks"
        raise CapacityError(
            f"a memory budget of {memory_bytes / GIB:.3g} GiB holds {blocks} of {page:,} bytes "
            f"x {group_size} tensors; expected at least {need / GIB:.3g} GiB ({need:,} bytes): "
            f"the null block plus one usable block"
        )
    return num_blocks


def _mixed_page_config(model: ModelSpec, options: PlannerOptions, block: int, note: str) -> KVCacheConfig:
    """One group holding every layer, each with its own page (vLLM's UniformTypeKVCacheSpecs)."""
    owned = model.owned_layers()
    specs = tuple(spec for _, spec in owned)
    group = KVCacheGroupSpec(group_id=0, spec=specs[0], layer_indices=tuple(i for i, _ in owned),
                             block_size=block, layer_specs=specs)
    page = sum(group.layer_page_bytes())
    num_blocks = _num_blocks(options.memory_bytes, page, 1)
    tensors = tuple(KVCacheTensor(size_bytes=num_blocks * layer_page, shared_by=(layer,))
                    for layer, layer_page in zip(group.layer_indices, group.layer_page_bytes(), strict=True))
    return KVCacheConfig(model=model.name, num_blocks=num_blocks, page_size_bytes=page, group_size=1,
                         groups=(group,), tensors=tensors, kv_shared_from=dict(model.kv_shared_from),
                         block_size_note=note, page_layout=PageLayout.LAYER_TENSORS)


def _packed_config(model: ModelSpec, options: PlannerOptions) -> KVCacheConfig:
    """DeepSeek-V4: several groups of mixed pages in one block-outermost buffer (`packed_layout`)."""
    owned = model.owned_layers()
    block_of = {}
    for slot, spec in owned:
        if not isinstance(spec, CompressedMLASpec):
            raise ConfigError(f"model {model.name!r}: cache slot {slot} is a {spec.kind.value} layer among "
                              f"DeepSeek-V4 caches; the packed layout holds only DeepSeek-V4 caches")
        block_of[slot] = spec.block_size
    groups = []
    for gid, members in enumerate(packed_groups(owned, block_of)):
        specs = tuple(spec for _, spec in members)
        groups.append(KVCacheGroupSpec(group_id=gid, spec=specs[0], layer_indices=tuple(s for s, _ in members),
                                       block_size=block_of[members[0][0]], layer_specs=specs))
    stride = max(sum(g.layer_page_bytes()) for g in groups)
    num_blocks = _num_blocks(options.memory_bytes, stride, 1)
    tensor = KVCacheTensor(size_bytes=num_blocks * stride,
                           shared_by=tuple(slot for g in groups for slot in g.layer_indices))
    return KVCacheConfig(model=model.name, num_blocks=num_blocks, page_size_bytes=stride, group_size=1,
                         groups=tuple(groups), tensors=(tensor,), kv_shared_from=dict(model.kv_shared_from),
                         block_size_note="each DeepSeek-V4 cache has the block size its kernels fix (vLLM 0.32)",
                         page_layout=PageLayout.PACKED_BLOCKS)


def build_kv_cache_config(model: ModelSpec, options: PlannerOptions) -> KVCacheConfig:
    """The vLLM-compatible hybrid layout of `model` within `options.memory_bytes`.

    Layers of one attention type whose specs differ (MLA latents + indexer keys) form one group
    of mixed pages; otherwise layers are bucketed by spec and every group gets one page size.
    """
    owned = model.owned_layers()
    if not owned:
        raise ConfigError(f"model {model.name!r} has no layer that owns a KV cache")
    if any(isinstance(spec, CompressedMLASpec) for _, spec in owned):
        return _packed_config(model, options)
    distinct: list[LayerSpec] = []
    buckets: list[list[int]] = []
    for layer, spec in owned:
        if spec not in distinct:
            distinct.append(spec)
            buckets.append([])
        buckets[distinct.index(spec)].append(layer)
    base, note = _base_block_size(model, options)
    if _is_uniform_type(distinct):
        return _mixed_page_config(model, options, base, note)
    sizes, page = _block_sizes(distinct, base, options)
    group_size, grouped = group_layers(buckets)
    spec_of = {layer: spec for layer, spec in owned}
    groups: list[KVCacheGroupSpec] = []
    for layers in grouped:  # a state of k pages becomes k page groups of the same layers
        spec = spec_of[layers[0]]
        k, first = _state_pages(spec, page), len(groups)
        groups.extend(KVCacheGroupSpec(
            group_id=first + s, spec=spec, layer_indices=tuple(layers), block_size=sizes[distinct.index(spec)],
            padding_layers=group_size - len(layers), state_page=s, state_pages=k,
        ) for s in range(k))
    num_blocks = _num_blocks(options.memory_bytes, page, group_size)
    tensors = tuple(
        KVCacheTensor(size_bytes=num_blocks * page,
                      shared_by=tuple(g.layer_indices[i] for g in groups if i < len(g.layer_indices) and g.state_lead))
        for i in range(group_size)
    )
    layout = StateLayout.MULTI_PAGE if any(g.state_pages > 1 for g in groups) else StateLayout.ONE_PAGE
    return KVCacheConfig(model=model.name, num_blocks=num_blocks, page_size_bytes=page,
                         group_size=group_size, groups=tuple(groups), tensors=tensors,
                         kv_shared_from=dict(model.kv_shared_from), block_size_note=note, state_layout=layout)


_NOT_UNIFORM: tuple[tuple[type[CompressedMLASpec] | type[MambaSpec], str], ...] = (
    (CompressedMLASpec, "DeepSeek-V4's compressed caches (one state per 4 or 128 tokens, compressor states) cannot "
                        "be cached as full attention: without the hybrid KV cache manager it does not run"),
    (MambaSpec, "Mamba-style state layers cannot be cached as full attention: without the hybrid KV cache manager "
                "this model does not run"),
)


def _uniform_layout(model: ModelSpec, options: PlannerOptions) -> UniformLayout:
    owned = model.owned_layers()
    block, _ = _base_block_size(model, options)
    for kind, reason in _NOT_UNIFORM:
        if any(isinstance(s, kind) for _, s in owned):
            return UniformLayout(runnable=False, block_size=block, num_blocks=0, total_bytes=0, max_concurrency=0.0,
                                 kv_capacity_tokens=0, bytes_per_request=0, reason=reason)
    bytes_per_block = sum(s.page_size_bytes(block) for _, s in owned)
    num_blocks = options.memory_bytes // bytes_per_block
    need = math.ceil(options.max_model_len / block)
    concurrency = max(num_blocks - 1, 0) / need
    promoted = sum(1 for _, s in owned if s.kind in (SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL))
    layout = (f"{promoted} sliding/chunked layers cached as full attention" if promoted
              else "single attention type: same as the hybrid layout")
    runnable = concurrency >= 1
    return UniformLayout(
        runnable=runnable, block_size=block, num_blocks=num_blocks,
        total_bytes=num_blocks * bytes_per_block, max_concurrency=concurrency,
        kv_capacity_tokens=int(concurrency * options.max_model_len), bytes_per_request=need * bytes_per_block,
        reason=layout if runnable else f"{budget_reason(concurrency, options)} ({layout})",
    )


def effective_request(model: ModelSpec, options: PlannerOptions) -> tuple[ModelSpec, PlannerOptions, tuple[str, ...]]:
    """The model and options the layout is built for, and a note for each change.

    - A sliding window or local-attention chunk at least `max_model_len` long never drops a
      token at this length: those layers are full attention and are planned as such, so such a
      model never has less capacity than with the hybrid manager off (e.g. Ministral-8B at 32K).
    - A local-attention chunk that is not a multiple of the block size (Llama 4 with a chunk of
      24 or 40) gets the largest block size that divides both, instead of a refusal.
    """
    notes: list[str] = []
    layers = list(model.layers)
    promoted = 0
    for i, spec in enumerate(layers):
        if not isinstance(spec, AttentionSpec) or spec.kind not in (SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL):
            continue
        if max(spec.window_tokens, spec.chunk_tokens) >= options.max_model_len:
            layers[i] = dataclasses.replace(spec, kind=SpecKind.FULL, window_tokens=0, chunk_tokens=0)
            promoted += 1
    if promoted:
        notes.append(f"{promoted} sliding-window/chunked layers reach at least max_model_len "
                     f"{options.max_model_len} tokens, so they are full attention at this length and planned as such")
        model = dataclasses.replace(model, layers=tuple(layers))
    chunks = sorted({s.chunk_tokens for s in layers if isinstance(s, AttentionSpec) and s.chunk_tokens})
    block = math.gcd(options.block_size, *chunks) if chunks else options.block_size
    if block != options.block_size:
        notes.append(f"block size {block} instead of {options.block_size}: a local-attention chunk of "
                     f"{', '.join(map(str, chunks))} tokens must be a whole number of blocks")
        options = dataclasses.replace(options, block_size=block)
    return model, options, tuple(notes)


def recommended_chunk_size(config: KVCacheConfig, minimum_tokens: int = MIN_CHUNK_TOKENS) -> int:
    """Smallest multiple of every group's block size that is at least `minimum_tokens`."""
    step = math.lcm(*(g.block_size for g in config.groups))
    return step * max(1, math.ceil(minimum_tokens / step))


def _request_need(config: KVCacheConfig, options: PlannerOptions) -> tuple[int, ...]:
    """Blocks one request of `max_model_len` tokens holds at once, per group. RunningState.FIXED:
    one state per state group, as with no caching (its checkpoints are copied into blocks it never
    holds: taken from the free blocks after the step's allocations and released at once)."""
    mode = options.mamba_cache_mode
    if options.running_state.one_state and mode is MambaCacheMode.ALIGN:
        mode = MambaCacheMode.NONE
    return tuple(
        g.spec.blocks_needed(block_size=g.block_size, max_model_len=options.max_model_len,
                             max_num_batched_tokens=options.max_num_batched_tokens, mamba_cache_mode=mode)
        for g in config.groups
    )


def _state_layouts(model: ModelSpec, options: PlannerOptions, config: KVCacheConfig,
                   need: tuple[int, ...]) -> tuple[StateLayoutSummary, ...]:
    """Both state layouts of a Mamba hybrid (the planned one first); () for other models."""
    kinds = {g.kind is SpecKind.MAMBA for g in config.groups}
    if kinds != {True, False} or config.page_layout is not PageLayout.SHARED_TENSORS:
        return ()
    other_layout = (StateLayout.ONE_PAGE if options.state_layout is StateLayout.MULTI_PAGE
                    else StateLayout.MULTI_PAGE)
    other_options = dataclasses.replace(options, state_layout=other_layout)
    try:
        other = build_kv_cache_config(model, other_options)
    except CapacityError:
        return (_summary(config, options, need),)
    return (_summary(config, options, need), _summary(other, other_options, _request_need(other, other_options)))


def _summary(config: KVCacheConfig, options: PlannerOptions, need: tuple[int, ...]) -> StateLayoutSummary:
    state_blocks = [g.block_size for g in config.groups if g.kind is SpecKind.MAMBA]
    return StateLayoutSummary(
        state_layout=options.state_layout, attention_block_size=config.attention_block_size,
        state_block_tokens=min(state_blocks), page_size_bytes=config.page_size_bytes,
        pages_per_state=config.pages_per_state, num_blocks=config.num_blocks,
        max_concurrency=config.usable_blocks / sum(need), bytes_per_request=sum(need) * config.bytes_per_block,
        shortest_cacheable_prefix=config.shortest_cacheable_prefix,
    )


def plan(model: ModelSpec, options: PlannerOptions) -> Plan:
    """Lay out `model` in the hybrid layout and compare it with the uniform one (see `effective_request`)."""
    model, options, notes = effective_request(model, options)
    config = build_kv_cache_config(model, options)
    need = _request_need(config, options)
    concurrency = config.usable_blocks / sum(need)
    # At full load the pool's blocks split among groups in proportion to what a request needs of
    # each; a block of a group with p padding slots leaves p pages of the shared tensors empty.
    waste_pages = config.num_blocks * sum(g.padding_layers * n for g, n in zip(config.groups, need, strict=True))
    waste = waste_pages * config.page_size_bytes // sum(need)
    if config.page_layout is PageLayout.PACKED_BLOCKS:  # a group's block leaves the stride's rest empty
        waste = config.num_blocks * sum((config.page_size_bytes - sum(g.layer_page_bytes())) * n
                                        for g, n in zip(config.groups, need, strict=True)) // sum(need)
    return Plan(
        config=config, options=options, blocks_per_request=need, max_concurrency=concurrency,
        kv_capacity_tokens=int(concurrency * options.max_model_len), padding_waste_bytes=waste,
        bytes_per_request=sum(need) * config.bytes_per_block,
        recommended_chunk_size=recommended_chunk_size(config), uniform=_uniform_layout(model, options),
        notes=notes, state_layouts=_state_layouts(model, options, config, need),
    )
