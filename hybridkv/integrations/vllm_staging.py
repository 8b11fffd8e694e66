"""vLLM's KV cache layout as the hybridkv server sees it, and the staging buffers pages travel through.

vLLM 0.32 allocates its whole KV cache as one backing tensor (`torch.zeros`, ordinary process memory)
and gives every layer a view of it: `KVCacheTensor` t places layer `t.layers[l]`'s page of block b at
byte `t.offset + l * t.layer_stride + b * t.block_stride`. Groups overlay each other (a block id is
pool-wide and owned by one group at a time), so a layer may touch only its own group's blocks.

That allocation cannot be handed to the server without a copy (it is not shared memory, and vLLM's
allocation hook is a CUDA memory-pool context), so pages are staged: the worker registers one
POSIX shared-memory segment per layer slot (`StagingBuffers`), `max(layers per group)` slots of
`num_staging_blocks` pages, and copies the pages of a store into it before the server reads them
(and the pages of a retrieve out of it after the server wrote them).

    vLLM backing tensor                       staging slot j (shared memory, registered)
    | blk 0 | blk 1 | ... | blk b | ...       | 0 (null) | s1 | s2 | ...
                            └── layer j of group g, page b ──copy──> page s (s: a staging id)

Server group g = vLLM group g: kind (full / sliding / chunked / state / cross), its layers, its block
size, its window and its page size (Mamba / GDN states travel as opaque, padded pages). The layout
fingerprint covers what decides a page's bytes: the model, vLLM's version, every group's spec, the
KV cache layout, and each group's attention backend and kernel block size, so pages are never shared
across backends or engines of another layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import xxhash

from hybridkv.connector.client import SharedKVBuffers
from hybridkv.errors import ConfigError
from hybridkv.wire import GroupKind, GroupLayout, Layout

__all__ = ["LayerPages", "StagingBuffers", "group_layouts", "layer_pages", "server_layout", "vllm_layout_fingerprint"]


def _kind_and_window(spec: Any) -> tuple[GroupKind, int]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    if isinstance(spec, CrossAttentionSpec):
        return GroupKind.CROSS, -1
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING, int(spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return GroupKind.CHUNKED, int(spec.attention_chunk_size)
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE, -1
    if isinstance(spec, FullAttentionSpec):
        # with vLLM's hybrid manager off, window layers get a FullAttentionSpec and keep every block
        return GroupKind.FULL, -1
    raise ConfigError(f"vLLM KV cache spec {type(spec).__name__} is not supported by the hybridkv connector; "
                      "supported: full, sliding window, chunked local, Mamba / GDN state and cross attention")


def group_layouts(kv_cache_config: Any) -> list[GroupLayout]:
    """One server group per vLLM KV cache group, in vLLM's order."""
    out = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        kind, window = _kind_and_window(group.kv_cache_spec)
        spec = group.kv_cache_spec
        out.append(GroupLayout(kind=kind, num_layers=len(group.layer_names), block_tokens=int(spec.block_size),
                               page_bytes=int(spec.page_size_bytes), window_tokens=window))
        if out[-1].page_bytes <= 0:
            raise ConfigError(f"vLLM group {gid} has page size {out[-1].page_bytes}; expected a positive size")
    return out


def vllm_layout_fingerprint(*, model: str, groups: Sequence[GroupLayout], kv_cache_config: Any,
                       backends: Sequence[str], kernel_block_sizes: Sequence[int]) -> str:
    """What decides the bytes of a page (see the module doc); equal on every engine of one layout."""
    import vllm

    specs = [repr(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    facts = ["vllm", vllm.__version__, model, list(groups), specs, str(kv_cache_config.kv_cache_layout),
             list(backends), list(kernel_block_sizes)]
    return "vllm-" + xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(facts))


@dataclass(frozen=True, slots=True)
class LayerPages:
    """Per group, per layer of the group (in vLLM's order): a `[num_blocks, page_bytes]` uint8 view of
    that layer's pages in vLLM's backing tensor."""

    views: tuple[tuple[torch.Tensor, ...], ...]


def _first_tensor(cache: Any) -> torch.Tensor:
    if isinstance(cache, torch.Tensor):
        return cache
    return _first_tensor(cache[0])  # Mamba layers: a list of state tensors (conv, recurrent) over one page


def layer_pages(kv_cache_config: Any, kv_caches: dict[str, Any]) -> LayerPages:
    """Byte views of every layer's pages, from vLLM's placement rule (`KVCacheTensor` offsets and strides)
    over the one backing allocation `kv_caches`' tensors view."""
    storages = {_first_tensor(t).untyped_storage().data_ptr() for t in kv_caches.values()}
    if len(storages) != 1:
        raise ConfigError(f"vLLM's KV caches live in {len(storages)} allocations; the hybridkv connector expects "
                          "vLLM 0.32's single backing allocation")
    storage = _first_tensor(next(iter(kv_caches.values()))).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8)
    raw.set_(storage, 0, (storage.nbytes(),), (1,))
    place: dict[str, tuple[int, int, int]] = {}  # layer -> (byte offset of block 0, block stride, num_blocks)
    for t in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(t.layers):
            place[name] = (t.offset + i * t.layer_stride, t.block_stride, kv_cache_config.num_blocks_of(t))
    views = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        page = int(group.kv_cache_spec.page_size_bytes)
        per_layer = []
        for name in group.layer_names:
            if name not in place:
                raise ConfigError(f"vLLM group {gid}'s layer {name!r} has no KV cache tensor")
            offset, stride, num_blocks = place[name]
            if page > stride or offset + (num_blocks - 1) * stride + page > storage.nbytes():
                raise ConfigError(f"layer {name!r}: pages of {page} B at stride {stride} B from offset {offset} "
                                  f"do not fit vLLM's {storage.nbytes()} B allocation of {num_blocks} blocks")
            per_layer.append(raw.as_strided((num_blocks, page), (stride, 1), offset))
        views.append(tuple(per_layer))
    return LayerPages(views=tuple(views))


class StagingBuffers:
    """The registered shared-memory pages: slot j holds layer j of every group, `num_blocks` pages of
    `page_stride_bytes` (block 0 = the null block, never written)."""

    def __init__(self, *, num_slots: int, num_blocks: int, page_stride_bytes: int) -> None:
        self.num_blocks = num_blocks
        self.page_stride_bytes = page_stride_bytes
        self.shared = SharedKVBuffers.create(num_buffers=num_slots, size_bytes=num_blocks * page_stride_bytes)
        self.slots = [torch.frombuffer(a, dtype=torch.uint8).view(num_blocks, page_stride_bytes)
                      for a in self.shared.arrays]

    def copy_in(self, pages: LayerPages, group: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """vLLM pages `src_blocks` of `group` -> staging pages `dst_blocks` (every layer of the group)."""
        src, dst = torch.tensor(src_blocks, dtype=torch.long), torch.tensor(dst_blocks, dtype=torch.long)
        for j, view in enumerate(pages.views[group]):
            self.slots[j][:, : view.shape[1]].index_copy_(0, dst, view.index_select(0, src))

    def copy_out(self, pages: LayerPages, group: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
        """Staging pages `src_blocks` -> vLLM pages `dst_blocks` of `group` (every layer of the group)."""
        src, dst = torch.tensor(src_blocks, dtype=torch.long), torch.tensor(dst_blocks, dtype=torch.long)
        for j, view in enumerate(pages.views[group]):
            view.index_copy_(0, dst, self.slots[j].index_select(0, src)[:, : view.shape[1]])

    def close(self) -> None:
        self.slots.clear()
        self.shared.close()


def server_layout(*, model: str, groups: Sequence[GroupLayout], staging: StagingBuffers, fingerprint: str,
                  rank: int, world_size: int) -> Layout:
    return Layout(model=model, rank=rank, world_size=world_size, groups=list(groups),
                  buffers=staging.shared.buffer_layouts(), num_blocks=staging.num_blocks,
                  page_stride_bytes=staging.page_stride_bytes, fingerprint=fingerprint)
