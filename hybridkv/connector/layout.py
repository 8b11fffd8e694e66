"""The server-side layout of an engine's KV cache, from the planner's `KVCacheConfig` (the same
config the runner lays its tensors out from): what `KVClient.register` sends."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.core.errors import ConfigError
from hybridkv.core.planner import KVCacheConfig, KVCacheGroupSpec
from hybridkv.core.specs import SpecKind
from hybridkv.server.protocol import BufferLayout, GroupKind, GroupLayout, Layout

_KINDS = {
    SpecKind.FULL: GroupKind.FULL,
    SpecKind.SLIDING_WINDOW: GroupKind.SLIDING,
    SpecKind.CHUNKED_LOCAL: GroupKind.CHUNKED,
    SpecKind.MAMBA: GroupKind.STATE,
    SpecKind.CROSS: GroupKind.CROSS,
}


def group_layout(group: KVCacheGroupSpec) -> GroupLayout:
    """The registration of one group; raises ConfigError for a group of mixed pages (MLA latents +
    indexer keys, MiniMax-M3), whose per-layer page sizes the protocol cannot describe yet (one
    `page_bytes` per group, one page stride for every buffer)."""
    if group.mixed_pages:
        sizes = sorted(set(group.layer_page_bytes()))
        raise ConfigError(
            f"group {group.group_id} holds pages of {len(sizes)} sizes ({', '.join(f'{n:,}' for n in sizes)} bytes: "
            f"MLA latents / indexer keys); the KV cache server's layout has one page size per group and one page "
            f"stride, so this layout cannot be registered yet (per-layer page sizes are not in the protocol)"
        )
    window = group.window_tokens or group.chunk_tokens or -1
    return GroupLayout(kind=_KINDS[group.kind], num_layers=len(group.layer_indices), block_tokens=group.block_size,
                       page_bytes=group.spec.page_size_bytes(group.block_size), window_tokens=window)


def layout_from_kv_cache_config(config: KVCacheConfig, *, buffers: Sequence[BufferLayout], model: str | None = None,
                                rank: int = 0, world_size: int = 1) -> Layout:
    """`buffers[j]`: the shared-memory segment of KV cache tensor j (layer j of every group)."""
    from hybridkv.connector.client import make_layout

    return make_layout(model=model or config.model, groups=[group_layout(g) for g in config.groups],
                       buffers=buffers, num_blocks=config.num_blocks, page_stride_bytes=config.page_size_bytes,
                       rank=rank, world_size=world_size)
