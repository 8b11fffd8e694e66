"""Layout validation, object groups and the kept / needed block rules, by hand (docs/design.md §6)."""

from __future__ import annotations

import pytest

from hybridkv.cache_server.registered_layout import ChunkRules, RequestError, object_groups, validate_layout
from hybridkv.catalog import find
from hybridkv.connector.client import make_layout
from hybridkv.connector.engine_layout import layout_from_kv_cache_config
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import PlannerOptions, plan
from hybridkv.wire import BufferLayout, ErrorCode, GroupKind
from tests.cache_server.helpers import make_group


def layout_of(*groups: object, num_blocks: int = 16) -> object:
    gs = list(groups)
    stride = max(g.page_bytes for g in gs)  # type: ignore[attr-defined]
    n = max(g.num_layers for g in gs)  # type: ignore[attr-defined]
    return make_layout(model="toy", groups=gs, num_blocks=num_blocks, page_stride_bytes=stride,  # type: ignore[arg-type]
                       buffers=[BufferLayout(shm_name=f"x{i}", size_bytes=num_blocks * stride) for i in range(n)])


def test_chunk_size_not_a_multiple_names_group_block_and_valid_sizes() -> None:
    layout = layout_of(make_group(block=16), make_group(kind="state", block=48))
    with pytest.raises(RequestError) as e:
        validate_layout(layout, 256)  # type: ignore[arg-type]
    assert e.value.code is ErrorCode.BAD_LAYOUT
    msg = str(e.value)
    assert "chunk size 256" in msg and "group 1's block size 48" in msg and "[48, 96, 144, 192]" in msg


def test_block_smaller_than_chunk_is_accepted_and_cross_never_gates() -> None:
    layout = layout_of(make_group(block=1), make_group(kind="cross", block=7))
    validate_layout(layout, 256)  # type: ignore[arg-type]  # block 1 < chunk: fine; cross block 7: ignored
    groups = object_groups(layout, 256, separate=True)  # type: ignore[arg-type]
    assert [(og.name, og.groups) for og in groups] == [("full", (0,))]


def test_buffer_too_small_and_rank_out_of_range() -> None:
    small = layout_of(make_group())
    bad = type(small)(**{**{f: getattr(small, f) for f in small.__struct_fields__},  # type: ignore[attr-defined]
                         "num_blocks": 1000})
    with pytest.raises(RequestError, match="expected at least num_blocks"):
        validate_layout(bad, 8)
    bad_rank = type(small)(**{**{f: getattr(small, f) for f in small.__struct_fields__},  # type: ignore[attr-defined]
                              "rank": 2})
    with pytest.raises(RequestError, match="rank 2 must be in"):
        validate_layout(bad_rank, 8)


def test_object_groups_separate_and_one() -> None:
    layout = layout_of(make_group(), make_group(kind="sliding", window=17), make_group(kind="sliding", window=13),
                       make_group(kind="sliding", window=5), make_group(kind="state", block=8),
                       make_group(kind="state", block=8), make_group(kind="chunked", window=32))
    sep = object_groups(layout, 8, separate=True)  # type: ignore[arg-type]
    # windows in chunks: ceil(16/8)=2, ceil(12/8)=2, ceil(4/8)=1; each state group its own
    assert [(og.name, og.groups) for og in sep] == [
        ("full", (0,)), ("window:2", (1, 2)), ("window:1", (3,)), ("state:g4", (4,)), ("state:g5", (5,)),
        ("chunked:32", (6,))]
    one = object_groups(layout, 8, separate=False)  # type: ignore[arg-type]
    assert [(og.name, og.groups) for og in one] == [("all", (0, 1, 2, 3, 4, 5, 6))]


def test_kept_and_needed_by_hand() -> None:
    # chunk 8 tokens; full B=4 (2 blocks per chunk), sliding W=5 B=2 (4 per chunk), state B=8, chunked C=12 B=2
    layout = layout_of(make_group(block=4), make_group(kind="sliding", block=2, window=5),
                       make_group(kind="state", block=8), make_group(kind="chunked", block=2, window=12))
    rules = ChunkRules(layout, 8)  # type: ignore[arg-type]
    assert rules.kept(0, 3) == range(2)
    assert rules.kept(1, 3) == range(2, 4)  # ceil((5-1)/2) = 2 of 4 blocks
    assert rules.kept(2, 3) == range(0, 1)
    # chunked, C=12: chunk 0 = tokens [0,8): token 7 in attention chunk [0,12) -> all 4 blocks;
    # chunk 1 = [8,16): token 15 in [12,24) -> tokens 12..15 = blocks 2,3; chunk 2 = [16,24): 24 % 12 == 0 -> none
    assert (rules.kept(3, 0), rules.kept(3, 1), rules.kept(3, 2)) == (range(4), range(2, 4), range(4, 4))
    # a hit of 3 chunks (L=24): sliding needs tokens [20,24) = chunk 2 blocks 2,3; state chunk 2; chunked nothing
    assert rules.needed(1, 2, 3) == range(2, 4) and rules.needed(1, 1, 3) == range(0)
    assert rules.needed(2, 2, 3) == range(0, 1) and rules.needed(2, 1, 3) == range(0)
    assert rules.first_needed_chunk(3, 3) == 3
    # a hit of 2 chunks (L=16): chunked needs tokens [12,16) = chunk 1 blocks 2,3
    assert rules.needed(3, 1, 2) == range(2, 4) and rules.first_needed_chunk(3, 2) == 1
    assert rules.first_needed_chunk(1, 2) == 1 and rules.first_needed_chunk(0, 2) == 0


def _planned(name: str, chunk: int | None = None) -> tuple[list[tuple[str, list[GroupKind]]], int]:
    """Object groups of a catalog model planned at 32K tokens (at or below Llama 4's 8192-token
    attention chunk the planner caches chunked layers as full attention)."""
    entry = find(name)
    assert entry is not None
    p = plan(model_spec_from_config(entry.config, name=name), PlannerOptions(memory_bytes=8 << 30, max_model_len=32768))
    chunk = chunk or p.recommended_chunk_size
    bufs = [BufferLayout(shm_name=f"t{i}", size_bytes=t.size_bytes) for i, t in enumerate(p.config.tensors)]
    layout = layout_from_kv_cache_config(p.config, buffers=bufs)
    validate_layout(layout, chunk)
    ogs = object_groups(layout, chunk, separate=True)
    assert sorted(g for og in ogs for g in og.groups) == list(range(len(layout.groups)))
    return [(og.name.split(":g")[0], [layout.groups[g].kind for g in og.groups]) for og in ogs], chunk


F, S, C, M = GroupKind.FULL, GroupKind.SLIDING, GroupKind.CHUNKED, GroupKind.STATE


@pytest.mark.parametrize(("model", "expected"), [
    # 52 sliding (W=1024) + 10 full -> 6 sliding groups of 9/8 + 1 full; ceil(1023/256) = 4 chunks
    ("gemma-3-27b", [("window:4", [S] * 6), ("full", [F])]),
    # 12 sliding (W=128) + 12 full, alternating from a sliding layer; ceil(127/256) = 1 chunk
    ("gpt-oss-20b", [("window:1", [S]), ("full", [F])]),
    # 36 chunked-local (8192) + 12 full NoPE layers -> 3 chunked groups + 1 full
    ("llama-4-scout", [("chunked:8192", [C] * 3), ("full", [F])]),
])
def test_object_groups_of_attention_models(model: str, expected: list[tuple[str, list[GroupKind]]]) -> None:
    groups, chunk = _planned(model)
    assert chunk == 256
    assert groups == expected


def test_object_groups_of_gemma3n_with_kv_sharing() -> None:
    groups, _ = _planned("gemma-3n-e4b")
    names = [n for n, _ in groups]
    # sliding W=512 -> ceil(511/256) = 2 chunks; KV-shared layers own no group
    assert names == ["window:2", "full"]
    assert all(k == S for k in groups[0][1]) and groups[1][1] == [F]


@pytest.mark.parametrize("model", ["qwen3.5-27b", "granite-4.0-h-tiny"])
def test_object_groups_of_state_hybrids(model: str) -> None:
    groups, chunk = _planned(model)
    full = [g for g in groups if g[0] == "full"]
    states = [g for g in groups if g[0] == "state"]
    assert len(full) == 1 and all(k == F for k in full[0][1])
    assert states and all(kinds == [M] for _, kinds in states)  # each state group is its own object group
    assert len(full) + len(states) == len(groups)
    assert chunk >= 256
