"""The table's bounds and refusals, by hand: the block budget, multimodal blocks, unknown parents and
removals, duplicate copies, salts kept as digests; the CLI's bind rules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.index.service import IndexService, Query
from hybridkv.index.table import Registration
from hybridkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from tests.index.test_index_service import LossyPublisher, wait_for

KEY = ("default", "e0", 0)
TOKENS = list(range(1, 17))  # 4 blocks of 4


def stored(tokens: list[int], *, first: int = 1, parent: int | None = None, extra: list[object] | None = None,
           group: int = 0) -> BlockStored:
    return BlockStored(block_hashes=list(range(first, first + len(tokens) // 4)), parent_block_hash=parent,
                       token_ids=tokens, block_size=4, lora_id=None, medium="GPU", lora_name=None, extra_keys=extra,
                       group_idx=group, kv_cache_spec_kind="full_attention")


def service(max_blocks: int = 100) -> IndexService:
    s = IndexService(subscribe=False, max_blocks=max_blocks)
    s.register(Registration(key=KEY, model="m", lora_name=None, block_size=4), None, None)
    return s


def hit(s: IndexService, tokens: list[int], salt: str | None = None) -> int:
    return int(s.query(Query(model="m", token_ids=[*tokens, 0], cache_salt=salt))["default"]["e0"]["longest_matched"])


def apply(s: IndexService, *events: object) -> None:
    s.apply(KEY, EventBatch(ts=0.0, events=list(events)))  # type: ignore[arg-type]


def test_blocks_over_the_budget_are_counted_not_indexed() -> None:
    s = service(max_blocks=3)
    apply(s, stored(TOKENS))  # 4 blocks > 3: refused whole
    assert hit(s, TOKENS) == 0 and s.table.counts.skipped_blocks == 4 and s.table.num_blocks == 0
    apply(s, stored(TOKENS[:12]))
    assert hit(s, TOKENS) == 12


def test_multimodal_blocks_and_unknown_parents_are_not_indexed() -> None:
    s = service()
    apply(s, stored(TOKENS[:8], extra=[["img-hash", 0], None]))  # (a multimodal item: tokens do not identify it)
    apply(s, stored(TOKENS[8:], first=9, parent=12345))
    assert hit(s, TOKENS) == 0 and s.table.counts.unplaced_blocks == 4


def test_unknown_removals_are_counted_and_a_clear_empties() -> None:
    s = service()
    apply(s, stored(TOKENS), BlockRemoved(block_hashes=[999], medium="GPU", group_idx=0))
    assert s.table.counts.unknown_removals == 1 and hit(s, TOKENS) == 16
    apply(s, AllBlocksCleared())
    assert hit(s, TOKENS) == 0 and s.table.num_blocks == 0


def test_a_second_copy_keeps_the_block_through_one_removal() -> None:
    s = service()
    apply(s, stored(TOKENS[:4], first=1), stored(TOKENS[:4], first=1))
    apply(s, BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0))
    assert hit(s, TOKENS) == 4
    apply(s, BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0))
    assert hit(s, TOKENS) == 0


def test_salts_are_kept_as_digests_only() -> None:
    s = service()
    apply(s, stored(TOKENS[:8], extra=[["tenant-a-salt"], None]))
    assert hit(s, TOKENS, salt="tenant-a-salt") == 8 and hit(s, TOKENS) == 0
    assert "tenant-a-salt" not in repr(vars(s.table)) + repr(s.table.registrations)  # (contexts keyed by a digest)


def test_garbage_on_the_wire_is_counted_and_skipped() -> None:
    s = IndexService(probe_every_s=0.2, dead_after_s=30.0)
    pub = LossyPublisher()
    s.register(Registration(key=KEY, model="m", lora_name=None, block_size=4), pub.endpoint, pub.replay_endpoint)
    time.sleep(0.3)
    pub.pub.send_multipart((b"", b"\x00" * 8, b"not msgpack"))
    pub.pub.send_multipart((b"only one frame",))
    pub.send([stored(TOKENS)])
    try:
        assert s.subscriber is not None
        wait_for(lambda: s.subscriber is not None and s.subscriber.counts.bad_messages >= 2 and hit(s, TOKENS) == 16)
    finally:
        pub.close()
        s.close()


@pytest.mark.parametrize(("args", "needle"), [
    (["--host", "0.0.0.0"], "not a loopback address"),
    (["--host", "0.0.0.0", "--allow-remote"], "needs a token"),
    (["--max-blocks", "0"], "must be positive"),
])
def test_the_index_cli_refuses_unsafe_or_bad_settings(args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.delenv("HYBRIDKV_INDEX_TOKEN", raising=False)
    result = CliRunner().invoke(app, ["index", *args])
    assert result.exit_code == 2 and needle in result.output


def test_a_short_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("short")
    result = CliRunner().invoke(app, ["index", "--auth-token-file", str(tmp_path / "t")])
    assert result.exit_code == 2 and "at least 16" in result.output


def sparse(hashes: list[int], tokens: list[int], *, parent: int | None = None) -> BlockStored:
    """vLLM's event for a sliding-window group (window 5 over 4-token blocks: ceil(4 / 4) = 1 block
    needed before a hit point) whose earlier blocks of the range were null: fewer hashes than blocks."""
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=5)


def test_sparse_events_are_placed_by_engine_hash() -> None:
    """As vLLM 0.32 sends them: the window group's event (only block 3 of 4 stored, all 16 tokens)
    before the full group's in the same batch. Block 3 is where the full group put hash 4, so the
    joint hit is 16 tokens (full blocks 0-3, window block 3 just before p = 16); placed at block 0
    instead it would be 4."""
    s = service()
    apply(s, sparse([4], TOKENS), stored(TOKENS, group=0))
    assert hit(s, TOKENS) == 16
    apply(s, BlockRemoved(block_hashes=[4], medium="GPU", group_idx=1))
    assert hit(s, TOKENS) == 0  # (no window block anywhere: only p = 0 is served)


def test_a_sparse_event_with_unknown_hashes_takes_the_ranges_last_blocks() -> None:
    """No other group named its hash: the stored blocks are the range's last (a window's tail)."""
    s = service()
    apply(s, stored(TOKENS, group=0))
    apply(s, sparse([99], TOKENS[:8]))  # (hash 99 unknown: block 1 of the first 8 tokens)
    assert hit(s, TOKENS[:8]) == 8
    assert hit(s, TOKENS) == 8  # (the window holds block 1 only: p = 8 is the longest it serves)
