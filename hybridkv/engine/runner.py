"""The model runner: KV cache tensors laid out exactly as the planner says, and one forward per step.

Memory layout (from `KVCacheConfig`): tensor i is one byte buffer of `num_blocks * page_size`
bytes shared by layer i of every group. A layer sees its tensor as

    [num_blocks, 2 (K, V), block_size of its group, kv_heads, head_dim]

so block b of group g occupies the same bytes in every tensor; the manager hands block b to one
group at a time. Block 0 is the null block (never written). KV-shared layers get their target
layer's view and never write it. State layers (Mamba, Gated DeltaNet) view their page as their
state tensors instead (`state_layers.py`); before each forward the runner restores, zeroes and
describes their states there (`StateLayers.prepare`).

A step's items are reordered so single-token items (decodes) come first, shortest first; tokens are
flattened into one batch and the model runs once. Logits come back only for items that sample.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.engine import kernels
from hybridkv.engine.attention import AttentionRule, GroupMetadata, groups_metadata, plan_reads
from hybridkv.engine.loader import torch_dtype
from hybridkv.engine.mla_attention import latent_view
from hybridkv.engine.models.base import CausalLM, ForwardContext
from hybridkv.engine.state_layers import StateCache, StateIO, StateLayers
from hybridkv.engine.state_pages import PagedStates
from hybridkv.engine.threads import StepThreads
from hybridkv.errors import ConfigError
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.plan.specs import AttentionSpec, IndexerSpec, MLASpec, SpecKind


@dataclass(frozen=True, slots=True, kw_only=True)
class StepItem:
    """One request's work in a step: tokens at positions [start_pos, start_pos + len(token_ids))."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[Sequence[int]]  # per KV cache group
    sample: bool  # True when the last token's logits are needed
    state_io: Mapping[int, StateIO] = field(default_factory=dict)  # per state group (KVCacheManager.state_steps)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory() -> None:
    """Let glibc keep freed activation buffers for reuse instead of unmapping them.

    Each step allocates and frees buffers of several MiB; by default glibc serves those with
    mmap/munmap, and the page faults of re-mapping them cost about a quarter of the CPU time of
    a prefill-heavy run. Process-wide, idempotent; a no-op where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)  # glibc's maximum
        libc.mallopt(_M_TRIM_THRESHOLD, 1024 * 1024 * 1024)
    except (OSError, AttributeError):  # not glibc
        return


def _rule(group: KVCacheGroupSpec) -> AttentionRule:
    return AttentionRule(kind=group.kind, window_tokens=group.window_tokens, chunk_tokens=group.chunk_tokens)


class ModelRunner:
    """Owns the KV cache tensors and runs the model over a step's scheduled tokens."""

    def __init__(self, model: CausalLM, kv_config: KVCacheConfig, *,
                 buffers: Sequence[torch.Tensor] | None = None) -> None:
        """`buffers`: zeroed uint8 tensors of the layout's tensor sizes to lay the KV cache over
        (shared memory a KV cache server maps); None allocates them."""
        keep_freed_memory()
        self.model = model
        self.kv_config = kv_config
        self._check_sharing()
        kinds = list(model.layer_kinds())
        self.num_layers = len(kinds)
        self.buffers: list[torch.Tensor] = []
        self.layer_group: list[int] = [-1] * self.num_layers
        views: list[torch.Tensor | StateCache | None] = [None] * self.num_layers
        group_of = {layer: g for g in kv_config.groups if g.state_lead for layer in g.layer_indices}
        beyond = sorted(layer for layer in group_of if layer >= self.num_layers)
        if beyond:
            raise ConfigError(f"the KV cache layout of {kv_config.model!r} caches layers {beyond} but "
                              f"{type(model).__name__} declares {self.num_layers} cache slots")
        if buffers is not None and [b.numel() for b in buffers] != [t.size_bytes for t in kv_config.tensors]:
            raise ConfigError(f"KV cache buffers of {[b.numel() for b in buffers]} bytes given; the layout of "
                              f"{kv_config.model!r} needs {[t.size_bytes for t in kv_config.tensors]}")
        for i, tensor in enumerate(kv_config.tensors):
            self.buffers.append(torch.zeros(tensor.size_bytes, dtype=torch.uint8) if buffers is None else buffers[i])
        self.states = StateLayers(kv_config, self.buffers)
        pages = [b.view(kv_config.num_blocks, -1) for b in self.buffers]
        self.paged = {g.group_id: PagedStates(kv_config, g, pages)
                      for g in kv_config.groups if g.state_pages > 1 and g.state_lead}
        for tensor, buffer in zip(kv_config.tensors, self.buffers, strict=True):
            for layer in tensor.shared_by:
                views[layer] = self._layer_view(buffer, group_of[layer], layer)
                self.layer_group[layer] = group_of[layer].group_id
        for layer, target in kv_config.kv_shared_from.items():
            views[layer], self.layer_group[layer] = views[target], self.layer_group[target]
        missing = [i for i, v in enumerate(views) if v is None and kinds[i] is not None]
        if missing:
            raise ConfigError(f"decoder layers {missing} have no KV cache tensor in the layout of {kv_config.model!r}")
        no_kv = torch.empty(0)  # placeholder for layers without K/V (state layers, cacheless layers)
        self.kv_caches: list[torch.Tensor] = [v if isinstance(v, torch.Tensor) else no_kv for v in views]
        self.state_caches: list[StateCache | None] = [v if isinstance(v, StateCache) else None for v in views]
        self._check_kinds()
        self.rules = [_rule(g) for g in kv_config.groups]
        self.plan_groups: dict[tuple[AttentionRule, int], list[int]] = {}  # groups sharing a read plan
        for g, rule in enumerate(self.rules):
            if rule.kind is not SpecKind.MAMBA:
                self.plan_groups.setdefault((rule, kv_config.groups[g].block_size), []).append(g)
        self.step_threads = StepThreads()  # threads per step: decodes use every thread only on an idle machine
        # the decode kernel reads float32 caches: one call for all decode rows (else split by length)
        self.split_decodes = not kernels.usable(*self.kv_caches)

    def _layer_view(self, buffer: torch.Tensor, group: KVCacheGroupSpec, layer: int) -> torch.Tensor | StateCache:
        spec = group.spec_of(layer)
        if spec.kind is SpecKind.MAMBA and group.state_pages > 1:
            return self.paged[group.group_id].caches[layer]
        if spec.kind is SpecKind.MAMBA:
            return self.states.view(buffer, group, layer)
        if isinstance(spec, MLASpec | IndexerSpec):
            return latent_view(buffer, spec, group=group, num_blocks=self.kv_config.num_blocks,
                               dtype=torch_dtype(spec.dtype))
        if not isinstance(spec, AttentionSpec) or spec.kind is SpecKind.CROSS:
            raise ConfigError(f"layer {layer} is a {spec.kind.value} layer; the engine runs self-attention layers only")
        dtype = torch_dtype(spec.dtype)
        page = spec.page_size_bytes(group.block_size)
        # A group of mixed pages gives each layer a tensor of its own page; otherwise all pages are one size.
        expected = buffer.numel() // self.kv_config.num_blocks if group.mixed_pages else self.kv_config.page_size_bytes
        if page != expected:
            raise ConfigError(f"layer {layer}: page of {page} bytes differs from the layout's {expected} bytes")
        typed = buffer.view(dtype)  # [num_blocks * page / itemsize]
        return typed.view(self.kv_config.num_blocks, 2, group.block_size, spec.num_kv_heads, spec.head_dim)

    def _check_sharing(self) -> None:
        """The model reads K/V across layers exactly where the layout shares tensors (Gemma 3n)."""
        layout, model = dict(self.kv_config.kv_shared_from), self.model.kv_shared_from
        if layout != model:
            raise ConfigError(
                f"KV sharing of {self.kv_config.model!r}: the KV cache layout shares {layout} (layer: layer whose "
                f"K/V it reads) but {type(self.model).__name__} computes {model}; model_specs and the model "
                f"file disagree"
            )

    def _check_kinds(self) -> None:
        kinds = self.model.layer_kinds()
        for layer, kind in enumerate(kinds):
            if self.layer_group[layer] < 0:
                if kind is None:
                    continue
                raise ConfigError(f"layer {layer}: the model computes {kind.value} attention but the KV cache "
                                  f"layout gives it no cache; model_specs and the model file disagree")
            group = self.kv_config.groups[self.layer_group[layer]]
            # The planner plans a window or chunk at least max_model_len long as full attention
            # (identical at every length the engine accepts), so a local layer may sit in a full group.
            promoted = group.kind is SpecKind.FULL and kind in (SpecKind.SLIDING_WINDOW, SpecKind.CHUNKED_LOCAL)
            if group.kind is not kind and not promoted:
                shown = "no" if kind is None else kind.value
                raise ConfigError(
                    f"layer {layer}: the model computes {shown} attention but the KV cache layout "
                    f"caches it as {group.kind.value}; model_specs and the model file disagree"
                )

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of every KV cache tensor allocated."""
        return sum(b.numel() for b in self.buffers)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block `src` to block `dst` for each (src, dst), in order: the page of every KV cache
        tensor (block b occupies the same bytes of each; the manager's copy on write of a partial
        hit: K/V pages of an attention group, the state of a state group)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.long)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
        if len(set(dst.tolist()) & set(src.tolist())):  # a chain: one copy after another
            for a, b in copies:
                for buffer in self.buffers:
                    pages = buffer.view(self.kv_config.num_blocks, -1)
                    pages[b] = pages[a]
            return
        for buffer in self.buffers:
            pages = buffer.view(self.kv_config.num_blocks, -1)
            pages[dst] = pages[src]

    def execute(self, items: Sequence[StepItem]) -> torch.Tensor:
        """Run one step; returns logits [N, vocab] of the sampling items, in the given order."""
        # decodes first, by position (attention calls group decodes of similar length), then prefills as given
        order = sorted(range(len(items)), key=lambda i: (len(items[i].token_ids) != 1,
                                                         items[i].start_pos if len(items[i].token_ids) == 1 else 0))
        ordered = [items[i] for i in order]
        ids = torch.tensor([t for it in ordered for t in it.token_ids], dtype=torch.int64)  # [T]
        spans = [(it.start_pos, it.start_pos + len(it.token_ids)) for it in ordered]
        positions = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b in spans]))  # [T]
        groups: list[GroupMetadata | None] = [None] * len(self.rules)  # None: a state group
        for (rule, block_size), members in self.plan_groups.items():  # one plan (masks) per rule and block size
            plan = plan_reads(spans, rule=rule, block_size=block_size, split_decodes=self.split_decodes)
            metas = groups_metadata(plan, [[it.block_ids[g] for it in ordered] for g in members])
            for g, meta in zip(members, metas, strict=True):
                groups[g] = meta
        states = {}
        state_caches = self.state_caches
        if self.states.groups:
            io = [it.state_io for it in ordered]
            for g, paged in self.paged.items():  # multi-page states: gathered into slots for this step
                io = [{**known, g: slot_io} for known, slot_io in zip(io, paged.gather(io), strict=True)]
            states = self.states.prepare(spans, io, {g: p.slot_pages for g, p in self.paged.items()})
            state_caches = self._step_state_caches()
        ends = torch.tensor([len(it.token_ids) for it in ordered]).cumsum(0) - 1  # [N] last token of each item
        row_of = {original: int(ends[k]) for k, original in enumerate(order)}
        rows = torch.tensor([row_of[i] for i, it in enumerate(items) if it.sample], dtype=torch.int64)
        ctx = ForwardContext(positions=positions, groups=groups, kv_caches=self.kv_caches,
                             layer_group=self.layer_group, kv_shared_from=self.kv_config.kv_shared_from,
                             state_caches=state_caches, state_groups=states, sample_rows=rows)
        with torch.inference_mode(), self.step_threads(len(ids)):
            hidden = self.model(ids, positions, ctx)  # [N, hidden]: the sampling items' last tokens
            logits = self.model.compute_logits(hidden).float()  # [N, vocab]
        for paged in self.paged.values():
            paged.scatter()
        return logits

    def _step_state_caches(self) -> list[StateCache | None]:
        """The state views of this step: a multi-page state's layers view its slots (`state_pages.py`)."""
        if not self.paged:
            return self.state_caches
        caches = list(self.state_caches)
        for paged in self.paged.values():
            for layer, cache in paged.caches.items():
                caches[layer] = cache
        return caches
