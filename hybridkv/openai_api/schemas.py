"""The OpenAI request bodies `hybridkv serve` accepts, decoded strictly, and what they ask the engine.

Bodies are msgspec structs that forbid unknown fields, so a misspelt or unsupported field is a
400 that names it, as OpenAI's API answers. Fields the engine cannot honour (`logit_bias`,
`n > 1`, tools, beam search, ...) are accepted only at their neutral value, so clients that
always send them (vLLM's `vllm bench serve` sends `"repetition_penalty": 1.0`) work. vLLM's
sampling extensions are honoured: `top_k` (0 or -1 = off), `min_p`, `repetition_penalty`,
`presence_penalty`, `frequency_penalty`, `seed`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `add_special_tokens` (completions), and so
are `return_token_ids` (adds `prompt_token_ids` and `token_ids` to each choice),
`return_tokens_as_token_ids` (logprob tokens spelt `token_id:<id>`, so tokens that decode alike
stay apart) and `cache_salt` (requests with different salts share no cached block, locally or on
the KV cache server). docs/serve.md lists every field.

`to_job` turns a decoded body plus its prompt ids into a `GenerationJob`: engine sampling
parameters, stop strings, streaming and logprob options, all checked against the model.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec

from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.engine.tokenizer import SpecialTokens
from hybridkv.errors import ConfigError, HybridKVError
from hybridkv.openai_api.text import StopText

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
    # vLLM's extensions, honoured
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:<id>"
    cache_salt: str | None = None  # requests of different salts share no cached block
    # token positions where later requests will resume (state checkpoints kept there; chat: turn ends too)
    cache_checkpoints: list[int] | None = None
    # vLLM's extensions, accepted at their neutral value only
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True
    priority: int = 0
    structured_outputs: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # extension: False tokenizes the prompt text without BOS


Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The message's text; BadRequest for a non-text part, a tool message, or no content."""
        if self.role == "tool" or self.tool_calls or self.tool_call_id is not None:
            raise BadRequest(f"messages[{index}] is a tool call or tool result; this server serves text-only chat "
                             "(no tools)", param="messages")
        if self.content is None:
            if self.role != "assistant":
                raise BadRequest(f"messages[{index}] ({self.role}) has no content; expected a string or a list "
                                 "of text parts", param="messages")
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            kind, text = part.get("type"), part.get("text")
            if kind != "text":
                raise BadRequest(f"messages[{index}] has a content part of type {kind!r}; this server is text-only "
                                 "and accepts only parts of type 'text'", param="messages")
            if not isinstance(text, str):
                raise BadRequest(f"messages[{index}] has a text part whose text is {text!r}; expected a string",
                                 param="messages")
            texts.append(text)
        return "".join(texts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension, neutral only
    continue_final_message: bool = False  # extension, neutral only
    chat_template: str | None = None  # extension, neutral only
    chat_template_kwargs: dict[str, Any] | None = None  # extension, neutral only


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
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (JSON must be): it has the byte "
                         f"{exc.object[exc.start]:#04x}") from None


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
    stop_text: StopText  # KEEP: the text ends after the stop string (or stop token) instead
    special_tokens: SpecialTokens  # how the text decodes special tokens
    stream: bool
    include_usage: bool
    logprobs: int | None  # top log-probabilities per token; None: no logprobs
    return_token_ids: bool
    tokens_as_ids: bool  # logprob tokens as "token_id:<id>"
    cache_salt: str | None
    cache_checkpoints: tuple[int, ...] = ()  # the body's hint, plus a chat's turn ends


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
    if logprobs is not None and logprobs > vocab_size:
        raise BadRequest(f"{logprobs} logprobs asked; the vocabulary has {vocab_size} tokens", param="logprobs")
    sampling = _sampling(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size)
    return GenerationJob(prompt_ids=prompt_ids, sampling=sampling, stop=stops,
                         stop_text=StopText.KEEP if body.include_stop_str_in_output else StopText.DROP,
                         special_tokens=SpecialTokens.SKIP if body.skip_special_tokens else SpecialTokens.KEEP,
                         stream=body.stream,
                         include_usage=bool(body.stream_options and body.stream_options.include_usage),
                         logprobs=logprobs, return_token_ids=body.return_token_ids,
                         tokens_as_ids=body.return_tokens_as_token_ids, cache_salt=body.cache_salt,
                         cache_checkpoints=_checkpoints(body.cache_checkpoints, len(prompt_ids)))


def _sampling(body: Body, *, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
    """The engine's sampling parameters; BadRequest naming the field for a value out of range."""
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise BadRequest(f"seed must be in [0, 2**63), got {body.seed}", param="seed")
    if body.top_k < -1:
        raise BadRequest(f"top_k must be -1 or 0 (off) or a positive integer, got {body.top_k}", param="top_k")
    stop_ids = tuple(body.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise BadRequest(f"stop_token_ids must lie in [0, {vocab_size}) (the vocabulary), got {list(stop_ids)}",
                         param="stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0),
            min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, min_tokens=body.min_tokens, stop_token_ids=stop_ids,
            seed=body.seed, eos=EosMode.IGNORE if body.ignore_eos else EosMode.STOP,
            logprobs=0 if logprobs is None else max(logprobs, 1))
    except ConfigError as exc:
        raise BadRequest(str(exc), param=str(exc).split(" ", 1)[0]) from None


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


# (field, value that means "off", what the engine lacks): accepted only at that value
_NEUTRAL: tuple[tuple[str, Any, str], ...] = (
    ("n", 1, "parallel sampling"), ("logit_bias", None, "logit bias"), ("use_beam_search", False, "beam search"),
    ("length_penalty", 1.0, "beam search"), ("allowed_token_ids", None, "allowed-token masks"),
    ("bad_words", None, "bad-word masks"), ("prompt_logprobs", None, "prompt logprobs"),
    ("truncate_prompt_tokens", None, "prompt truncation"),
    ("spaces_between_special_tokens", True, "option to join special tokens without spaces"),
    ("priority", 0, "priority scheduling"), ("structured_outputs", None, "structured outputs"),
    ("logits_processors", None, "custom logits processors"),
)
_COMPLETION_NEUTRAL = (("echo", False, "prompt echo"), ("suffix", None, "suffix insertion"),
                       ("best_of", 1, "best-of sampling"))
_CHAT_NEUTRAL = (("tools", None, "tools"), ("tool_choice", "none", "tools"),
                 ("response_format", "text", "structured outputs"), ("add_generation_prompt", True, "option"),
                 ("continue_final_message", False, "option"), ("chat_template", None, "per-request chat templates"),
                 ("chat_template_kwargs", None, "chat template arguments"))


def _refuse_unsupported(body: Body) -> None:
    """BadRequest naming the first field set to a value the engine cannot honour."""
    table = _NEUTRAL + (_COMPLETION_NEUTRAL if isinstance(body, CompletionRequest) else _CHAT_NEUTRAL)
    for name, neutral, lacks in table:
        value = getattr(body, name)
        if name == "response_format":
            value = (value or {}).get("type", "text")
        if value in (None, [], {}) or value == neutral:  # None / empty: the field was left out
            continue
        what = "that option" if lacks == "option" else lacks
        raise BadRequest(f"{name}={value!r} is not supported by this server (the reference engine has no {what}); "
                         f"leave it out or set it to {neutral!r}", param=name)


def _checkpoints(points: list[int] | None, prompt_len: int) -> tuple[int, ...]:
    """The body's `cache_checkpoints`: positive token positions (those past the prompt are dropped)."""
    if points is None:
        return ()
    if any(isinstance(p, bool) or not isinstance(p, int) or p <= 0 for p in points):
        raise BadRequest(f"cache_checkpoints must be positive token positions, got {points[:8]!r}",
                         param="cache_checkpoints")
    return tuple(sorted({p for p in points if p < prompt_len}))
