"""An L2 outage logs a warning every few seconds, not one per operation (issue 25: ~700 lines/s
before); every failure is still counted in the metrics."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from hybridkv.cache_server.l2 import TierSet
from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.cache_server.tiers.base import RateLimitedWarnings, TierError
from tests.cache_server.tiers.fakes import DictTier


class DownTier(DictTier):
    name = "valkey"

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        raise TierError("connection refused (127.0.0.1:6379)")

    def get(self, key: bytes) -> bytes | None:
        raise TierError("connection refused (127.0.0.1:6379)")


def test_an_outage_logs_once_per_interval_and_counts_every_failure(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics()
    tiers = TierSet([DownTier()], metrics)
    try:
        with caplog.at_level(logging.WARNING, logger="hybridkv.cache_server.l2"):
            for i in range(700):
                assert tiers.where([bytes([i % 256]) * 8]) == [None]
                assert tiers.get(0, b"k", 8) is None
    finally:
        tiers.close(1.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["L2 tier valkey: contains failed: connection refused (127.0.0.1:6379)",
                     "L2 tier valkey: get failed: connection refused (127.0.0.1:6379)"]
    assert metrics.registry.get_sample_value("hybridkv_server_l2_errors_total", {"tier": "valkey"}) == 1400


def test_the_next_line_says_how_many_were_left_out(caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("hybridkv.cache_server.tiers.base.time.monotonic", lambda: now[0])
    warnings = RateLimitedWarnings(logging.getLogger("t"), interval_s=10.0)
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(5):
            warnings.warn("a", "down")
        warnings.warn("b", "other")  # another key is not held back
        now[0] += 10.5
        warnings.warn("a", "down")
    assert [r.getMessage() for r in caplog.records] == ["down", "other", "down (4 more like it in the last 10 s)"]
