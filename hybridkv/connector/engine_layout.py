"""The server-side layout of an engine's KV cache, from the planner's `KVCacheConfig` (the same
config the runner lays its tensors out from): what `KVClient.register` sends."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec

from hybridkv.errors import ConfigError
from hybridkv.plan.planner import KVCacheConfig, KVCacheGroupSpec, PageLayout
from hybridkv.plan.specs import SpecKind
from hybridkv.wire import BufferLayout, GroupKind, GroupLayout, Layout

_KINDS = {
    SpecKind.FULL: GroupKind.FULL,
    SpecKind.SLIDING_WINDOW: GroupKind.SLIDING,
    SpecKind.CHUNKED_LOCAL: GroupKind.CHUNKED,
    SpecKind.MAMBA: GroupKind.STATE,
    SpecKind.CROSS: GroupKind.CROSS,
}


def group_layout(group: KVCacheGroupSpec, page_size_bytes: int) -> GroupLayout:
    """The registration of one group; a group of mixed pages (MLA latents + indexer keys, MiniMax-M3)
    lists its layers' page sizes (`layer_page_bytes`, the largest as `page_bytes`); a page of a
    multi-page state moves the whole page (`page_size_bytes`) and says which page it is."""
    window = group.window_tokens or group.chunk_tokens or -1
    pages = list(group.layer_page_bytes()) if group.mixed_pages else None
    page = max(pages) if pages else group.spec.page_size_bytes(group.block_size)
    if group.state_pages > 1:
        page = page_size_bytes
    return GroupLayout(kind=_KINDS[group.kind], num_layers=len(group.layer_indices), block_tokens=group.block_size,
                       page_bytes=page, window_tokens=window, layer_page_bytes=pages, state_page=group.state_page,
                       state_pages=group.state_pages)


def layout_from_kv_cache_config(config: KVCacheConfig, *, buffers: Sequence[BufferLayout], model: str | None = None,
                                rank: int = 0, world_size: int = 1) -> Layout:
    """`buffers[j]`: the shared-memory segment of KV cache tensor j (layer j of every group). In a layout
    of one group of mixed pages tensor j is layer j's alone, its blocks `page_j` apart. In the packed
    DeepSeek-V4 layout the one tensor holds every group: each layer of each group is registered as a
    buffer on that segment at the layer's offset in the block (its group's earlier pages)."""
    from hybridkv.connector.client import make_layout

    groups = [group_layout(g, config.page_size_bytes) for g in config.groups]
    stride = config.page_size_bytes
    if config.page_layout is PageLayout.LAYER_TENSORS:
        (only,) = config.groups
        buffers = [msgspec.structs.replace(buf, page_stride_bytes=page)
                   for buf, page in zip(buffers, only.layer_page_bytes(), strict=True)]
        stride = max(only.layer_page_bytes())
    elif config.page_layout is PageLayout.PACKED_BLOCKS:
        groups, buffers = _packed(config, groups, buffers)
    return make_layout(model=model or config.model, groups=groups, buffers=buffers, num_blocks=config.num_blocks,
                       page_stride_bytes=stride, rank=rank, world_size=world_size)


def _packed(config: KVCacheConfig, groups: list[GroupLayout],
            buffers: Sequence[BufferLayout]) -> tuple[list[GroupLayout], list[BufferLayout]]:
    if len(buffers) != 1:
        raise ConfigError(f"{config.model!r} uses the packed DeepSeek-V4 layout: one buffer holds every group, "
                          f"got {len(buffers)} buffers")
    (segment,) = buffers
    packed: list[BufferLayout] = []
    placed: list[GroupLayout] = []
    for spec, group in zip(config.groups, groups, strict=True):
        offsets = itertools.accumulate(spec.layer_page_bytes()[:-1], initial=0)
        first = len(packed)
        packed.extend(msgspec.structs.replace(segment, offset_bytes=offset, page_stride_bytes=config.page_size_bytes)
                      for offset in offsets)
        placed.append(msgspec.structs.replace(group, layer_buffers=list(range(first, len(packed)))))
    return placed, packed
