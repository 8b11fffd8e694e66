"""Fixtures shared by the whole suite: a real Redis/Valkey server for the L2 tier tests.

Without redis-server the Valkey tests skip on a developer machine (`make test` installs it), but
fail under CI (the CI variable set), where a missing server means a broken install step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import BINARIES, RedisServer, server_binary


def _require_binary() -> str:
    binary = server_binary()
    if binary is not None:
        return binary
    message = (f"none of {', '.join(BINARIES)} is installed; `make test` installs Debian's redis-server "
               f"(apt-get install redis-server, as root)")
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and {message}")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer.start(tmp_path_factory.mktemp("redis"), _require_binary())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server_session: RedisServer) -> str:
    """URL of one redis-server shared by the session (127.0.0.1, a free port, no persistence).
    Tests keep apart by namespace or key prefix; a test that stops the server uses `redis_server`."""
    return redis_server_session.url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop and restart (`.stop()`, `.restart()`)."""
    server = RedisServer.start(tmp_path, _require_binary())
    yield server
    server.stop()
