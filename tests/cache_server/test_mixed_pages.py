"""Groups of mixed pages (MLA latents + indexer keys, MiniMax-M3's K/V + indexer keys): each layer of the
group has its own page size and its buffer its own block stride; stores and retrieves move exactly those
pages (hand-computed bytes), and layouts without them keep their fingerprints."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.cache_server.registered_layout import ChunkRules, RequestError, validate_layout
from hybridkv.cache_server.store import StoreConfig
from hybridkv.catalog import find
from hybridkv.connector.client import chunk_hashes
from hybridkv.connector.engine_layout import layout_from_kv_cache_config
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import PlannerOptions, plan
from hybridkv.wire import BufferLayout, GroupKind, GroupLayout, layout_fingerprint
from tests.cache_server.helpers import fake_engine, make_group, running_server

CHUNK = 8
# group 0: 3 layers of 64 / 16 / 24 B pages, B = 4 (2 blocks per chunk); group 1: sliding W = 5, B = 4, 2 layers of 32 B
GROUPS = [make_group(block=4, layer_pages=[64, 16, 24]), make_group(kind="sliding", block=4, window=5, layers=2,
                                                                    page=32)]
N_CHUNKS = 4


def test_object_bytes_and_offsets_by_hand() -> None:
    with fake_engine(GROUPS, num_blocks=16) as engine:
        strides = [b.page_stride_bytes for b in engine.layout.buffers]
        assert strides == [64, 32, 24]  # the largest page of each layer slot
        validate_layout(engine.layout, CHUNK)
        rules = ChunkRules(engine.layout, CHUNK)
        assert rules.section_block_bytes(0) == 64 + 16 + 24 and rules.layer_pages(0) == [64, 16, 24]
        assert rules.section_block_bytes(1) == 2 * 32 and rules.layer_pages(1) == [32, 32]


def test_store_and_retrieve_round_trip_the_exact_pages() -> None:
    tokens = list(range(7, 7 + N_CHUNKS * CHUNK + 1))
    with running_server(StoreConfig(chunk_tokens=CHUNK, l1_bytes=1 << 20)) as server, \
            fake_engine(GROUPS, num_blocks=32) as src, fake_engine(GROUPS, num_blocks=32, seed=None) as dst, \
            server.client() as c1, server.client() as c2:
        c1.register(src.layout)
        reg = c2.register(dst.layout)
        assert [og.name for og in reg.object_groups] == ["full", "window:1"]
        hashes = chunk_hashes(tokens, CHUNK)
        src_ids = [[1 + i for i in range(2 * N_CHUNKS)], [12 + i for i in range(2 * N_CHUNKS)]]
        assert list(c1.store(first_chunk=0, chunk_hashes=hashes, block_ids=src_ids).stored) == [True] * N_CHUNKS
        # full: 4 chunks x 2 blocks x (64 + 16 + 24); sliding W=5: the last ceil(4 / 4) = 1 block x 2 x 32 per chunk
        assert server.metric("hybridkv_server_bytes_in_total") == 4 * 2 * 104 + 4 * 64
        hit = c2.lookup(hashes, num_tokens=len(tokens))
        assert hit.hit_tokens == N_CHUNKS * CHUNK
        dst_ids = [[20 + i for i in range(2 * N_CHUNKS)], [2 + i for i in range(2 * N_CHUNKS)]]
        got = c2.retrieve(hit.lookup_id, block_ids=dst_ids)
        assert got.bytes_copied == 4 * 2 * 104 + 64  # sliding: only tokens [28, 32): the last block
        expected = [np.zeros_like(a) for a in dst.buffers.arrays]
        wanted = {0: range(2 * N_CHUNKS), 1: range(2 * N_CHUNKS - 1, 2 * N_CHUNKS)}
        for gid, g in enumerate(GROUPS):
            pages = g.layer_page_bytes or [g.page_bytes] * g.num_layers
            stride = [b.page_stride_bytes for b in dst.layout.buffers]
            for pos in wanted[gid]:
                for layer, page in enumerate(pages):
                    start = dst_ids[gid][pos] * stride[layer]
                    expected[layer][start:start + page] = src.page(gid, layer, src_ids[gid][pos])
        for layer, (have, want) in enumerate(zip(dst.buffers.arrays, expected, strict=True)):
            assert np.array_equal(have, want), f"buffer {layer}"  # nothing else written


def test_bad_mixed_groups_are_refused() -> None:
    with fake_engine(GROUPS, num_blocks=16) as engine:
        layout = engine.layout
        bad_pages = GroupLayout(kind=GroupKind.FULL, num_layers=3, block_tokens=4, page_bytes=64,
                                layer_page_bytes=[64, 16])
        with pytest.raises(RequestError, match=r"layer_page_bytes must list 3 positive page sizes .* got \[64, 16\]"):
            validate_layout(type(layout)(**{**_fields(layout), "groups": [bad_pages]}), CHUNK)
        narrow = [BufferLayout(shm_name=b.shm_name, size_bytes=b.size_bytes, page_stride_bytes=16)
                  for b in layout.buffers]
        with pytest.raises(RequestError, match="layer 0's page of 64 bytes exceeds the page stride 16 of buffer 0"):
            validate_layout(type(layout)(**{**_fields(layout), "buffers": narrow}), CHUNK)


def _fields(layout: object) -> dict[str, object]:
    return {f: getattr(layout, f) for f in layout.__struct_fields__}  # type: ignore[attr-defined]


def test_fingerprints_of_single_page_layouts_are_unchanged() -> None:
    groups = [GroupLayout(kind=GroupKind.FULL, num_layers=2, block_tokens=16, page_bytes=4096),
              GroupLayout(kind=GroupKind.SLIDING, num_layers=2, block_tokens=16, page_bytes=4096, window_tokens=64)]
    assert layout_fingerprint("m", groups) == "11112b968acb908f006cd16d627081d2"  # computed before the new field
    mixed = [make_group(block=16, layer_pages=[4096, 512])]
    assert layout_fingerprint("m", mixed) != layout_fingerprint("m", [make_group(block=16, layers=2, page=4096)])


def test_deepseek_v32_and_minimax_m3_layouts_register() -> None:
    for name, pages in (("deepseek-v3.2", [64 * 1152] * 61 + [64 * 132] * 61),
                        ("minimax-m3", [128 * 2048] * 60 + [128 * 256] * 57)):
        entry = find(name)
        assert entry is not None
        p = plan(model_spec_from_config(entry.config, name=name), PlannerOptions(memory_bytes=8 << 30,
                                                                                 max_model_len=32768))
        bufs = [BufferLayout(shm_name=f"t{i}", size_bytes=t.size_bytes) for i, t in enumerate(p.config.tensors)]
        layout = layout_from_kv_cache_config(p.config, buffers=bufs)
        (group,) = layout.groups
        assert group.layer_page_bytes == pages and group.page_bytes == max(pages), name
        assert [b.page_stride_bytes for b in layout.buffers] == pages, name
        validate_layout(layout, p.recommended_chunk_size)
        assert ChunkRules(layout, 256).section_block_bytes(0) == sum(pages) == p.config.page_size_bytes, name
