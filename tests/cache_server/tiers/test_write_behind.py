"""WriteBehind against a dict tier: every submitted object lands, a full queue refuses and counts,
failed puts are counted and do not stop the thread, close accounts for what it leaves."""

from __future__ import annotations

import pytest

from hybridkv.cache_server.tiers import WriteBehind, WriteBehindStats
from tests.cache_server.tiers.fakes import DictTier


def test_every_submitted_object_is_written_after_flush() -> None:
    tier = DictTier()
    wb = WriteBehind(tier, max_pending=1000)
    want = {f"k{i}".encode(): bytes([i % 256]) * (i + 1) for i in range(200)}
    for k, v in want.items():
        assert wb.submit(k, v)
    assert wb.flush(timeout_s=10.0)
    assert tier.objects == want
    assert wb.stats() == WriteBehindStats(pending=0, written=200, failed=0, dropped=0)
    wb.close()


def test_full_queue_refuses_counts_and_recovers() -> None:
    tier = DictTier()
    tier.gate.clear()  # the writer blocks inside its first put
    wb = WriteBehind(tier, max_pending=3)
    assert wb.submit(b"a", b"1")
    assert tier.entered.wait(timeout=10.0)  # the writer holds "a": the queue has 3 free slots
    accepted = [wb.submit(k, b"x") for k in (b"b", b"c", b"d", b"e", b"f")]
    assert accepted == [True, True, True, False, False]
    assert wb.stats() == WriteBehindStats(pending=4, written=0, failed=0, dropped=2)
    assert not wb.flush(timeout_s=0.05)  # still blocked
    tier.gate.set()
    assert wb.flush(timeout_s=10.0)
    assert sorted(tier.objects) == [b"a", b"b", b"c", b"d"]
    assert wb.submit(b"g", b"y")  # room again
    assert wb.flush(timeout_s=10.0)
    assert wb.stats() == WriteBehindStats(pending=0, written=5, failed=0, dropped=2)
    wb.close()


def test_failed_puts_are_counted_and_the_thread_goes_on() -> None:
    tier = DictTier()
    tier.fail_keys = {b"bad1", b"bad2"}
    wb = WriteBehind(tier, max_pending=10)
    for k in (b"ok1", b"bad1", b"ok2", b"bad2", b"ok3"):
        assert wb.submit(k, k)
    assert wb.flush(timeout_s=10.0)
    assert sorted(tier.objects) == [b"ok1", b"ok2", b"ok3"]
    assert wb.stats() == WriteBehindStats(pending=0, written=3, failed=2, dropped=0)
    wb.close()


def test_close_writes_what_is_queued_then_refuses() -> None:
    tier = DictTier()
    wb = WriteBehind(tier, max_pending=10)
    for i in range(5):
        wb.submit(bytes([i]), b"v")
    wb.close()
    assert len(tier.objects) == 5
    assert not wb.submit(b"late", b"v")
    assert wb.stats() == WriteBehindStats(pending=0, written=5, failed=0, dropped=1)


def test_close_with_a_stuck_tier_counts_the_unwritten_as_dropped() -> None:
    tier = DictTier()
    tier.gate.clear()
    wb = WriteBehind(tier, max_pending=10)
    for i in range(4):
        wb.submit(bytes([i]), b"v")
    wb.close(timeout_s=0.05)
    stats = wb.stats()
    assert (stats.pending, stats.written, stats.dropped) == (0, 0, 4)
    tier.gate.set()  # let the abandoned writer thread finish its put


def test_max_pending_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_pending must be >= 1, got 0"):
        WriteBehind(DictTier(), max_pending=0)


def test_deletes_run_in_order_with_puts() -> None:
    """A delete queued after a put of the same key removes it; one queued before a put does not (the
    sized tiers queue the deletions that make room before the write they make room for)."""
    tier = DictTier()
    tier.objects[b"old"] = b"o"
    tier.gate.clear()  # hold the writer so everything below is queued before any of it runs
    wb = WriteBehind(tier, max_pending=10)
    assert wb.submit(b"a", b"1") and wb.delete(b"a")
    assert wb.delete(b"b") and wb.submit(b"b", b"2")
    assert wb.delete(b"old")
    tier.gate.set()
    assert wb.flush(timeout_s=10.0)
    assert tier.objects == {b"b": b"2"}
    assert wb.stats() == WriteBehindStats(pending=0, written=2, failed=0, dropped=0, deleted=3)
    wb.close()
