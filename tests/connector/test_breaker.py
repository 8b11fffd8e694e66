"""A KV cache server that is absent, killed or hung must not stall the engine (issue 26 item 9,
issue 25): the connector fails fast (a dead endpoint costs the connect bound, not a reply
timeout), then leaves the server alone (circuit breaker) and probes it again with backoff; a server
back on its port is used again. Counts of calls that reached the network are the measure here;
the elapsed-time bounds are loose (this machine is shared)."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from hybridkv.connector.client import KVClient
from hybridkv.connector.server_process import ServerProcess
from hybridkv.connector.transfer import ServerConnector
from hybridkv.wire import AnyReply, Request
from tests.cache_server.helpers import FakeEngine, fake_engine, make_group, start_server_process

CHUNK = 16
GROUPS = [make_group(block=16, page=64)]


@dataclass
class Req:
    request_id: str
    token_ids: list[int] = field(default_factory=lambda: list(range(3 * CHUNK + 1)))
    cache_salt: str | None = None


class CountingClient(KVClient):
    """A KVClient that counts the requests it tried to send (each costs the network)."""

    attempts = 0

    def _roundtrip(self, req: Request, timeout_s: float) -> AnyReply:
        self.attempts += 1
        return super()._roundtrip(req, timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    with fake_engine(GROUPS) as eng:
        yield eng


def test_nothing_listening_costs_one_connect_bound_then_nothing(engine: FakeEngine) -> None:
    client = CountingClient(f"tcp://127.0.0.1:{_free_port()}", timeout_s=5.0)
    start = time.monotonic()
    connector = ServerConnector(client, engine.layout, retry_after_s=60.0)
    try:
        hits = [connector.get_num_new_matched_tokens(Req(f"r{i}"), 0) for i in range(50)]
        elapsed = time.monotonic() - start
    finally:
        connector.close()
    assert hits == [0] * 50 and not connector.reachable
    assert client.attempts == 1  # the registration's hello; the breaker skipped the server 50 times
    assert connector.stats.errors == 1
    assert elapsed < 3.0  # the old connector waited 2 x 5 s for the registration alone


@pytest.mark.slow
def test_a_killed_server_is_skipped_probed_with_backoff_and_used_again(engine: FakeEngine) -> None:
    port = _free_port()
    server: ServerProcess = start_server_process("--port", str(port), "--chunk-size", str(CHUNK))
    client = CountingClient(f"tcp://127.0.0.1:{port}", timeout_s=5.0)
    connector = ServerConnector(client, engine.layout, retry_after_s=0.3)
    try:
        assert connector.reachable
        assert connector.get_num_new_matched_tokens(Req("warm"), 0) == 0  # a miss, answered
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        before, start = client.attempts, time.monotonic()
        for i in range(40):
            connector.get_num_new_matched_tokens(Req(f"k{i}"), 0)
        assert time.monotonic() - start < 3.0  # not seconds per call
        assert client.attempts - before <= 2  # the failing call (+ at most one probe); the rest skipped
        assert not connector.reachable
        server.stop()
        server = start_server_process("--port", str(port), "--chunk-size", str(CHUNK))  # back on its port
        deadline = time.monotonic() + 20
        while not connector.reachable and time.monotonic() < deadline:
            connector.get_num_new_matched_tokens(Req("probe"), 0)
            time.sleep(0.05)
        assert connector.reachable  # probed, registered again (the new server never knew it)
        assert connector.registration is not None
    finally:
        connector.close()
        server.stop()


def test_a_hung_server_is_probed_with_backoff_a_dead_one_at_a_steady_pace(engine: FakeEngine) -> None:
    ctx = zmq.Context()
    hung = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = hung.bind_to_random_port("tcp://127.0.0.1")
    client = CountingClient(f"tcp://127.0.0.1:{port}", timeout_s=0.05)
    connector = ServerConnector(client, engine.layout, retry_after_s=0.1)
    try:
        waits = []
        for _ in range(4):
            waits.append(round(connector._backoff_s, 2))
            connector._down_until = 0.0  # the wait is over: the next call probes (and times out again)
            connector.get_num_new_matched_tokens(Req("x"), 0)
        assert waits == [0.1, 0.2, 0.4, 0.8]
        for _ in range(5):
            connector._down_until = 0.0
            connector.get_num_new_matched_tokens(Req("x"), 0)
        assert connector._backoff_s == pytest.approx(0.8)  # capped at 8 x retry_after_s
        assert client.attempts == 1 + 4 + 5  # the registration, then one probe per expired wait
    finally:
        connector.close()
        hung.close(linger=0)
        ctx.term()
    dead = ServerConnector(KVClient(f"tcp://127.0.0.1:{_free_port()}", connect_timeout_s=0.05), engine.layout,
                           retry_after_s=0.1)
    try:
        for _ in range(4):
            dead._down_until = 0.0
            dead.get_num_new_matched_tokens(Req("x"), 0)
        assert dead._backoff_s == pytest.approx(0.1)  # nothing listens: a probe is cheap, the pace stays
    finally:
        dead.close()
