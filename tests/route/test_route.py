"""`hybridkv route` over two in-process `hybridkv serve` engines and an index: a repeated prefix goes
back to the engine holding it (and its cached tokens are the predicted ones), streams pass through,
a dead engine fails over, bad bodies get one-line errors."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.index.http import AppServer, IndexServer, make_routes
from hybridkv.index.service import IndexService
from hybridkv.openai_api.http_server import ServeServer
from hybridkv.route.app import RouteConfig, index_behind
from hybridkv.route.app import make_app as make_route_app
from hybridkv.route.local import free_port
from hybridkv.route.picker import Engine, Policy, rank
from tests.index.test_index_service import wait_for

MODEL = "default-gemma3"
Cluster = tuple[list[ServeServer], IndexServer, IndexService]


def call(url: str, body: Any, *, raw: bool = False) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read()
            return r.status, dict(r.headers), text if raw else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    service = IndexService()
    index = IndexServer(make_routes(service))
    index.start()
    engines = []
    for i in range(2):
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                             "replay_endpoint": "tcp://127.0.0.1:*"})
        llm = LLM(MODEL, kv_cache_memory_gib=0.05, num_threads=1, max_num_batched_tokens=256, kv_events_config=events)
        serve = ServeServer(llm, port=0, model_name=MODEL)
        serve.start()
        assert llm.kv_events is not None
        pub = llm.kv_events.publisher
        status, _, _ = call(index.url + "/register", {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                                      "type": "hybridkv", "modelname": MODEL, "instance_id": serve.url,
                                                      "block_size": 16})
        assert status == 200, i
        engines.append(serve)
    yield engines, index, service
    for serve in engines:
        serve.stop()
    index.stop()
    service.close()


def router(engines: list[str], index_url: str | None, policy: Policy = Policy.JOINT) -> AppServer:
    cfg = RouteConfig(engines=[Engine(url=u, instance_id=u) for u in engines], index_url=index_url, model=MODEL,
                      policy=policy, poll_every_s=0.2)
    server = AppServer(make_route_app(cfg), lifespan="on")
    server.start()
    return server


def test_a_repeated_prefix_goes_back_to_its_engine(cluster: Cluster) -> None:
    engines, index, _ = cluster
    route = router([e.url for e in engines], index.url)
    try:
        prompt = "A long shared system prompt about routing. " * 5
        status, headers, _first = call(route.url + "/v1/completions", {"model": MODEL, "prompt": prompt + "one",
                                                                       "max_tokens": 2})
        assert status == 200
        home = headers["x-hybridkv-instance"]
        tokens = call(home + "/tokenize", {"model": MODEL, "prompt": prompt + "two"})[2]["tokens"]
        wait_for(lambda: call(index.url + "/query", {"model": MODEL, "token_ids": tokens})[2]["default"][home]
                 ["longest_matched"] > 0)
        status, headers, second = call(route.url + "/v1/completions", {"model": MODEL, "prompt": prompt + "two",
                                                                        "max_tokens": 2})
        assert headers["x-hybridkv-instance"] == home
        predicted = int(headers["x-hybridkv-predicted-tokens"])
        assert predicted > 0 and second["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
    finally:
        route.stop()


def test_streams_pass_through(cluster: Cluster) -> None:
    engines, index, _ = cluster
    route = router([e.url for e in engines], index.url)
    try:
        status, headers, raw = call(route.url + "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}, raw=True)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 3
    finally:
        route.stop()


def test_a_dead_engine_fails_over(cluster: Cluster) -> None:
    engines, index, _ = cluster
    dead = f"http://127.0.0.1:{free_port()}"
    route = router([dead, engines[0].url], index.url, Policy.ROUND_ROBIN)
    try:
        for _ in range(3):
            status, headers, _ = call(route.url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert status == 200 and headers["x-hybridkv-instance"] == engines[0].url
        stats = json.loads(urllib.request.urlopen(route.url + "/route/stats", timeout=10).read())
        assert stats["engines"][0]["routed"] == 0 and stats["engines"][1]["routed"] == 3
    finally:
        route.stop()


def test_no_engine_up_is_a_503(cluster: Cluster) -> None:
    route = router([f"http://127.0.0.1:{free_port()}"], None)
    try:
        status, _, body = call(route.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 503 and "no engine answered" in body["error"]["message"]
    finally:
        route.stop()


@pytest.mark.parametrize(("body", "needle"), [(b"{", "not JSON"), (b"[1]", "JSON object")])
def test_bad_bodies(cluster: Cluster, body: bytes, needle: str) -> None:
    engines, index, _ = cluster
    route = router([engines[0].url], index.url)
    try:
        status, _, reply = call(route.url + "/v1/completions", body)
        assert status == 400 and needle in reply["error"]["message"]
    finally:
        route.stop()


def test_rank_prefers_the_hit_within_the_load_skew() -> None:
    a, b, c = (Engine(url=n, instance_id=n) for n in "abc")
    assert [e.url for e in rank([a, b, c], {"b": (32, 32)}, Policy.JOINT, now=0.0)] == ["b", "a", "c"]
    b.in_flight = 3  # beyond the skew of 2: its hit no longer wins
    assert next(e.url for e in rank([a, b, c], {"b": (32, 32)}, Policy.JOINT, now=0.0)) == "a"
    a.routed = 1  # ties: the least loaded, then the fewest routed
    assert next(e.url for e in rank([a, b, c], {}, Policy.JOINT, now=0.0)) == "c"
    assert next(e.url for e in rank([a, b, c], {"a": (0, 64), "c": (0, 16)}, Policy.JOINT, now=0.0)) == "c"
    assert next(e.url for e in rank([a, b, c], {"a": (16, 0), "c": (0, 64)}, Policy.ATTENTION, now=0.0)) == "c"
    b.in_flight, b.routed, a.routed = 0, 9, 0  # over 1.25 x its fair share: not chosen for its hit
    assert next(e.url for e in rank([a, b, c], {"b": (32, 32)}, Policy.JOINT, now=0.0)) != "b"
    c.down_until = 10.0
    assert "c" not in [e.url for e in rank([a, b, c], {}, Policy.JOINT, now=1.0)]


def test_an_index_answer_older_than_an_engines_reply_is_behind() -> None:
    """events_seq below the count an engine's responses reported: asked again; equal, above or not
    reported (a vLLM engine, an index without subscriptions): used as it is."""
    cfg = RouteConfig(engines=[Engine(url="http://a", instance_id="a", events_seq=5),
                               Engine(url="http://b", instance_id="b")], index_url=None, model=MODEL)
    assert index_behind(cfg, {"a": {"events_seq": 4}, "b": {"events_seq": 0}})
    assert not index_behind(cfg, {"a": {"events_seq": 5}, "b": {"events_seq": 0}})
    assert not index_behind(cfg, {"a": {"events_seq": 9}})
    assert not index_behind(cfg, {"a": {"longest_matched": 0}})
