"""DeepSeek-V4's packed layout on the KV cache server: one shared-memory segment holds every group,
block b of each group at bytes [b * S, (b + 1) * S), the group's layers side by side in it. Each
layer of each group registers as a buffer on that segment at its offset; stores and retrieves move
exactly those pages (positions and bytes computed by hand here)."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest

from hybridkv.cache_server.registered_layout import RequestError, validate_layout
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.client import SharedKVBuffers, chunk_hashes
from hybridkv.connector.engine_layout import layout_from_kv_cache_config
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import KVCacheConfig, PlannerOptions, plan
from hybridkv.wire import BufferLayout, Layout
from tests.cache_server.helpers import running_server

CHUNK = 256  # lcm of the block sizes 64, 256, 4 and 8
SWA, C4, C128, STATE, INDEXER = 37_440, 37_440, 1_728, 32_832, 8_640  # tests/plan/test_planner_deepseek_v4.py
STRIDE = 2 * INDEXER + 2 * C4 + C128


def tiny_v4(num_blocks: int) -> KVCacheConfig:
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "head_dim": 512, "qk_rope_head_dim": 64,
              "sliding_window": 128, "index_head_dim": 128, "max_position_embeddings": 65536,
              "compress_ratios": [0, 4, 128, 4]}
    spec = model_spec_from_config(config, name="tiny-v4")
    cfg = plan(spec, PlannerOptions(memory_bytes=num_blocks * STRIDE, max_model_len=4096)).config
    assert cfg.page_size_bytes == STRIDE and cfg.num_blocks == num_blocks
    return cfg


def test_each_group_layer_is_a_buffer_at_its_offset() -> None:
    cfg = tiny_v4(16)
    layout = layout_from_kv_cache_config(cfg, buffers=[_segment("seg", cfg)])
    # group 2 = indexer(1), compressed(1), compressed(2), indexer(3), compressed(3)
    offsets = [[layout.buffers[b].offset_bytes for b in g.layer_buffers or []] for g in layout.groups]
    assert offsets == [[0, SWA], [0, SWA], [0, INDEXER, INDEXER + C4, INDEXER + C4 + C128,
                                             2 * INDEXER + C4 + C128], [0, INDEXER, INDEXER + STATE,
                                                                         2 * INDEXER + STATE], [0]]
    assert {b.shm_name for b in layout.buffers} == {"seg"}
    assert {b.page_stride_bytes for b in layout.buffers} == {STRIDE}
    validate_layout(layout, CHUNK)


def _segment(name: str, cfg: KVCacheConfig) -> BufferLayout:
    return BufferLayout(shm_name=name, size_bytes=cfg.num_blocks * STRIDE)


def test_store_and_retrieve_move_exactly_the_needed_pages() -> None:
    cfg = tiny_v4(300)
    per_chunk = [CHUNK // g.block_size for g in cfg.groups]  # 4, 4, 1, 64, 32
    ids = itertools.count(1)
    src_ids = [[next(ids) for _ in range(2 * n)] for n in per_chunk]  # 210 distinct ids: no two groups share one
    dst_ids = [[cfg.num_blocks - 1 - b for b in group] for group in src_ids]
    src_buf = SharedKVBuffers.create(num_buffers=1, size_bytes=cfg.num_blocks * STRIDE)
    dst_buf = SharedKVBuffers.create(num_buffers=1, size_bytes=cfg.num_blocks * STRIDE)
    try:
        src_buf.arrays[0][:] = np.random.default_rng(0).integers(0, 256, src_buf.arrays[0].size, dtype=np.uint8)
        src = layout_from_kv_cache_config(cfg, buffers=src_buf.buffer_layouts())
        dst = layout_from_kv_cache_config(cfg, buffers=dst_buf.buffer_layouts())
        tokens = list(range(3, 3 + 2 * CHUNK + 1))
        with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 26)) as server, \
                server.client() as c1, server.client() as c2:
            c1.register(src)
            c2.register(dst)
            hashes = chunk_hashes(tokens, CHUNK)
            assert list(c1.store(first_chunk=0, chunk_hashes=hashes, block_ids=src_ids).stored) == [True, True]
            hit = c2.lookup(hashes, num_tokens=len(tokens))
            assert hit.hit_tokens == 2 * CHUNK
            got = c2.retrieve(hit.lookup_id, block_ids=dst_ids)
        expected = np.zeros_like(dst_buf.arrays[0])
        copied = 0
        for g, spec in enumerate(cfg.groups):
            for pos in _needed(spec.block_size, spec.window_tokens, 2 * CHUNK, 2 * per_chunk[g]):
                offset = 0
                for page in spec.layer_page_bytes():
                    s, d = src_ids[g][pos] * STRIDE + offset, dst_ids[g][pos] * STRIDE + offset
                    expected[d:d + page] = src_buf.arrays[0][s:s + page]
                    offset += page
                copied += offset
        # by hand: windows 2 x 2 x SWA (each); compressed 2 blocks; ratio-4 states tokens [505, 512): 2 blocks;
        # ratio-128 states tokens [385, 512): 16 blocks
        assert copied == 2 * (2 * 2 * SWA) + 2 * STRIDE + 2 * (2 * INDEXER + 2 * STATE) + 16 * STATE
        assert got.bytes_copied == copied
        assert np.array_equal(dst_buf.arrays[0], expected)  # every needed page, and nothing else
    finally:
        src_buf.close()
        dst_buf.close()


def _needed(block: int, window: int | None, hit: int, blocks: int) -> list[int]:
    """Block positions a hit of `hit` tokens reads: all (full), else those holding tokens [hit - W + 1, hit)."""
    if not window:
        return list(range(blocks))
    return [p for p in range(blocks) if (p + 1) * block > hit - window + 1]


def test_overlapping_pages_and_bad_offsets_are_refused() -> None:
    cfg = tiny_v4(16)
    layout = layout_from_kv_cache_config(cfg, buffers=[_segment("seg", cfg)])
    shifted = list(layout.buffers)
    shifted[1] = msgspec.structs.replace(shifted[1], offset_bytes=SWA - 8)  # group 0's second layer: 8 bytes early
    with pytest.raises(RequestError, match=r"group 0: layers 0 and 1 overlap in buffer 'seg' \(a page ends at 37440, "
                                           r"the next starts at 37432\)"):
        validate_layout(_with(layout, buffers=shifted), CHUNK)
    shifted[1] = msgspec.structs.replace(shifted[1], offset_bytes=STRIDE)
    with pytest.raises(RequestError, match=rf"buffer 1 \('seg'\): offset_bytes must be in \[0, page stride {STRIDE}\)"):
        validate_layout(_with(layout, buffers=shifted), CHUNK)
    bad_index = msgspec.structs.replace(layout.groups[4], layer_buffers=[len(layout.buffers)])
    with pytest.raises(RequestError, match=r"group 4: layer_buffers must give each of its 1 layers a buffer index"):
        validate_layout(_with(layout, groups=[*layout.groups[:4], bad_index]), CHUNK)


def _with(layout: Layout, **changes: object) -> Layout:
    return msgspec.structs.replace(layout, **changes)
