"""The router keeps its connections to engines and the index alive: N routed requests open a
bounded number of connections, counted from outside the router by TCP relays in front of each
upstream; a kept-alive connection the server closed meanwhile is replaced without an error."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from hybridkv.index.http import AppServer
from hybridkv.index.service import IndexService
from hybridkv.openai_api.http_server import ServeServer
from hybridkv.route.app import RouteConfig
from hybridkv.route.app import make_app as make_route_app
from hybridkv.route.picker import Engine
from hybridkv.route.upstream import ConnectionPool
from tests.route.test_route import MODEL, call, cluster  # noqa: F401  (the module's engines and index)

Cluster = tuple[list[ServeServer], AppServer, IndexService]


class CountingRelay:
    """A TCP relay to `target` (http://host:port) that counts the connections made through it and
    can drop every open one at once (as a server closes idle kept-alive connections)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self.accepted += 1
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def drop_all(self) -> None:
        with self._lock:
            sockets, self._open = self._open, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
        self.drop_all()


@pytest.fixture
def relays(cluster: Cluster) -> Iterator[tuple[list[CountingRelay], CountingRelay]]:  # noqa: F811
    engines, index, _ = cluster
    to_engines = [CountingRelay(e.url) for e in engines]
    to_index = CountingRelay(index.url)
    yield to_engines, to_index
    for relay in (*to_engines, to_index):
        relay.close()


def test_n_routed_requests_open_a_bounded_number_of_connections(
        cluster: Cluster, relays: tuple[list[CountingRelay], CountingRelay]) -> None:  # noqa: F811
    engines, _, _ = cluster
    to_engines, to_index = relays
    cfg = RouteConfig(engines=[Engine(url=r.url, instance_id=e.url) for r, e in zip(to_engines, engines, strict=True)],
                      index_url=to_index.url, model=MODEL, poll_every_s=0.2)
    route = AppServer(make_route_app(cfg), lifespan="on")
    route.start()
    try:
        n = 16
        for i in range(n):  # (each: /tokenize at an engine, /query at the index, the completion at an engine)
            body = {"model": MODEL, "prompt": f"Connection count {i}: a prompt", "max_tokens": 1,
                    "stream": i % 4 == 3}
            status, _, _ = call(route.url + "/v1/completions", body, raw=True)
            assert status == 200, i
        stats = json.loads(urllib.request.urlopen(route.url + "/route/stats", timeout=10).read())
    finally:
        route.stop()
    assert sum(e["routed"] for e in stats["engines"]) == n and stats["index_errors"] == 0
    # one request at a time, plus the load poller's /metrics beside it: at most 2 in use at once
    # per upstream (one connection per call would be n at the index and 2n over the engines)
    assert 1 <= to_index.accepted <= 2, to_index.accepted
    assert all(r.accepted <= 2 for r in to_engines), [r.accepted for r in to_engines]


def test_a_connection_the_server_closed_is_replaced(cluster: Cluster,  # noqa: F811
                                                    relays: tuple[list[CountingRelay], CountingRelay]) -> None:
    _, to_index = relays
    pool = ConnectionPool()
    query = {"model": MODEL, "token_ids": [1, 2, 3]}
    assert pool.call(to_index.url, "/query", query)[0] == 200
    assert pool.call(to_index.url, "/query", query)[0] == 200
    assert to_index.accepted == 1
    to_index.drop_all()  # (the kept-alive connection is now closed under the pool)
    assert pool.call(to_index.url, "/query", query)[0] == 200
    assert to_index.accepted == 2 and pool.opened == 2
    pool.close()
