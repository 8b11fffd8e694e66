"""The OpenAI request bodies `hybridkv serve` accepts, decoded strictly, and what they ask the engine.

Bodies are msgspec structs that forbid unknown fields, so a misspelt or unsupported field is a
400 that names it, as OpenAI's API answers. Fields OpenAI defines that the engine cannot honour
(penalties, `logit_bias`, `n > 1`, tools, ...) are accepted only at their neutral value. vLLM's
extensions that fit the engine are accepted too: `top_k`, `ignore_eos`, `return_token_ids`
(adds `prompt_token_ids` and `token_ids` to each choice) and `return_tokens_as_token_ids`
(logprob tokens spelt `token_id:<id>`, so tokens that decode alike stay apart) and `cache_salt`
(requests with different salts share no cached block, locally or on the KV cache server).

`to_job` turns a decoded body plus its prompt ids into a `GenerationJob`: engine sampling
parameters, stop strings, streaming and logprob options, all checked against the model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec

from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.errors import ConfigError, HybridKVError

MAX_LOGPROBS = 20  # top log-probabilities per token, as vLLM's default limit
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(HybridKVError, ValueError):
    """A request the server refuses: an OpenAI-style error body with this HTTP status."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = 0  # extension: 0 or -1 = off
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension
    return_tokens_as_token_ids: bool = False  # extension: logprob tokens as "token_id:<id>"
    cache_salt: str | None = None  # extension: requests of different salts share no cached block


class CompletionRequest(_Common):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str = ""


Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's text; BadRequest for a non-text content part."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise BadRequest(f"messages[{index}] has a content part of type {part.type!r}; this server "
                                 "accepts only text parts", param="messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


Body = CompletionRequest | ChatCompletionRequest


def decode_body(raw: bytes, kind: type[Body]) -> Body:
    """The strictly decoded body; BadRequest naming the field for a wrong type or an unknown field."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0] if "`$." in text else None
        if "Invalid enum value" in text and text.endswith(".role`"):
            text = f"{text}; expected one of {', '.join(ROLES)}"
        if "unknown field" in text:
            param = text.split("`", 2)[1]
            text = f"{text}; see the README's serve section for the fields this server accepts"
        raise BadRequest(f"invalid request body: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion body: text, or token ids (a list of one of either is accepted)."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty; expected at least one character or token id", param="prompt")
        return prompt
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest(f"got a batch of {len(prompt)} prompts; this server takes one prompt per request",
                         param="prompt")
    try:
        ids = [operator.index(t) for t in prompt if not isinstance(t, bool)]
    except TypeError:
        ids = []
    if len(ids) != len(prompt) or not prompt:
        what = "an empty list" if not prompt else f"a list with {_first_non_int(prompt)!r}"
        raise BadRequest(f"prompt must be a non-empty string or a non-empty list of integer token ids; got {what}",
                         param="prompt")
    return ids


def _first_non_int(items: list[Any]) -> Any:
    return next(t for t in items if isinstance(t, bool) or not isinstance(t, int))


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationJob:
    """What one HTTP request asks of the engine, validated against the model."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]  # stop strings: the text ends before the first one found
    stream: bool
    include_usage: bool
    logprobs: int | None  # top log-probabilities per token; None: no logprobs
    return_token_ids: bool
    tokens_as_ids: bool  # logprob tokens as "token_id:<id>"
    cache_salt: str | None


def to_job(body: Body, prompt_ids: list[int], *, max_model_len: int, vocab_size: int) -> GenerationJob:
    """The engine job of a decoded body whose prompt is `prompt_ids`; BadRequest for what cannot run."""
    _refuse_unsupported(body)
    chat = isinstance(body, ChatCompletionRequest)
    logprobs = _logprobs(body)
    max_tokens, name = body.max_tokens, "max_tokens"
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max(max_model_len - len(prompt_ids), 1) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise BadRequest(f"{name} must be at least 1, got {max_tokens}", param=name)
    if len(prompt_ids) + max_tokens > max_model_len:
        total = len(prompt_ids) + max_tokens
        raise BadRequest(f"this model's maximum context length is {max_model_len} tokens, but {total} "
                         f"were requested ({len(prompt_ids)} in the prompt, {max_tokens} for the completion); reduce "
                         f"the prompt or {name}", param=name)
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty", param="stop")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise BadRequest(f"seed must be in [0, 2**63), got {body.seed}", param="seed")
    if logprobs is not None and logprobs > vocab_size:
        raise BadRequest(f"{logprobs} logprobs asked; the vocabulary has {vocab_size} tokens", param="logprobs")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
            seed=body.seed, eos=EosMode.IGNORE if body.ignore_eos else EosMode.STOP,
            logprobs=0 if logprobs is None else max(logprobs, 1))
    except ConfigError as exc:
        raise BadRequest(str(exc), param=str(exc).split(" ", 1)[0]) from None
    return GenerationJob(prompt_ids=prompt_ids, sampling=sampling, stop=stops, stream=body.stream,
                         include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         logprobs=logprobs, return_token_ids=body.return_token_ids,
                         tokens_as_ids=body.return_tokens_as_token_ids, cache_salt=body.cache_salt)


def _logprobs(body: Body) -> int | None:
    if isinstance(body, CompletionRequest):
        count, name = body.logprobs, "logprobs"
    else:
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        count, name = (body.top_logprobs or 0) if body.logprobs else None, "top_logprobs"
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {count}", param=name)
    return count


def _refuse_unsupported(body: Body) -> None:
    """BadRequest for an OpenAI field set to a value the engine cannot honour."""
    neutral: list[tuple[str, bool]] = [
        ("n", body.n == 1), ("presence_penalty", body.presence_penalty == 0.0),
        ("frequency_penalty", body.frequency_penalty == 0.0), ("logit_bias", not body.logit_bias),
    ]
    if isinstance(body, CompletionRequest):
        neutral += [("echo", not body.echo), ("suffix", body.suffix is None), ("best_of", body.best_of in (None, 1))]
    else:
        response_type = (body.response_format or {}).get("type", "text")
        neutral += [("tools", not body.tools), ("tool_choice", body.tool_choice in (None, "none")),
                    ("response_format", response_type == "text")]
    for name, ok in neutral:
        if not ok:
            value = getattr(body, name)
            raise BadRequest(f"{name}={value!r} is not supported by this server (the reference engine has no "
                             f"{'parallel sampling' if name == 'n' else name.replace('_', ' ')}); "
                             f"leave it at its default", param=name)
