"""`hybridkv serve` through the official `openai` client, against offline `LLM.generate` of the same model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.openai_api.engine_loop import EngineLoop
from hybridkv.openai_api.http_server import ServeServer
from tests.openai_api.conftest import MODEL, http, metric

openai = pytest.importorskip("openai")

IDS = {"return_token_ids": True, "ignore_eos": True}
PROMPT = "The hybrid KV cache keeps sliding windows short. "


def _greedy(offline: LLM, prompt: str | list[int], max_tokens: int) -> Any:
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, eos=EosMode.IGNORE))[0]


def test_completion_equals_generate_streamed_and_not(client: Any, offline: LLM) -> None:
    expected = _greedy(offline, PROMPT, 12)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=IDS)
    choice = whole.choices[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == (expected.token_ids, expected.text, "length")
    assert choice.prompt_token_ids == expected.prompt_token_ids
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            extra_body=IDS))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == expected.token_ids
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_token_id_prompt_and_logprobs_equal_generate(client: Any, offline: LLM) -> None:
    prompt = [2, *range(40, 90)]
    expected = offline.generate([prompt], SamplingParams(max_tokens=6, eos=EosMode.IGNORE, logprobs=2))[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={**IDS, "return_tokens_as_token_ids": True}).choices[0]
    assert out.token_ids == expected.token_ids
    assert out.logprobs.tokens == [f"token_id:{t}" for t in expected.token_ids]
    for token, lp, top, reference in zip(out.token_ids, out.logprobs.token_logprobs, out.logprobs.top_logprobs,
                                         expected.logprobs, strict=True):
        assert lp == pytest.approx(reference[token], abs=1e-5)
        best = sorted(reference.items(), key=lambda kv: -kv[1])[:2]
        assert top == pytest.approx({f"token_id:{i}": v for i, v in best}, abs=1e-5)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body=IDS).choices[0].logprobs
    assert text.tokens == [offline.tokenizer.decode([t]) for t in expected.token_ids]
    assert text.top_logprobs == [{}] * 6


def test_chat_uses_the_plain_template_and_equals_generate(client: Any, offline: LLM) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    # the documented plain template, written out by hand; the byte tokenizer adds BOS (2)
    prompt = [2, *(b + 3 for b in b"<|system|>\nYou are terse.\n<|user|>\nHello\n<|assistant|>\n")]
    expected = _greedy(offline, prompt, 10)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body=IDS)
    choice = whole.choices[0]
    assert choice.prompt_token_ids == prompt
    assert (choice.message.role, choice.message.content, choice.token_ids) == (
        "assistant", expected.text, expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_seeded_sampling_equals_generate(client: Any, offline: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=7, eos=EosMode.IGNORE)
    expected = offline.generate([PROMPT], params)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.8, top_p=0.9, seed=7,
                                    extra_body={**IDS, "top_k": 40}).choices[0]
    assert out.token_ids == expected.token_ids
    assert out.token_ids != _greedy(offline, PROMPT, 10).token_ids  # it did sample


def test_stop_string_ends_the_text_before_it(client: Any, offline: LLM) -> None:
    text = _greedy(offline, PROMPT, 24).text
    start = next(i for i in range(6, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]  # a string the greedy answer contains: the answer ends before it
    cut = text[: text.find(stop)]
    assert cut
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                      extra_body=IDS).choices[0]
    assert (whole.text, whole.finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True, extra_body=IDS))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eight_concurrent_streams_equal_their_sequential_runs(server: ServeServer, client: Any) -> None:
    prompts = [f"client {i}: " + "shared system prompt. " * (1 + i % 3) for i in range(8)]

    def one(prompt: str) -> list[int]:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True, extra_body=IDS)
        return [t for c in chunks for t in c.choices[0].token_ids]

    sequential = [one(p) for p in prompts]

    async def concurrent() -> list[tuple[list[int], float, float]]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        async def run(prompt: str) -> tuple[list[int], float, float]:
            stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                      stream=True, extra_body=IDS)
            ids: list[int] = []
            first = 0.0
            async for chunk in stream:
                first = first or time.perf_counter()
                ids += chunk.choices[0].token_ids
            return ids, first, time.perf_counter()

        try:
            return list(await asyncio.gather(*(run(p) for p in prompts)))
        finally:
            await aclient.close()

    results = asyncio.run(concurrent())
    assert [ids for ids, _, _ in results] == sequential
    assert all(len(ids) == 16 for ids in sequential)
    # they ran at once: some stream got its first token before another had finished
    assert max(first for _, first, _ in results) < max(end for _, _, end in results)
    assert sum(1 for _, first, _ in results if first < min(end for _, _, end in results)) >= 2


def test_a_cancelled_stream_frees_its_blocks(server: ServeServer, client: Any, engine: EngineLoop) -> None:
    aborted = metric(server, "hybridkv_serve_requests_total", endpoint="completions", finish_reason="abort")
    baseline = engine.call_sync(lambda llm: llm.manager.usage())
    stream = client.completions.create(model=MODEL, prompt=PROMPT * 4, max_tokens=3000, temperature=0,
                                       stream=True, extra_body=IDS)
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].token_ids)
        if got >= 5:
            break
    assert engine.call_sync(lambda llm: llm.manager.usage()) > baseline  # it holds blocks now
    stream.close()  # the client disconnects mid-stream
    deadline = time.monotonic() + 20
    while engine.call_sync(lambda llm: llm.has_unfinished) and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.call_sync(lambda llm: llm.manager.check_integrity())
    assert engine.call_sync(lambda llm: llm.manager.usage()) == baseline
    assert metric(server, "hybridkv_serve_requests_total", endpoint="completions", finish_reason="abort") \
        == aborted + 1
    assert metric(server, "hybridkv_serve_kv_cache_usage_ratio") == baseline


def test_models_health_and_metrics(server: ServeServer, client: Any) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    assert http(server, "/health")[0] == 200
    ttft = metric(server, "hybridkv_serve_time_to_first_token_seconds_count")
    done = metric(server, "hybridkv_serve_requests_total", endpoint="completions", finish_reason="length")
    generated = metric(server, "hybridkv_serve_generation_tokens_total")
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=5, temperature=0, extra_body=IDS)
    assert metric(server, "hybridkv_serve_time_to_first_token_seconds_count") == ttft + 1
    assert metric(server, "hybridkv_serve_inter_token_latency_seconds_count") >= 4
    assert metric(server, "hybridkv_serve_requests_total", endpoint="completions", finish_reason="length") == done + 1
    assert metric(server, "hybridkv_serve_generation_tokens_total") == generated + 5
    assert metric(server, "hybridkv_serve_kv_cache_usable_blocks") > 0


def test_prefix_hits_per_group_and_reset_prefix_cache(server: ServeServer, client: Any, offline: LLM) -> None:
    prompt = [2, *range(100, 164)]  # 65 tokens: 4 full blocks of 16 hit on a repeat (the last token never does)
    offline.manager.reset_prefix_cache()
    reference = [offline.generate([prompt], SamplingParams(max_tokens=2))[0].metrics.prefix_hit_tokens
                 for _ in range(2)]
    assert reference == [0, 64]
    assert http(server, "/reset_prefix_cache", b"", method="POST") == (200, {"reset": True, "external": False})
    hits = metric(server, "hybridkv_serve_prefix_cache_hits_tokens_total")
    groups = metric(server, "hybridkv_serve_prefix_cache_group_hits_tokens_total", group="0")
    limited = metric(server, "hybridkv_serve_prefix_cache_hit_limited_by_total", group="0", reason="never_cached")
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert metric(server, "hybridkv_serve_prefix_cache_hits_tokens_total") == hits + 64
    # the first found nothing cached; the repeat hit all it could (64 of 65), so nothing limited it
    assert metric(server, "hybridkv_serve_prefix_cache_hit_limited_by_total", group="0",
                  reason="never_cached") == limited + 1
    assert metric(server, "hybridkv_serve_prefix_cache_group_hits_tokens_total", group="0") >= groups + 64
    assert http(server, "/reset_prefix_cache", b"", method="POST")[0] == 200
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert metric(server, "hybridkv_serve_prefix_cache_hits_tokens_total") == hits + 64  # nothing left to hit


@pytest.mark.parametrize(("query", "message"), [
    ("?external=true", "none is attached"), ("?external=maybe", "external must be true or false")])
def test_reset_prefix_cache_refusals(server: ServeServer, query: str, message: str) -> None:
    status, body = http(server, "/reset_prefix_cache" + query, b"", method="POST")
    assert status == 400 and message in body["error"]["message"]


def test_cache_salt_keeps_tenants_apart(server: ServeServer, client: Any) -> None:
    prompt = [2, *range(170, 236)]  # 67 tokens: a repeat with the same salt hits 64
    http(server, "/reset_prefix_cache", b"", method="POST")

    def cached(salt: str | None) -> int:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt} if salt else {})
        return int(out.usage.prompt_tokens_details.cached_tokens)

    assert [cached("tenant-a"), cached("tenant-a"), cached("tenant-b"), cached(None)] == [0, 64, 0, 0]
