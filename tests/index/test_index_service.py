"""The index end to end: a vLLM-format publisher over ZMQ -> the ingest thread -> HTTP answers.

Failure modes: lost batches (replay recovers; without replay the instance's entries are dropped),
a publisher restart, a dead publisher (aged out), tenants and salts, auth, bad input."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from hybridkv.index.http import IndexServer, make_routes
from hybridkv.index.seq_hash import seq_hashes
from hybridkv.index.service import IndexService, Query
from hybridkv.kv_events.publisher import ZmqPublisher
from hybridkv.kv_events.wire import END_SEQ, BlockRemoved, BlockStored, EventBatch, KVEventsConfig, encode_batch

TOKEN = "t" * 32
BS = 4


def stored(tokens: list[int], *, parent: int | None = None, first: int = 1, group: int = 0,
           kind: str = "full_attention", window: int | None = None, salt: str | None = None) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(block_hashes=list(range(first, first + n)), parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=[[salt]] + [None] * (n - 1) if salt else None, group_idx=group,
                       kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)


def post(url: str, body: dict[str, Any], token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def index() -> Iterator[tuple[str, IndexService]]:
    service = IndexService(probe_every_s=0.2, dead_after_s=1.0)
    server = IndexServer(make_routes(service, token=TOKEN))
    server.start()
    yield server.url, service
    server.stop()
    service.close()


def publisher(replay: bool = True, buffer_steps: int = 100) -> ZmqPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*" if replay else None, buffer_steps=buffer_steps)
    return ZmqPublisher(config)


def register(url: str, pub: ZmqPublisher | LossyPublisher, instance: str = "e0", tenant: str = "default") -> None:
    status, body = post(url + "/register", {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                            "type": "vLLM", "modelname": "m", "instance_id": instance,
                                            "block_size": BS, "dp_rank": 0, "tenant_id": tenant})
    assert (status, body) == (200, {"status": "registered successfully", "instance_id": instance})


def matched(url: str, tokens: list[int], instance: str = "e0", **extra: Any) -> int:
    status, body = post(url + "/query", {"model": "m", "token_ids": tokens, "block_size": BS, **extra})
    assert status == 200, body
    return int(body.get(extra.get("tenant_id", "default"), {}).get(instance, {}).get("longest_matched", 0))


PROMPT = list(range(100, 120))  # 5 blocks


def test_events_over_zmq_answer_the_conductor_shape(index: tuple[str, IndexService]) -> None:
    url, _ = index
    pub = publisher()
    register(url, pub)
    time.sleep(0.2)  # (the subscription settles; what it misses is replayed)
    pub.publish([stored(PROMPT[:16])])
    wait_for(lambda: matched(url, PROMPT) == 16)
    status, body = post(url + "/query", {"model": "m", "token_ids": PROMPT, "block_size": BS})
    # (events_seq: one batch published, sequence number 0, so the next one the index expects is 1)
    assert body == {"default": {"e0": {"longest_matched": 16, "GPU": 16, "CPU": 0, "DISK": 0, "DP": {"0": 16},
                                       "attention_matched": 16, "events_seq": 1}}}
    assert pub.queued_batches == 1
    hashes = seq_hashes(PROMPT, BS)
    status, body = post(url + "/query_by_hash", {"model": "m", "seq_hashes": hashes[:3], "block_size": BS})
    assert body["default"]["e0"]["longest_matched"] == 12
    pub.publish([BlockRemoved(block_hashes=[4], medium="GPU", group_idx=0)])
    wait_for(lambda: matched(url, PROMPT) == 12)
    status, body = post(url + "/unregister", {"instance_id": "e0"})
    assert (status, body) == (200, {"status": "unregistered successfully", "removed_instances": ["e0|default|0"]})
    assert post(url + "/query", {"model": "m", "token_ids": PROMPT})[1] == {"default": {}}
    pub.shutdown()


def test_joint_hit_of_a_state_hybrid_beside_the_attention_number(index: tuple[str, IndexService]) -> None:
    """Full attention holds 4 blocks, the state group checkpointed after block 2 only: joint 8, attention 16."""
    url, _ = index
    pub = publisher()
    register(url, pub)
    full = stored(PROMPT[:16])
    state = BlockStored(block_hashes=[2], parent_block_hash=1, token_ids=PROMPT[4:8], block_size=BS, lora_id=None,
                        medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="mamba")
    pub.publish([full, state])
    wait_for(lambda: matched(url, PROMPT) == 8)
    body = post(url + "/query", {"model": "m", "token_ids": PROMPT})[1]
    assert body["default"]["e0"]["attention_matched"] == 16
    pub.shutdown()


class LossyPublisher:
    """vLLM's publisher protocol by hand (PUB + replay ROUTER), able to lose a batch on the way."""

    def __init__(self, replay: bool = True, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        for _ in range(100):  # (a port just closed is released by ZMQ's I/O thread a moment later)
            try:
                self.pub.bind(endpoint)
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        else:
            raise AssertionError(f"cannot bind {endpoint}")
        self.router = self.ctx.socket(zmq.ROUTER) if replay else None
        if self.router is not None:
            self.router.bind("tcp://127.0.0.1:*")
        self.sent: list[tuple[int, bytes]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return str(self.pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.router is None else str(self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    def send(self, events: list[Any], *, lose: bool = False) -> None:
        seq = len(self.sent)
        payload = encode_batch(EventBatch(ts=0.0, events=events))
        self.sent.append((seq, payload))
        if not lose:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.router is not None and self.router.poll(20):
                client, _, start = self.router.recv_multipart()
                for seq, payload in list(self.sent):
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self.router.send_multipart((client, b"", END_SEQ, b""))
            else:
                time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


def test_a_lost_batch_is_replayed(index: tuple[str, IndexService]) -> None:
    url, service = index
    pub = LossyPublisher()
    register(url, pub)
    time.sleep(0.3)
    pub.send([stored(PROMPT[:8])])
    wait_for(lambda: matched(url, PROMPT) == 8)
    pub.send([stored(PROMPT[8:16], parent=2, first=3)], lose=True)
    pub.send([stored(PROMPT[16:20], parent=4, first=5)])  # seq 2: the gap [1, 2) is replayed
    wait_for(lambda: matched(url, [*PROMPT, 1]) == 20)
    assert service.subscriber is not None
    assert service.subscriber.counts.gaps == 1 and service.subscriber.counts.resets == 0
    pub.close()


def test_a_gap_without_replay_drops_the_instances_entries(index: tuple[str, IndexService]) -> None:
    url, service = index
    pub = LossyPublisher(replay=False)
    register(url, pub)
    time.sleep(0.3)
    pub.send([stored(PROMPT[:8])])
    wait_for(lambda: matched(url, PROMPT) == 8)
    pub.send([BlockRemoved(block_hashes=[1, 2], medium="GPU", group_idx=0)], lose=True)  # no stale hit may stay
    pub.send([stored(list(range(500, 504)), first=50)])
    wait_for(lambda: service.subscriber is not None and service.subscriber.counts.resets == 1)
    assert matched(url, PROMPT) == 0
    assert matched(url, list(range(500, 505))) == 4  # (the stream goes on after the gap)
    pub.close()


def test_a_restarted_publisher_starts_over(index: tuple[str, IndexService]) -> None:
    """The same endpoint, sequence numbers from 0 again: the old blocks are gone with the old cache."""
    url, _service = index
    pub = LossyPublisher(replay=False)
    register(url, pub)
    time.sleep(0.3)
    pub.send([stored(PROMPT[:8])])
    pub.send([stored(list(range(300, 304)), first=9)])
    wait_for(lambda: matched(url, PROMPT) == 8)
    endpoint = pub.endpoint
    pub.close()
    fresh = LossyPublisher(replay=False, endpoint=endpoint)
    for i in range(300):  # (until the subscriber has reconnected)
        fresh.send([stored(list(range(700, 704)), first=70 + i)])
        time.sleep(0.05)
        if matched(url, list(range(700, 705))) == 4:
            break
    assert matched(url, list(range(700, 705))) == 4
    assert matched(url, PROMPT) == 0
    fresh.close()


def test_a_dead_publisher_is_aged_out(index: tuple[str, IndexService]) -> None:
    url, _service = index
    pub = publisher()
    register(url, pub)
    time.sleep(0.2)
    pub.publish([stored(PROMPT[:8])])
    wait_for(lambda: matched(url, PROMPT) == 8)
    time.sleep(1.5)
    assert matched(url, PROMPT) == 8  # idle but alive: it answers the replay probe
    pub.shutdown()
    wait_for(lambda: matched(url, PROMPT) == 0)


def test_tenants_and_salts_stay_apart(index: tuple[str, IndexService]) -> None:
    url, service = index
    pub = publisher()
    register(url, pub, instance="a", tenant="acme")
    time.sleep(0.2)
    pub.publish([stored(PROMPT[:8], salt="secret-salt")])
    wait_for(lambda: matched(url, PROMPT, instance="a", tenant_id="acme", cache_salt="secret-salt") == 8)
    assert matched(url, PROMPT, instance="a", tenant_id="acme") == 0  # no salt: not its namespace
    assert matched(url, PROMPT, instance="a", tenant_id="acme", cache_salt="other") == 0
    assert post(url + "/query", {"model": "m", "token_ids": PROMPT, "cache_salt": "secret-salt"})[1] == {"default": {}}
    assert "secret-salt" not in repr(vars(service.table)) and "secret-salt" not in repr(service.table.registrations)
    pub.shutdown()


def test_auth_is_required_on_every_post(index: tuple[str, IndexService]) -> None:
    url, _ = index
    for path in ("/register", "/unregister", "/query", "/query_by_hash"):
        status, body = post(url + path, {"model": "m"}, token=None)
        assert status == 401 and "Bearer" in body["error"]["message"]
        assert post(url + path, {"model": "m"}, token="x" * 32)[0] == 401


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/query", {"token_ids": [1]}, "model"),
    ("/query", {"model": "m"}, "token_ids"),
    ("/query", {"model": "m", "token_ids": [-1]}, "0..4294967295"),
    ("/query", {"model": "m", "token_ids": [1, 4294967296]}, "0..4294967295"),
    ("/query", {"model": "m", "token_ids": [1.5]}, "token_ids"),
    ("/query", {"model": "m", "token_ids": None}, "token_ids"),
    ("/query", {"model": "m", "token_ids": "abc"}, "token_ids"),
    ("/query_by_hash", {"model": "m", "seq_hashes": [1]}, "block_size"),
    ("/register", {"endpoint": "http://x", "type": "vLLM", "modelname": "m", "instance_id": "e", "block_size": 4},
     "ZMQ endpoint"),
    ("/register", {"endpoint": "tcp://127.0.0.1:1", "type": "vLLM", "modelname": "m", "instance_id": "e",
                   "block_size": 0}, "block_size"),
    ("/unregister", {"instance_id": "nobody"}, "no registration"),
])
def test_bad_requests_get_one_line_errors(index: tuple[str, IndexService], path: str, body: dict[str, Any],
                                          needle: str) -> None:
    url, _ = index
    status, reply = post(url + path, body)
    assert status in (400, 404) and needle in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"] and "Traceback" not in reply["error"]["message"]


def test_bodies_over_the_limit_are_refused() -> None:
    service = IndexService(subscribe=False)
    server = IndexServer(make_routes(service, max_body_bytes=1000))
    server.start()
    try:
        status, reply = post(server.url + "/query", {"model": "m", "token_ids": list(range(1000))}, token=None)
        assert status == 413 and "limit" in reply["error"]["message"]
    finally:
        server.stop()


def test_a_chunked_body_over_the_limit_a_get_and_a_bug_get_one_line_errors(
        caplog: pytest.LogCaptureFixture) -> None:
    """The POST routes' own ASGI path (http.py `_PostRoutes`): a body without Content-Length stopped
    at the limit, a GET of a POST route, an exception in the service: each one JSON line."""
    import http.client

    class Broken(IndexService):
        def query(self, q: Query) -> dict[str, dict[str, dict[str, Any]]]:
            raise RuntimeError("a bug")

    service = Broken(subscribe=False)
    server = IndexServer(make_routes(service, max_body_bytes=1000))
    server.start()
    try:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("POST", "/query", body=iter([b'{"model": "m", "token_ids": [' + b"1, " * 400, b"1]}"]),
                     encode_chunked=True, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413 and b"over the limit of 1000 bytes" in resp.read()
        conn.request("GET", "/query")
        resp = conn.getresponse()
        assert resp.status == 404 and b"expected POST /register" in resp.read()
        conn.close()
        with caplog.at_level("ERROR"):
            status, reply = post(server.url + "/query", {"model": "m", "token_ids": [1, 2]}, token=None)
        assert status == 500 and reply["error"]["message"] == "internal error: RuntimeError"
        assert "a bug" in caplog.text  # (the traceback goes to the log, not to the client)
    finally:
        server.stop()


def test_the_registry_is_bounded() -> None:
    service = IndexService(subscribe=False, max_registrations=1)
    server = IndexServer(make_routes(service))
    server.start()
    try:
        reg = {"endpoint": "tcp://127.0.0.1:1", "type": "vLLM", "modelname": "m", "block_size": 4}
        assert post(server.url + "/register", {**reg, "instance_id": "a"}, token=None)[0] == 200
        status, reply = post(server.url + "/register", {**reg, "instance_id": "b"}, token=None)
        assert status == 503 and "registrations" in reply["error"]["message"]
    finally:
        server.stop()
