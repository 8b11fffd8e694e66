"""Multi-page states on the server: registration, validation, one object group per state, by hand."""

from __future__ import annotations

import msgspec
import pytest
import xxhash

from hybridkv.cache_server.registered_layout import ChunkRules, RequestError, object_groups, validate_layout
from hybridkv.catalog import find
from hybridkv.connector.engine_layout import layout_from_kv_cache_config
from hybridkv.plan.model_specs import model_spec_from_config
from hybridkv.plan.planner import GIB, PlannerOptions, StateLayout, plan
from hybridkv.wire import BufferLayout, GroupKind, layout_fingerprint
from tests.cache_server.helpers import make_group
from tests.cache_server.test_layout import layout_of


def pages(k: int, *, block: int = 8) -> list[object]:
    return [msgspec.structs.replace(make_group(kind="state", block=block), state_page=s, state_pages=k)
            for s in range(k)]


def test_a_states_pages_form_one_object_group() -> None:
    layout = layout_of(make_group(block=8), *pages(3), *pages(2))
    validate_layout(layout, 8)  # type: ignore[arg-type]
    groups = object_groups(layout, 8, separate=True)  # type: ignore[arg-type]
    assert [(og.name, og.groups) for og in groups] == [("full", (0,)), ("state:g1", (1, 2, 3)), ("state:g4", (4, 5))]
    # one object per chunk holds every page of the state: 3 pages x 1 layer x page bytes
    rules = ChunkRules(layout, 8)  # type: ignore[arg-type]
    assert rules.object_bytes(groups[1], 0) == 3 * 64  # 3 pages x 1 layer x 64-byte pages
    assert rules.object_bytes(groups[2], 0) == 2 * 64


@pytest.mark.parametrize("groups", [
    [make_group(block=8), *pages(3)[:2]],  # page 2 of 3 missing
    [make_group(block=8), *reversed(pages(2))],  # out of order
    [msgspec.structs.replace(make_group(block=8), state_pages=2)],  # attention spanning pages
    [*pages(2)[:1], *pages(2, block=16)[1:]],  # pages of one state with different blocks
])
def test_inconsistent_state_pages_are_refused(groups: list[object]) -> None:
    with pytest.raises(RequestError, match="consecutive state groups"):
        validate_layout(layout_of(*groups), 16)  # type: ignore[arg-type]


def test_engine_registration_of_a_multi_page_plan() -> None:
    entry = find("Qwen/Qwen3.5-0.8B")
    assert entry is not None
    spec = model_spec_from_config(entry.config, name=entry.hf_id)
    for layout in StateLayout:
        result = plan(spec, PlannerOptions(memory_bytes=GIB, max_model_len=1024, state_layout=layout))
        config, chunk = result.config, result.recommended_chunk_size  # 544 (one page) or 256
        buffers = [BufferLayout(shm_name=f"t{i}", size_bytes=t.size_bytes) for i, t in enumerate(config.tensors)]
        registered = layout_from_kv_cache_config(config, buffers=buffers)
        validate_layout(registered, chunk)
        states = [g for g in registered.groups if g.kind is GroupKind.STATE]
        if layout is StateLayout.ONE_PAGE:
            assert {(g.state_pages, g.page_bytes) for g in states} == {(1, 1_085_440)}
            continue
        assert [g.state_page for g in states] == list(range(17)) * 3  # 32-token blocks: 65,536-byte pages
        assert {(g.state_pages, g.page_bytes) for g in states} == {(17, 65_536)}
        assert chunk == 256
        names = [og.name for og in object_groups(registered, chunk, separate=True)]
        assert names == ["state:g0", "state:g17", "state:g34", "full"]



def test_one_page_fingerprints_are_unchanged_and_pages_change_them() -> None:
    """The fingerprint is xxh3-128 of msgpack [model, per group the fields below]; a one-page group's
    fields are what they were before state pages existed, so keys already in an L2 tier stay valid."""
    group = make_group(kind="state", block=8)
    fields = {"kind": "state", "num_layers": 1, "block_tokens": 8, "page_bytes": 64, "window_tokens": -1}
    assert layout_fingerprint("m", [group]) == xxhash.xxh3_128_hexdigest(msgspec.msgpack.encode(["m", [fields]]))
    first, second = pages(2)
    with_pages = [{**fields, "state_page": 0, "state_pages": 2}, {**fields, "state_page": 1, "state_pages": 2}]
    assert layout_fingerprint("m", [first, second]) == xxhash.xxh3_128_hexdigest(  # type: ignore[list-item]
        msgspec.msgpack.encode(["m", with_pages]))
