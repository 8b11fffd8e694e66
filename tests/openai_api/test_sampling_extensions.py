"""vLLM's sampling extensions through `hybridkv serve`: the fields vLLM's own clients send are
accepted, the ones the engine honours change the answer exactly as offline `LLM.generate` with
the same parameters does, and chat streams send the role with the first token."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.engine.tokenizer import SpecialTokens
from hybridkv.openai_api.http_server import ServeServer
from hybridkv.openai_api.schemas import CompletionRequest, to_job
from hybridkv.openai_api.text import StopText
from tests.openai_api.conftest import MODEL, http, metric

openai = pytest.importorskip("openai")

PROMPT = "Penalties push a model away from what it already said. "
IDS = {"return_token_ids": True}


def _offline(offline: LLM, **params: Any) -> Any:
    return offline.generate([PROMPT], SamplingParams(**params))[0]


def test_vllm_bench_payload_is_accepted(server: ServeServer) -> None:
    """What `vllm bench serve --backend openai` sends (vllm 0.32: endpoint_request_func.py)."""
    body = {"model": MODEL, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 4, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    status, text = http(server, "/v1/completions", body)
    assert status == 200, text
    neutral = {"top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0,
               "use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True, "bad_words": [],
               "spaces_between_special_tokens": True, "priority": 0, "include_stop_str_in_output": False}
    status, reply = http(server, "/v1/completions", {**body, **neutral, "stream": False, "stream_options": None})
    assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply


@pytest.mark.parametrize("params", [
    {"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0.9, "min_p": 0.2, "seed": 5}, {"temperature": 1.0, "top_k": 3, "seed": 9},
], ids=["repetition", "frequency-presence", "min-p", "top-k"])
def test_honoured_extensions_equal_generate(client: Any, offline: LLM, params: dict[str, Any]) -> None:
    expected = _offline(offline, max_tokens=12, eos=EosMode.IGNORE, **params)
    greedy = _offline(offline, max_tokens=12, eos=EosMode.IGNORE)
    fields = {k: v for k, v in params.items() if k not in ("temperature", "seed")}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=params.get(
        "temperature", 0), seed=params.get("seed"), extra_body={**IDS, "ignore_eos": True, **fields}).choices[0]
    assert out.token_ids == expected.token_ids
    assert out.token_ids != greedy.token_ids  # the parameter changed the answer


def test_stop_token_ids_min_tokens_and_include_stop(client: Any, offline: LLM) -> None:
    greedy = _offline(offline, max_tokens=12, eos=EosMode.IGNORE)
    stop_id = greedy.token_ids[2]  # the third greedy token
    first = greedy.token_ids.index(stop_id)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={**IDS, "ignore_eos": True, "stop_token_ids": [stop_id]}).choices[0]
    assert (out.token_ids, out.finish_reason) == (greedy.token_ids[: first + 1], "stop")
    assert out.text == offline.tokenizer.decode(greedy.token_ids[:first])  # the stop token's text left out
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={
        **IDS, "ignore_eos": True, "stop_token_ids": [stop_id], "include_stop_str_in_output": True}).choices[0]
    assert kept.text == offline.tokenizer.decode(greedy.token_ids[: first + 1])
    expected = _offline(offline, max_tokens=12, eos=EosMode.IGNORE, stop_token_ids=(stop_id,), min_tokens=8)
    late = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={
        **IDS, "ignore_eos": True, "stop_token_ids": [stop_id], "min_tokens": 8}).choices[0]
    assert late.token_ids == expected.token_ids and len(late.token_ids) >= 8
    assert stop_id not in late.token_ids[:8]


def test_include_stop_str_in_output_keeps_the_stop_string(client: Any, offline: LLM) -> None:
    text = _offline(offline, max_tokens=24, eos=EosMode.IGNORE).text
    start = next(i for i in range(6, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    for stream in (False, True):
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                          stream=stream, extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": True})
        got = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        assert got == text[: text.find(stop) + len(stop)]


def test_add_special_tokens_and_skip_special_tokens_reach_the_job(client: Any) -> None:
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0,
                                    extra_body={**IDS, "add_special_tokens": False}).choices[0]
    assert out.prompt_token_ids == [ord("H") + 3, ord("i") + 3]  # no BOS (2)
    job = to_job(CompletionRequest(prompt="x", skip_special_tokens=False, include_stop_str_in_output=True),
                 [2, 5], max_model_len=64, vocab_size=259)
    assert (job.special_tokens, job.stop_text) == (SpecialTokens.KEEP, StopText.KEEP)


def _stream_first_event_s(server: ServeServer, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: "):
                first_s, event = time.perf_counter() - start, json.loads(line[6:])
                break
        response.read()
    return first_s, event


def test_chat_stream_sends_the_role_with_the_first_token(server: ServeServer) -> None:
    """Client-side TTFT is at least the server's own (role chunk no longer sent before prefill)."""
    content = "".join(f"line {i}: the hybrid cache keeps windows short.\n" for i in range(60))  # ~3,000 chars
    name = "hybridkv_serve_time_to_first_token_seconds_sum"
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}),
        ("/v1/completions", {"prompt": content}),
    ]:
        before = metric(server, name)
        client_ttft, event = _stream_first_event_s(server, path, {
            "model": MODEL, "max_tokens": 3, "stream": True, "logprobs": True if "messages" in body else 1,
            "ignore_eos": True, **body})
        server_ttft = metric(server, name) - before
        assert server_ttft > 0.02  # a real prefill of ~3,000 tokens (the test would prove nothing otherwise)
        assert client_ttft >= server_ttft, (path, client_ttft, server_ttft)
        choice = event["choices"][0]
        if "messages" in body:
            assert choice["delta"]["role"] == "assistant" and len(choice["logprobs"]["content"]) == 1
        else:
            assert len(choice["logprobs"]["tokens"]) == 1
