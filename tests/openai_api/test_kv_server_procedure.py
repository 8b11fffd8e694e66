"""The reference's verification procedure over HTTP, with `--kv-server auto`: run a fixed set of
prompts, reset only the local prefix cache, run them again: the outputs are identical and the KV
cache server served hits (in /metrics and in each answer's `cached_tokens`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.engine.kv_offload import auto_chunk_tokens
from hybridkv.engine.llm import LLM
from hybridkv.openai_api.http_server import ServeServer
from tests.openai_api.conftest import ENGINE, MODEL, http, metric

openai = pytest.importorskip("openai")

rng = random.Random(3)
PROMPTS = [[2, *(rng.randrange(3, 259) for _ in range(n))] for n in (300, 420, 530)]


@pytest.fixture(scope="module")
def kv_served() -> Iterator[ServeServer]:
    serve = ServeServer(LLM(MODEL, **ENGINE, kv_server="auto"), port=0, model_name=MODEL)
    serve.start()
    yield serve
    serve.stop()  # also closes the LLM, which stops the KV cache server it started


def _run(client: Any) -> list[tuple[list[int], int]]:
    outs = []
    for prompt in PROMPTS:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
        outs.append((out.choices[0].token_ids, out.usage.prompt_tokens_details.cached_tokens))
    return outs


def test_store_reset_local_retrieve_over_http(kv_served: ServeServer) -> None:
    client = openai.OpenAI(base_url=kv_served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert metric(kv_served, "hybridkv_serve_kv_server_attached") == 1
    first = _run(client)
    assert [cached for _, cached in first] == [0, 0, 0]
    assert metric(kv_served, "hybridkv_serve_external_saved_chunks_total") > 0
    local = metric(kv_served, "hybridkv_serve_prefix_cache_hits_tokens_total")
    assert http(kv_served, "/reset_prefix_cache", b"", method="POST") == (200, {"reset": True, "external": False})
    again = _run(client)
    assert [ids for ids, _ in again] == [ids for ids, _ in first]
    # every whole chunk before the last token came from the server; nothing from the (reset) local cache
    chunk = auto_chunk_tokens(kv_served.app.state.serve.llm.plan.config)  # the auto server's chunk
    assert [cached for _, cached in again] == [(len(p) - 1) // chunk * chunk for p in PROMPTS]
    assert metric(kv_served, "hybridkv_serve_external_hits_tokens_total") == sum(c for _, c in again) > 0
    assert metric(kv_served, "hybridkv_serve_prefix_cache_hits_tokens_total") == local
    # ?external=true also clears the server: a third run hits nothing and still answers the same
    assert http(kv_served, "/reset_prefix_cache?external=true", b"", method="POST")[1]["external"] is True
    third = _run(client)
    assert third == [(ids, 0) for ids, _ in first]
