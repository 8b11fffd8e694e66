"""The KV cache planner: layer specs + memory budget -> groups, block size, tensors, capacity.

It reproduces the vLLM hybrid KV cache layout exactly (design.md section 3) and, for
comparison, the uniform layout an engine falls back to when the hybrid manager is off.

    bucket layers by spec --> group_size (1.5x rule) --> strided split into groups
        --> one block size per group so every page has the same size
        --> group_size tensors, tensor i shared by layer i of every group
        --> num_blocks = memory // page_size // group_size   (block 0 is the null block)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.core.errors import CapacityError, ConfigError
from hybridkv.core.packed_layout import packed_groups
from hybridkv.core.specs import (
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

GIB = 1024**3
MIN_CHUNK_TOKENS = 256
# One default for `hybridkv plan`, `hybridkv run` and `LLM` (vLLM's chunked-prefill default), so
# the same model and budget give the same capacity everywhere.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def memory_gib_to_bytes(gib: float, *, option: str) -> int:
    """Bytes of a budget given in GiB; ConfigError naming `option` unless it is a finite number > 0."""
    if isinstance(gib, bool) or not isinstance(gib, int | float) or not math.isfinite(gib) or gib <= 0:
        raise ConfigError(f"{option} must be a finite number of GiB > 0, got {gib!r}")
    memory_bytes = gib * GIB
    if not math.isfinite(memory_bytes) or memory_bytes < 1:
        raise ConfigError(f"{option} must be a finite number of GiB > 0, got {gib!r}")
    return int(memory_bytes)


def resolve_max_model_len(requested: int | None, *, model: str, model_limit: int, default_cap: int) -> int:
    """The `max_model_len` to plan for: the request, or the model's limit capped at `default_cap`.

    Like vLLM, a request above the model's `max_position_embeddings` is an error, not a silent plan.
    """
    if requested is None:
        return min(model_limit, default_cap)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested <= 0:
        raise ConfigError(f"max_model_len must be a positive integer, got {requested!r}")
    if requested > model_limit:
        raise ConfigError(
            f"max_model_len {requested} exceeds {model}'s limit of {model_limit} tokens "
            f"(max_position_embeddings in its config.json); expected at most {model_limit}"
        )
    return requested


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerOptions:
    """What the planner needs besides the model: the budget and the scheduler limits."""

    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    mamba_alignment: int = 16
    #: How state groups are prefix-cached; sizes their per-request need (see `MambaSpec.blocks_needed`).
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "max_model_len", "max_num_batched_tokens", "block_size", "mamba_alignment"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mamba_cache_mode, MambaCacheMode):
            raise ConfigError(f"mamba_cache_mode must be one of {[m.value for m in MambaCacheMode]}, "
                              f"got {self.mamba_cache_mode!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheGroupSpec:
    """One KV cache group: layers of one spec sharing a block table, and its block size.

    `padding_layers` counts the slots this group leaves empty because it has fewer layers
    than `group_size`: those slots' memory in the shared tensors is wasted.

    `layer_specs` is set only for a group of mixed pages (vLLM's `UniformTypeKVCacheSpecs`):
    layers of one attention type and block size but different specs (MLA latents and indexer
    keys) share one block table; `layer_specs[i]` is the spec of `layer_indices[i]`, `spec` the
    first of them, and a block spans one page of each layer, nothing padded.
    """

    group_id: int
    spec: LayerSpec
    layer_indices: tuple[int, ...]
    block_size: int
    padding_layers: int = 0
    layer_specs: tuple[LayerSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"group {self.group_id}: block_size must be a positive integer, got {self.block_size}")
        if not self.layer_indices:
            raise ConfigError(f"group {self.group_id}: a KV cache group needs at least one layer, got none")
        if self.padding_layers < 0:
            raise ConfigError(f"group {self.group_id}: padding_layers must be >= 0, got {self.padding_layers}")
        if self.layer_specs and len(self.layer_specs) != len(self.layer_indices):
            raise ConfigError(f"group {self.group_id}: {len(self.layer_specs)} layer specs for "
                              f"{len(self.layer_indices)} layers; expected one spec per layer")
        if self.layer_specs and self.layer_specs[0] != self.spec:
            raise ConfigError(f"group {self.group_id}: spec must be the first of layer_specs")

    @property
    def kind(self) -> SpecKind:
        return self.spec.kind

    @property
    def mixed_pages(self) -> bool:
        """True for a group whose layers have different page sizes (one block spans all of them)."""
        return bool(self.layer_specs)

    def spec_of(self, layer: int) -> LayerSpec:
        """The spec of `layer`, one of this group's layers."""
        if layer not in self.layer_indices:
            raise ConfigError(f"layer {layer} is not in group {self.group_id} (layers {list(self.layer_indices)})")
        return self.layer_specs[self.layer_indices.index(layer)] if self.layer_specs else self.spec

    def layer_page_bytes(self) -> tuple[int, ...]:
        """Unpadded page bytes of each layer of this group, in `layer_indices` order."""
        specs = self.layer_specs or (self.spec,) * len(self.layer_indices)
        return tuple(s.page_size_bytes(self.block_size) for s in specs)

    @property
    def window_tokens(self) -> int:
        """Sliding window in tokens, 0 for other kinds."""
        return self.spec.window_tokens if isinstance(self.spec, AttentionSpec | MLASpec | CompressedMLASpec) else 0

    @property
    def chunk_tokens(self) -> int:
        """Local-attention chunk in tokens, 0 for other kinds."""
        return self.spec.chunk_tokens if isinstance(self.spec, AttentionSpec) else 0


class PageLayout(Enum):
    """How the groups' pages sit in memory.

    SHARED_TENSORS: vLLM's hybrid layout, `group_size` tensors, tensor i shared by layer i of every
    group, one page size. LAYER_TENSORS: one group of mixed pages, each layer its own tensor.
    PACKED_BLOCKS (DeepSeek-V4): one buffer; block b of every group spans bytes
    `[b * page_size_bytes, (b + 1) * page_size_bytes)`, each group's layers packed side by side in it.
    """

    SHARED_TENSORS = "shared_tensors"
    LAYER_TENSORS = "layer_tensors"
    PACKED_BLOCKS = "packed_blocks"


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheTensor:
    """One physical buffer of `num_blocks * page_size_bytes`, shared by the layers listed."""

    size_bytes: int
    shared_by: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCacheConfig:
    """The layout both the KV cache manager and the runner read.

    `num_blocks` includes the null block 0; `usable_blocks = num_blocks - 1`. For a layout of
    one group of mixed pages, `page_size_bytes` is the block's total over every layer,
    `group_size` is 1 and each layer has a tensor of its own (`num_blocks * its page`). For the packed
    layout (`PageLayout.PACKED_BLOCKS`) `page_size_bytes` is the block stride (the largest group's
    block total), `group_size` is 1 and one tensor holds every group.
    `block_size_note` says when the model's kernels forced the block size.
    """

    model: str
    num_blocks: int
    page_size_bytes: int
    group_size: int
    groups: tuple[KVCacheGroupSpec, ...]
    tensors: tuple[KVCacheTensor, ...]
    kv_shared_from: dict[int, int] = field(default_factory=dict)
    block_size_note: str = ""
    page_layout: PageLayout = PageLayout.SHARED_TENSORS

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def total_bytes(self) -> int:
        return sum(t.size_bytes for t in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        """Memory one block id occupies: a page in each of the `group_size` tensors (padding included)."""
        return self.page_size_bytes * self.group_size

    @property
    def attention_block_size(self) -> int:
        """Block size of the attention groups (the smallest, if they differ)."""
        sizes = [g.block_size for g in self.groups if g.kind is not SpecKind.MAMBA]
        return min(sizes) if sizes else self.groups[0].block_size

    def tensor_of_layer(self, layer: int) -> int:
        """Index of the tensor holding `layer` (a KV-shared layer resolves to its target)."""
        layer = self.kv_shared_from.get(layer, layer)
        for i, tensor in enumerate(self.tensors):
            if layer in tensor.shared_by:
                return i
        raise ConfigError(f"layer {layer} owns no KV cache tensor in model {self.model!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UniformLayout:
    """The layout with the hybrid manager off: every attention layer cached as full attention."""

    runnable: bool
    reason: str
    block_size: int
    num_blocks: int
    total_bytes: int
    max_concurrency: float
    kv_capacity_tokens: int
    bytes_per_request: int  # KV bytes one max_model_len request occupies


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """The planner's full answer: the hybrid layout, its capacity and the uniform comparison."""

    config: KVCacheConfig
    options: PlannerOptions
    blocks_per_request: tuple[int, ...]  # per group, at max_model_len
    max_concurrency: float
    kv_capacity_tokens: int
    padding_waste_bytes: int  # tensor bytes left empty by short groups at full load
    bytes_per_request: int  # KV bytes one max_model_len request occupies (a block spans group_size pages)
    recommended_chunk_size: int
    uniform: UniformLayout
    notes: tuple[str, ...] = ()  # what the planner changed from the literal request, and why

    @property
    def runnable(self) -> bool:
        """True when the pool holds at least one request of `max_model_len` tokens."""
        return self.max_concurrency >= 1

    @property
    def reason(self) -> str:
        """Why the hybrid layout cannot serve a full-length request ("" when it can)."""
        return "" if self.runnable else budget_reason(self.max_concurrency, self.options)

    @property
    def capacity_ratio(self) -> float:
        """Hybrid over uniform capacity (inf when the uniform layout holds nothing at all)."""
        if self.uniform.max_concurrency == 0:
            return math.inf
        return self.max_concurrency / self.uniform.max_concurrency


def budget_reason(concurrency: float, options: PlannerOptions) -> str:
    """The plain-words reason a budget is too small for one `max_model_len` request."""
    return (f"the {options.memory_bytes / GIB:.2f} GiB budget holds {concurrency:.2f} of one "
            f"{options.max_model_len}-token request; expected at least 1: raise the memory budget or "
            f"lower max_model_len")


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


def mamba_block_size(*, state_bytes: int, attn_bytes_per_token: int, alignment: int) -> int:
    """Attention block size that makes one attention page hold a whole Mamba state.

    B = A * ceil(M / (A * P1)); M = state bytes, P1 = attention bytes per token per layer.
    """
    return alignment * math.ceil(state_bytes / (alignment * attn_bytes_per_token))


def _block_sizes(specs: list[LayerSpec], base_block_size: int, options: PlannerOptions) -> tuple[list[int], int]:
    """Block size per distinct spec and the common page size."""
    attention = [s for s in specs if not isinstance(s, MambaSpec)]
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    base = base_block_size
    if mamba and attention:
        per_token = max(s.bytes_per_token for s in attention)
        state = max(s.state_bytes for s in mamba)
        base = max(base, mamba_block_size(state_bytes=state, attn_bytes_per_token=per_token,
                                          alignment=options.mamba_alignment))
    pages = [s.page_size_bytes(base) for s in specs]
    page = max(pages)
    sizes: list[int] = []
    for spec in specs:
        if isinstance(spec, MambaSpec):
            sizes.append(base)  # the state page is padded up to `page`
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
    groups = []
    for gid, layers in enumerate(grouped):
        spec = spec_of[layers[0]]
        groups.append(KVCacheGroupSpec(
            group_id=gid, spec=spec, layer_indices=tuple(layers),
            block_size=sizes[distinct.index(spec)], padding_layers=group_size - len(layers),
        ))
    num_blocks = _num_blocks(options.memory_bytes, page, group_size)
    tensors = tuple(
        KVCacheTensor(size_bytes=num_blocks * page,
                      shared_by=tuple(g.layer_indices[i] for g in groups if i < len(g.layer_indices)))
        for i in range(group_size)
    )
    return KVCacheConfig(model=model.name, num_blocks=num_blocks, page_size_bytes=page,
                         group_size=group_size, groups=tuple(groups), tensors=tensors,
                         kv_shared_from=dict(model.kv_shared_from), block_size_note=note)


def _uniform_layout(model: ModelSpec, options: PlannerOptions) -> UniformLayout:
    owned = model.owned_layers()
    block, _ = _base_block_size(model, options)
    if any(isinstance(s, CompressedMLASpec) for _, s in owned):
        return UniformLayout(
            runnable=False, block_size=block, num_blocks=0, total_bytes=0, max_concurrency=0.0,
            kv_capacity_tokens=0, bytes_per_request=0,
            reason="DeepSeek-V4's compressed caches (one state per 4 or 128 tokens, compressor states) "
                   "cannot be cached as full attention: without the hybrid KV cache manager it does not run",
        )
    if any(isinstance(s, MambaSpec) for _, s in owned):
        return UniformLayout(
            runnable=False, block_size=block, num_blocks=0, total_bytes=0, max_concurrency=0.0,
            kv_capacity_tokens=0, bytes_per_request=0,
            reason="Mamba-style state layers cannot be cached as full attention: "
                   "without the hybrid KV cache manager this model does not run",
        )
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
            layers[i] = AttentionSpec(kind=SpecKind.FULL, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                      dtype=spec.dtype)
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


def plan(model: ModelSpec, options: PlannerOptions) -> Plan:
    """Lay out `model` in the hybrid layout and compare it with the uniform one (see `effective_request`)."""
    model, options, notes = effective_request(model, options)
    config = build_kv_cache_config(model, options)
    need = tuple(
        g.spec.blocks_needed(block_size=g.block_size, max_model_len=options.max_model_len,
                             max_num_batched_tokens=options.max_num_batched_tokens,
                             mamba_cache_mode=options.mamba_cache_mode)
        for g in config.groups
    )
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
        notes=notes,
    )
