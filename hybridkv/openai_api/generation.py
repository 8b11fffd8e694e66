"""One HTTP request's generation: engine stream -> text pieces, stop strings, metrics, abort.

`Generation.pieces()` submits the job to the engine loop and yields one `Piece` per step that
produced tokens. It aborts the request (freeing its blocks) when a stop string ends the text,
and in its `finally` when the consumer goes away first: a client disconnect cancels the
consumer, which closes this generator.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from hybridkv.engine.outputs import RequestOutput, StepOutput
from hybridkv.engine.request import FinishReason
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.openai_api.engine_loop import EngineLoop
from hybridkv.openai_api.metrics import ServeMetrics
from hybridkv.openai_api.schemas import GenerationJob
from hybridkv.openai_api.text import StopText, TextStream

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.MODEL_LENGTH: "length"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """What one engine step added to a request's answer."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str | None  # set on the last piece


class Generation:
    """Runs one job through the engine loop; after `pieces()` is exhausted, holds the whole answer."""

    def __init__(self, engine: EngineLoop, tokenizer: Tokenizer, metrics: ServeMetrics, job: GenerationJob,
                 *, endpoint: str) -> None:
        self.engine, self.metrics, self.job, self.endpoint = engine, metrics, job, endpoint
        self.text = TextStream(functools.partial(tokenizer.decode, special=job.special_tokens), job.stop,
                               job.stop_text)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.output: RequestOutput | None = None  # the engine's output, when it ran to its end
        self.created = int(time.time())
        self._arrival_s = time.perf_counter()
        self._last_token_s: float | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        stream = self.engine.submit(self.job.prompt_ids, self.job.sampling, cache_salt=self.job.cache_salt,
                                    cache_checkpoints=self.job.cache_checkpoints)
        self.metrics.prompt_tokens.inc(len(self.job.prompt_ids))
        try:
            while self.finish_reason is None:
                out = await stream.get()
                self._observe(len(out.new_token_ids))
                text = self.text.add(self._text_ids(out), final=out.done)
                self.token_ids += out.new_token_ids
                self.logprobs += out.new_logprobs
                if self.text.stopped:
                    self.finish_reason = "stop"
                    self.engine.abort(stream)
                elif out.finished is not None:
                    self.output = out.finished
                    self.finish_reason = FINISH_REASONS[out.finished.finish_reason]
                yield Piece(text=text, token_ids=out.new_token_ids, logprobs=out.new_logprobs,
                            finish_reason=self.finish_reason)
        finally:
            if not stream.finished:
                self.engine.abort(stream)  # the client left, or the consumer failed
            self.metrics.requests.labels(self.endpoint, self.finish_reason or "abort").inc()
            if self._last_token_s is not None:
                self.metrics.e2e.observe(self._last_token_s - self._arrival_s)

    def _text_ids(self, out: StepOutput) -> list[int]:
        """The new ids whose text the answer shows: a stop token's own is left out (as vLLM does)
        unless the request keeps stop text."""
        ids = out.new_token_ids
        stopped = out.finished is not None and out.finished.finish_reason is FinishReason.STOP
        return ids[:-1] if stopped and ids and self.job.stop_text is StopText.DROP else ids

    def _observe(self, new_tokens: int) -> None:
        if not new_tokens:
            return
        now = time.perf_counter()
        if self._last_token_s is None:
            self.metrics.ttft.observe(now - self._arrival_s)
        else:
            self.metrics.itl.observe(now - self._last_token_s)
        self._last_token_s = now
        self.metrics.generation_tokens.inc(new_tokens)

    async def run(self) -> None:
        """Consume every piece (the non-streaming path)."""
        async for _ in self.pieces():
            pass
