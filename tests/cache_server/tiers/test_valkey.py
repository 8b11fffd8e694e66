"""ValkeyTier against a real redis-server: round trip, namespacing and framing as stored, corrupt
values dropped, errors counted and raised while the server is down, working again after restart."""

from __future__ import annotations

import socket
import struct
import time
import uuid

import pytest
import valkey
import xxhash

from hybridkv.cache_server.tiers import TierError, ValkeyTier, framing
from hybridkv.errors import ConfigError
from tests.redis_server import RedisServer


def fresh_namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def raw_client(url: str) -> valkey.Valkey:
    return valkey.Valkey.from_url(url)


def test_round_trip_overwrite_delete(redis_url: str) -> None:
    tier = ValkeyTier(redis_url, namespace=fresh_namespace())
    tier.put(b"a", b"alpha")
    tier.put(b"mv", memoryview(bytes(range(256)) * 100))
    tier.put(b"empty", b"")
    assert tier.get(b"a") == b"alpha"
    assert tier.get(b"mv") == bytes(range(256)) * 100
    assert tier.get(b"empty") == b""
    assert tier.get(b"missing") is None
    assert tier.contains([b"a", b"missing", b"empty"]) == [True, False, True]
    assert tier.contains([]) == []
    tier.put(b"a", b"second")
    assert tier.get(b"a") == b"second"
    tier.delete(b"a")
    assert tier.get(b"a") is None
    tier.close()


def test_stored_as_namespaced_checksummed_frames(redis_url: str) -> None:
    ns = fresh_namespace()
    tier = ValkeyTier(redis_url, namespace=ns)
    tier.put(b"\x00key", b"value bytes")
    stored = raw_client(redis_url).get(f"hybridkv:{ns}:".encode() + b"\x00key")
    # Hand-decode the frame layout documented in framing.py.
    magic, version, flags, key_len, value_len, checksum = struct.unpack_from("<4sHHIQQ", stored)
    assert (magic, version, flags, key_len, value_len) == (b"HKVO", 1, 0, 4, 11)
    assert stored[28:] == b"\x00key" + b"value bytes"
    assert checksum == xxhash.xxh3_64_intdigest(stored[:20] + b"\x00key" + b"value bytes")
    tier.close()


def test_clear_and_stats_cover_only_the_namespace(redis_url: str) -> None:
    mine, other = ValkeyTier(redis_url, namespace=fresh_namespace(), stats_refresh_s=0), ValkeyTier(
        redis_url, namespace=fresh_namespace(), stats_refresh_s=0)
    raw = raw_client(redis_url)
    raw.set(b"not-hybridkv", b"x")
    for i in range(5):
        mine.put(b"k%d" % i, b"v" * 100)
    other.put(b"k0", b"w")
    stats = mine.stats()
    assert (stats.objects, stats.bytes_used, stats.errors) == (5, 5 * (28 + 2 + 100), 0)
    mine.clear()
    assert mine.contains([b"k0", b"k4"]) == [False, False]
    assert mine.stats().objects == 0
    assert other.get(b"k0") == b"w"
    assert raw.get(b"not-hybridkv") == b"x"
    mine.close()
    other.close()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "other key's frame"])
def test_a_corrupt_value_is_dropped_counted_and_never_returned(redis_url: str, damage: str) -> None:
    ns = fresh_namespace()
    tier = ValkeyTier(redis_url, namespace=ns)
    raw = raw_client(redis_url)
    name = f"hybridkv:{ns}:victim".encode()
    tier.put(b"victim", b"v" * 1000)
    tier.put(b"other", b"v" * 1000)
    if damage == "flipped byte":
        raw.setrange(name, 500, b"\xff")
    elif damage == "truncated":
        raw.set(name, raw.get(name)[:-1])
    else:
        raw.set(name, raw.get(f"hybridkv:{ns}:other".encode()))
    assert tier.get(b"victim") is None
    assert raw.exists(name) == 0
    assert tier.get(b"other") == b"v" * 1000
    assert tier.stats().corrupt_dropped == 1
    tier.close()


def test_a_frame_of_another_format_version_is_ignored_not_deleted(redis_url: str) -> None:
    ns = fresh_namespace()
    tier = ValkeyTier(redis_url, namespace=ns)
    raw = raw_client(redis_url)
    name = f"hybridkv:{ns}:newer".encode()
    tier.put(b"newer", b"payload")
    raw.setrange(name, 4, (framing.FORMAT_VERSION + 1).to_bytes(2, "little"))
    assert tier.get(b"newer") is None
    assert raw.exists(name) == 1
    assert tier.stats().corrupt_dropped == 0
    tier.close()


def test_server_down_raises_and_counts_then_recovers_after_restart(redis_server: RedisServer) -> None:
    tier = ValkeyTier(redis_server.url, namespace=fresh_namespace(), timeout_s=1.0, retry_after_s=0,
                      stats_refresh_s=0)
    tier.put(b"before", b"1")
    assert tier.ping()
    redis_server.stop()
    for op in (lambda: tier.put(b"k", b"v"), lambda: tier.get(b"before"), lambda: tier.contains([b"k"]),
               lambda: tier.delete(b"k"), tier.clear):
        with pytest.raises(TierError, match=f"valkey .* at 127.0.0.1:{redis_server.port} failed: ConnectionError"):
            op()
    assert not tier.ping()
    down = tier.stats()  # never raises; reports what it last knew, counts the failed scan
    assert down.errors == 6
    redis_server.restart()  # a fresh, empty server on the same port
    tier.put(b"after", b"2")  # the pool's stale connection is replaced without an error
    assert tier.get(b"after") == b"2"
    assert tier.get(b"before") is None  # nothing was persisted
    assert tier.stats().errors == 6
    redis_server.restart()  # restarted between two commands: the pooled connection is stale
    assert tier.get(b"after") is None
    assert tier.stats().errors == 6
    tier.close()


def test_after_a_connection_failure_commands_fail_fast_until_retry_after(redis_server: RedisServer) -> None:
    tier = ValkeyTier(redis_server.url, namespace=fresh_namespace(), timeout_s=1.0, retry_after_s=0.5)
    redis_server.stop()
    with pytest.raises(TierError, match="failed: ConnectionError"):
        tier.get(b"k")
    redis_server.restart()
    with pytest.raises(TierError, match=r"skipped: the server was unreachable, next try in 0\.\d\d s"):
        tier.put(b"k", b"v")  # within retry_after_s: not even tried
    time.sleep(0.5)
    tier.put(b"k", b"v")
    assert tier.get(b"k") == b"v"
    assert tier.stats().errors == 2
    tier.close()


def test_a_silent_server_costs_one_timeout_not_one_per_command() -> None:
    """A server that accepts connections and never answers (a vanished host looks the same)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes handshakes; nothing ever reads or replies
        tier = ValkeyTier(f"redis://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.2, retry_after_s=30)
        start = time.monotonic()
        with pytest.raises(TierError, match="failed: TimeoutError"):
            tier.contains([b"k"])
        first_s = time.monotonic() - start
        start = time.monotonic()
        for _ in range(20):
            with pytest.raises(TierError, match="skipped"):
                tier.get(b"k")
        rest_s = time.monotonic() - start
        assert 0.2 <= first_s < 2.0 and rest_s < 0.1, (first_s, rest_s)
        assert tier.stats().errors == 22  # the skipped namespace scan of stats() counts too
        tier.close()


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"must look like redis://HOST:PORT\[/DB\] \(schemes: redis, rediss"):
        ValkeyTier("http://127.0.0.1:6379")
    with pytest.raises(ConfigError, match="namespace 'a b' must be 1-64 of"):
        ValkeyTier("redis://127.0.0.1:1", namespace="a b")
