"""What the planner answers with: its options, the KV cache groups, tensors and layout both the
manager and the runner read, the uniform comparison and the plan (`planner.py` computes them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from hybridkv.errors import ConfigError
from hybridkv.plan.specs import AttentionSpec, CompressedMLASpec, LayerSpec, MambaCacheMode, MLASpec, SpecKind

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


class StateLayout(Enum):
    """Where a Mamba hybrid's recurrent state lives in the pool (docs/state_layout.md).

    ONE_PAGE (vLLM's layout): one page holds a whole state, so the attention block size is raised
    until an attention page is as large as a state (`mamba_block_size`, 544..8,320 tokens).
    MULTI_PAGE: attention keeps `block_size`-token blocks and a state spans
    `k = ceil(state_bytes / page_bytes)` pages: its group becomes k page groups of the same layers
    (page group s holds bytes [s * page, (s + 1) * page) of every layer's state), which the KV cache
    manager allocates, caches and hits together as one logical state block of `block_size` tokens.
    """

    ONE_PAGE = "one_page"
    MULTI_PAGE = "multi_page"


class RunningState(Enum):
    """Where a request's state lives between steps in align mode (docs/state_layout.md).

    MOVING (vLLM's): a step writes its state into the table entry of the block it ends in, reading
    the previous entry, so a request that crossed a block boundary holds two states per state group.
    FIXED: one running state per request and state group, read and written in place; a hit is
    copied into it before the step's forward, a checkpoint copied out of it after the forward into
    a block the request does not hold (free and cached, best effort).
    ADOPT: FIXED, but a hit on the end of a finished request that no hit has used before (the next
    chat turn or agent step) becomes the running state itself: moved, not copied, so the
    checkpoint leaves the cache and the request holds no second state. A recurring point (a
    system prompt's end) or one another waiting request will hit is copied as in FIXED. With a
    value-aware eviction, prompt ends (`prompt - 1`, where an exact resend would resume) are then
    not anchors: a continuation resumes at the sequence end.
    """

    MOVING = "moving"
    FIXED = "fixed"
    ADOPT = "adopt"

    @property
    def one_state(self) -> bool:
        """One running state per request and state group (FIXED or ADOPT)."""
        return self is not RunningState.MOVING


def check_running_state(running_state: RunningState, mamba_cache_mode: MambaCacheMode) -> None:
    """ConfigError unless `running_state` is a RunningState that fits `mamba_cache_mode`."""
    if not isinstance(running_state, RunningState):
        raise ConfigError(f"running_state must be one of {[m.value for m in RunningState]}, got {running_state!r}")
    if running_state.one_state and mamba_cache_mode is MambaCacheMode.ALL:
        raise ConfigError(f"running_state={running_state.value} copies a checkpoint out of the running state "
                          "where a step ends (align mode); mamba_cache_mode=all keeps one at every boundary a "
                          "step crosses, which one running state cannot give; expected mamba_cache_mode align "
                          "(or none), or running_state moving")


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
    #: Where a Mamba hybrid's states live: one page each, or several small pages (`StateLayout`).
    state_layout: StateLayout = StateLayout.ONE_PAGE
    #: Align mode: two states per request and state group (MOVING, vLLM's) or one (FIXED).
    running_state: RunningState = RunningState.MOVING

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "max_model_len", "max_num_batched_tokens", "block_size", "mamba_alignment"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mamba_cache_mode, MambaCacheMode):
            raise ConfigError(f"mamba_cache_mode must be one of {[m.value for m in MambaCacheMode]}, "
                              f"got {self.mamba_cache_mode!r}")
        if not isinstance(self.state_layout, StateLayout):
            raise ConfigError(f"state_layout must be one of {[m.value for m in StateLayout]}, "
                              f"got {self.state_layout!r}")
        check_running_state(self.running_state, self.mamba_cache_mode)


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
    state_page: int = 0
    state_pages: int = 1

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
        if self.state_pages < 1 or not 0 <= self.state_page < self.state_pages:
            raise ConfigError(f"group {self.group_id}: state page {self.state_page} of {self.state_pages}; expected "
                              f"0 <= state_page < state_pages")
        if self.state_pages > 1 and self.spec.kind is not SpecKind.MAMBA:
            raise ConfigError(f"group {self.group_id}: a {self.spec.kind.value} group spans one page per block; "
                              f"only a state group spans several (got state_pages {self.state_pages})")

    @property
    def state_lead(self) -> bool:
        """True for every group but pages 1.. of a multi-page state (those follow page 0's group)."""
        return self.state_page == 0

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
    state_layout: StateLayout = StateLayout.ONE_PAGE

    @property
    def pages_per_state(self) -> int:
        """Pages one state spans (1 in the one-page layout or without state groups)."""
        return max(g.state_pages for g in self.groups)

    @property
    def shortest_cacheable_prefix(self) -> int:
        """Tokens of the shortest prefix every group can serve as a hit: the lcm of the block sizes."""
        return math.lcm(*(g.block_size for g in self.groups))

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
class StateLayoutSummary:
    """One state layout of a Mamba hybrid at the plan's budget: what `plan` shows side by side."""

    state_layout: StateLayout
    attention_block_size: int
    state_block_tokens: int  # a state checkpoint every this many tokens (the state groups' block)
    page_size_bytes: int
    pages_per_state: int
    num_blocks: int
    max_concurrency: float
    bytes_per_request: int
    shortest_cacheable_prefix: int  # tokens: no shorter prefix is ever a hit


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
    #: For a Mamba hybrid, both state layouts side by side (this plan's first); empty otherwise.
    state_layouts: tuple[StateLayoutSummary, ...] = ()

    @property
    def runnable(self) -> bool:
        """True when the pool holds at least one request of `max_model_len` tokens."""
        return self.max_concurrency >= 1

    @property
    def vllm_max_concurrency(self) -> float:
        """What vLLM logs as its maximum concurrency (`get_max_concurrency_for_kv_cache_config`): every
        block, the null block included, over the blocks a request needs; `max_concurrency` leaves the
        null block out."""
        return self.config.num_blocks / sum(self.blocks_per_request)

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
