"""`hybridkv serve` with `--kv-events-config` feeds the index, and the index predicts the engine's hit:
the `cached_tokens` the next completion reports equals the `longest_matched` asked just before."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import SamplingParams
from hybridkv.index.http import IndexServer, make_routes
from hybridkv.index.service import IndexService
from hybridkv.openai_api.http_server import ServeServer
from tests.index.test_index_service import wait_for

MODEL = "default-gemma3"
Setup = tuple[ServeServer, IndexServer]
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                     "replay_endpoint": "tcp://127.0.0.1:*"})


def call(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def engine_and_index(llm: LLM) -> Iterator[tuple[ServeServer, IndexServer, IndexService]]:
    """`llm` served, an index beside it with the engine registered as instance e0; both stopped after."""
    serve = ServeServer(llm, port=0, model_name=MODEL)
    serve.start()
    service = IndexService()
    index = IndexServer(make_routes(service))
    index.start()
    try:
        assert llm.kv_events is not None
        pub = llm.kv_events.publisher
        status, _ = call(index.url + "/register", {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                                   "type": "hybridkv", "modelname": MODEL, "instance_id": "e0",
                                                   "block_size": 16})
        assert status == 200
        yield serve, index, service
    finally:
        index.stop()
        service.close()
        serve.stop()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    llm = LLM(MODEL, kv_cache_memory_gib=0.05, num_threads=1, max_num_batched_tokens=256, kv_events_config=EVENTS)
    with engine_and_index(llm) as (serve, index, _):
        yield serve, index


def test_tokenize_matches_what_the_engine_runs(setup: Setup) -> None:
    serve, _ = setup
    status, body = call(serve.url + "/tokenize", {"model": MODEL, "prompt": "hello"})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    status, done = call(serve.url + "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == body["count"]
    assert call(serve.url + "/tokenize", {"model": MODEL})[0] == 400
    assert call(serve.url + "/tokenize", {"model": "other", "prompt": "x"})[0] == 404


def test_the_index_predicts_cached_tokens(setup: Setup) -> None:
    serve, index = setup
    base = "The quick brown fox jumps over the lazy dog. " * 6
    checks = 0
    for turn in range(4):
        prompt = base + f" turn {turn}: " + "more words here " * turn
        tokens = call(serve.url + "/tokenize", {"model": MODEL, "prompt": prompt})[1]["tokens"]

        def predicted(tokens: list[int] = tokens) -> int:
            reply = call(index.url + "/query", {"model": MODEL, "token_ids": tokens, "block_size": 16})[1]
            return int(reply["default"]["e0"]["longest_matched"])

        if turn:  # (the previous turn's events arrive asynchronously)
            wait_for(lambda: predicted() > 0)
        expected = predicted()
        done = call(serve.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})[1]
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        checks += expected > 0
    assert checks >= 3


def test_a_response_counts_its_own_events_and_the_index_catches_up_to_it(setup: Setup) -> None:
    """x-hybridkv-kv-events-seq counts the batch of the request's own last step: once the index's
    events_seq reaches it, the answer already holds the request's blocks (read-your-writes)."""
    serve, index = setup
    prompt = "A prompt nobody sent before, long enough for several blocks of sixteen tokens. " * 2
    req = urllib.request.Request(serve.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        seq = int(r.headers["x-hybridkv-kv-events-seq"])
    tokens = call(serve.url + "/tokenize", {"model": MODEL, "prompt": prompt})[1]["tokens"]

    def answer() -> dict[str, Any]:
        reply = call(index.url + "/query", {"model": MODEL, "token_ids": tokens, "block_size": 16})[1]
        entry: dict[str, Any] = reply["default"]["e0"]
        return entry

    wait_for(lambda: answer()["events_seq"] >= seq)
    assert answer()["longest_matched"] >= 16 * (len(tokens) // 16 - 1) > 0
    assert seq >= 1


def test_read_your_writes_covers_evictions() -> None:
    """A request that evicts an earlier prompt's blocks: its x-hybridkv-kv-events-seq counts the
    batch with the removals, so once the index's events_seq reaches it the answer for the earlier
    prompt is what the engine then finds (less than before the eviction)."""
    llm = LLM(MODEL, kv_cache_memory_gib=0.002, num_threads=1, max_num_batched_tokens=512, kv_events_config=EVENTS)
    with engine_and_index(llm) as (serve, index, service):
        first = [5 + i % 200 for i in range(300)]

        def complete(tokens: list[int]) -> tuple[int, int]:
            req = urllib.request.Request(serve.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": MODEL, "prompt": tokens, "max_tokens": 1}).encode())
            with urllib.request.urlopen(req, timeout=60) as r:
                body = json.loads(r.read())
                return int(body["usage"]["prompt_tokens_details"]["cached_tokens"]), int(
                    r.headers["x-hybridkv-kv-events-seq"])

        def answer(seq: int) -> int:
            wait_for(lambda: call(index.url + "/query", {"model": MODEL, "token_ids": first})[1]["default"]["e0"]
                     ["events_seq"] >= seq)
            reply = call(index.url + "/query", {"model": MODEL, "token_ids": first})[1]
            return int(reply["default"]["e0"]["longest_matched"])

        _, seq = complete(first)
        before = answer(seq)
        assert before > 0, (seq, call(index.url + "/query", {"model": MODEL, "token_ids": first})[1], complete(first))
        evicted = False
        for k in range(8):  # (other prompts until some of the first one's blocks are evicted)
            _, seq = complete([7 + (i * (k + 3)) % 250 for i in range(400)])
            predicted = answer(seq)
            if predicted < before:
                evicted = True
                break
        assert evicted, "the first prompt's blocks were never evicted: the cache is too large for this test"
        assert complete(first)[0] == predicted
        assert service.table.counts.removed_blocks > 0


def test_a_steps_cache_changes_are_published_before_its_forward_pass() -> None:
    """The blocks a step caches (allocated, as vLLM caches them) and evicts are published before the
    forward pass runs, not after it: a router asking during a slow CPU forward must see the cache as
    the next step's admissions will find it. Here: when the forward pass of a 64-token prompt's prefill
    starts, its 4 full blocks' BlockStored events have been published."""
    llm = LLM(MODEL, kv_cache_memory_gib=0.05, num_threads=1, max_num_batched_tokens=256, kv_events_config=EVENTS)
    try:
        assert llm.kv_events is not None
        publisher, runner = llm.kv_events.publisher, llm.runner
        published: list[Any] = []
        seen_at_forward: list[int] = []
        publish, execute = publisher.publish, runner.execute

        def record(events: Any) -> None:
            published.extend(events)
            publish(events)

        def forward(items: Any) -> Any:
            seen_at_forward.append(sum(len(e.block_hashes) for e in published if type(e).__name__ == "BlockStored"))
            return execute(items)

        publisher.publish = record  # type: ignore[method-assign]
        runner.execute = forward  # type: ignore[method-assign]
        llm.generate([list(range(10, 75))], SamplingParams(max_tokens=1))
    finally:
        llm.close()
    assert seen_at_forward and seen_at_forward[0] >= 64 // 16, seen_at_forward
