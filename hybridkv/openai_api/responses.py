"""OpenAI response bodies and stream chunks of `/v1/completions` and `/v1/chat/completions`.

Shapes follow OpenAI's API reference, so the official clients parse them; `token_ids` and
`prompt_token_ids` on a choice are vLLM's extension, present when the request set
`return_token_ids`. A token's text in logprobs is the decoding of that token alone (a byte of
a multi-byte character decodes to U+FFFD, as in other servers), or `token_id:<id>` when the
request set `return_tokens_as_token_ids`.
"""

from __future__ import annotations

from typing import Any

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.openai_api.generation import Generation, Piece


class ResponseWriter:
    """Builds the bodies of one request (ids, model name and the tokenizer for logprob tokens)."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer, *, model: str, request_id: str, chat: bool) -> None:
        self.gen, self.tokenizer, self.model, self.id, self.chat = gen, tokenizer, model, request_id, chat
        self._text_offset = 0  # completions logprobs: offset of the next token's text

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.gen.created, "model": self.model}

    def usage(self) -> dict[str, Any]:
        """Token counts; `prompt_tokens_details.cached_tokens` (local + KV cache server hits) once known."""
        prompt, completion = len(self.gen.job.prompt_ids), len(self.gen.token_ids)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.gen.output is not None:
            metrics = self.gen.output.metrics
            usage["prompt_tokens_details"] = {"cached_tokens": metrics.prefix_hit_tokens + metrics.external_hit_tokens}
        return usage

    def _ids(self, token_ids: list[int], *, first: bool) -> dict[str, Any]:
        if not self.gen.job.return_token_ids:
            return {}
        return {"token_ids": token_ids, **({"prompt_token_ids": self.gen.job.prompt_ids} if first else {})}

    def full(self) -> dict[str, Any]:
        """The non-streaming body, once the generation ran to its end."""
        gen = self.gen
        logprobs = self._logprobs(gen.token_ids, gen.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text.text},
                      "logprobs": logprobs, "finish_reason": gen.finish_reason}
        else:
            choice = {"index": 0, "text": gen.text.text, "logprobs": logprobs, "finish_reason": gen.finish_reason}
        choice.update(self._ids(gen.token_ids, first=True))
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self.usage()}

    def chunk(self, piece: Piece, *, first: bool) -> dict[str, Any] | None:
        """The stream chunk of one piece; None when it carries nothing a client would see.

        The first chunk goes out with the first generated token even when its text is still held
        back (so a client's time to first token is the engine's), and in a chat stream it carries
        the assistant's role, as vLLM sends it: no chunk is sent before prefill ends."""
        job = self.gen.job
        if not (piece.text or piece.finish_reason or job.return_token_ids or (first and piece.token_ids)
                or (job.logprobs is not None and piece.token_ids)):
            return None
        logprobs = self._logprobs(piece.token_ids, piece.logprobs)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": piece.text} if first else (
                {"content": piece.text} if piece.text else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": piece.finish_reason}
        else:
            choice = {"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        choice.update(self._ids(piece.token_ids, first=first))
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage()}

    def _token_text(self, ids: list[int]) -> str:
        return f"token_id:{ids[0]}" if self.gen.job.tokens_as_ids else self.tokenizer.decode(ids)

    def _logprobs(self, token_ids: list[int], rows: list[dict[int, float]]) -> dict[str, Any] | None:
        k = self.gen.job.logprobs
        if k is None or not rows:
            return None if k is None else ({"content": []} if self.chat else _empty_completion_logprobs())
        decode = self._token_text
        if self.chat:
            return {"content": [{
                "token": decode([t]), "logprob": row[t], "bytes": list(decode([t]).encode()),
                "top_logprobs": [{"token": decode([i]), "logprob": v, "bytes": list(decode([i]).encode())}
                                 for i, v in list(row.items())[:k]],
            } for t, row in zip(token_ids, rows, strict=True)]}
        tokens = [decode([t]) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": [row[t] for t, row in zip(token_ids, rows, strict=True)],
                "top_logprobs": [{decode([i]): v for i, v in list(row.items())[:k]} for row in rows],
                "text_offset": offsets}


def _empty_completion_logprobs() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
