"""The bad-request catalogue: each gets a 4xx with an OpenAI-style error body saying what was wrong,
and the server keeps serving."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.openai_api.http_server import ServeServer
from tests.openai_api.conftest import MODEL, http

openai = pytest.importorskip("openai")

OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    # (id, path, body, status, param, message fragment)
    ("wrong-type", "/v1/completions", {**OK, "max_tokens": "ten"}, 400, "max_tokens",
     "Expected `int | null`, got `str` - at `$.max_tokens`"),
    ("unknown-field", "/v1/completions", {**OK, "max_tokenz": 3}, 400, "max_tokenz", "unknown field `max_tokenz`"),
    ("bool-as-int", "/v1/completions", {**OK, "seed": True}, 400, "seed", "got `bool`"),
    ("beyond-model-length", "/v1/completions", {**OK, "max_tokens": 5000}, 400, "max_tokens",
     "maximum context length is 4096 tokens, but 5003 were requested (3 in the prompt, 5000 for the completion)"),
    ("prompt-beyond-model-length", "/v1/completions", {**OK, "prompt": [5] * 4097}, 400, "prompt",
     "has 4097 tokens; expected at most max_model_len 4096"),
    ("empty-prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "prompt is empty"),
    ("empty-id-list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt", "got an empty list"),
    ("non-int-id", "/v1/completions", {**OK, "prompt": [5, "x"]}, 400, "prompt", "got a list with 'x'"),
    ("id-out-of-vocab", "/v1/completions", {**OK, "prompt": [5, 300]}, 400, "prompt",
     "token ids must lie in [0, 259), got min 5 and max 300"),
    ("batch-of-prompts", "/v1/completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("n-above-1", "/v1/completions", {**OK, "n": 2}, 400, "n", "n=2 is not supported"),
    ("zero-max-tokens", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "at least 1, got 0"),
    ("negative-temperature", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature",
     "temperature must be >= 0"),
    ("top-p-zero", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("too-many-logprobs", "/v1/completions", {**OK, "logprobs": 50}, 400, "logprobs", "in [0, 20], got 50"),
    ("penalty-out-of-range", "/v1/completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty",
     "presence_penalty must be in [-2, 2] (0 = off), got 2.5"),
    ("negative-top-k", "/v1/completions", {**OK, "top_k": -5}, 400, "top_k",
     "top_k must be -1 or 0 (off) or a positive integer, got -5"),
    ("min-p-above-1", "/v1/completions", {**OK, "min_p": 1.5}, 400, "min_p", "min_p must be in [0, 1]"),
    ("zero-repetition-penalty", "/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty",
     "repetition_penalty must be > 0 (1 = off), got 0"),
    ("min-tokens-above-max", "/v1/completions", {**OK, "min_tokens": 3}, 400, "min_tokens",
     "min_tokens must be in [0, max_tokens = 2], got 3"),
    ("stop-token-out-of-vocab", "/v1/completions", {**OK, "stop_token_ids": [1, 400]}, 400, "stop_token_ids",
     "stop_token_ids must lie in [0, 259)"),
    ("beam-search", "/v1/completions", {**OK, "use_beam_search": True}, 400, "use_beam_search",
     "use_beam_search=True is not supported by this server (the reference engine has no beam search); leave it "
     "out or set it to False"),
    ("logit-bias", "/v1/completions", {**OK, "logit_bias": {"5": 1.0}}, 400, "logit_bias", "has no logit bias"),
    ("prompt-logprobs", "/v1/completions", {**OK, "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
    ("allowed-token-ids", "/v1/completions", {**OK, "allowed_token_ids": [5]}, 400, "allowed_token_ids",
     "not supported"),
    ("echo", "/v1/completions", {**OK, "echo": True}, 400, "echo", "no prompt echo"),
    ("empty-stop", "/v1/completions", {**OK, "stop": [""]}, 400, "stop", "must not be empty"),
    ("unknown-model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model", "'gpt-9' does not exist"),
    ("not-json", "/v1/completions", b"{prompt: hi", 400, None, "not valid JSON"),
    ("not-utf8", "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None,
     "the request body is not valid UTF-8 (JSON must be): it has the byte 0xff"),
    ("unknown-model-retrieved", "/v1/models/gpt-9", None, 404, "model", "'gpt-9' does not exist"),
    ("no-prompt", "/v1/completions", {"model": MODEL}, 400, None, "missing required field `prompt`"),
    ("chat-no-messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "messages is empty"),
    ("chat-bad-role", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages", "Invalid enum value 'wizard' - at `$.messages[0].role`; expected one of system, developer"),
    ("chat-image", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages",
     "messages[0] has a content part of type 'image_url'; this server is text-only"),
    ("chat-tool-message", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]}, 400, "messages", "text-only chat (no tools)"),
    ("chat-tool-calls", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c1"}]}]}, 400, "messages", "text-only chat (no tools)"),
    ("chat-no-content", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, 400, "messages",
     "messages[0] (user) has no content"),
    ("chat-text-part-without-text", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}, 400, "messages", "whose text is None"),
    ("chat-continue-final", "/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400,
     "continue_final_message", "not supported"),
    ("chat-top-logprobs-alone", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "needs logprobs set to true"),
    ("chat-tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools",
     "not supported"),
    ("unknown-route", "/v1/embeddings", OK, 404, None, "Not Found"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_gets_an_openai_error(server: ServeServer, path: str, body: Any, status: int,
                                          param: str | None, message: str) -> None:
    got, reply = http(server, path, body)
    assert got == status, reply
    error = reply["error"]
    assert message in error["message"], error
    if param is not None:
        assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_bad_request_and_the_server_keeps_serving(client: Any) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=3).usage.completion_tokens >= 1
