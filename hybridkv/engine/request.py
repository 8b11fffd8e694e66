"""An engine request: the manager-facing `KVRequest` plus sampling, outputs and timing.

    token_ids = | prompt | generated |
                ^0       ^prompt_len ^num_tokens
    num_computed_tokens: how many of token_ids have K/V in the cache (reset to 0 on preemption)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.request import KVRequest
from hybridkv.scheduling.scheduler import KVRequestView, RequestStatus


class FinishReason(Enum):
    """Why a request stopped: an EOS/stop token, `max_tokens`, or the model length limit."""

    STOP = "stop"
    LENGTH = "length"
    MODEL_LENGTH = "model_length"


@dataclass(slots=True, kw_only=True)
class Request(KVRequestView):
    """One generation request as the scheduler and engine track it."""

    kv: KVRequest
    arrival_seq: int  # arrival order; the latest-arrived running request is preempted first
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator
    arrival_s: float
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    prefix_hit_tokens: int = -1  # local prefix-cache hit of the first schedule; -1 until then
    external_hit_tokens: int = 0  # tokens the KV connector loaded at the first schedule
    computed_prefill_tokens: int = 0  # prompt tokens the engine computed itself (recomputes included)
    num_preemptions: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token, if asked

    @property
    def output_ids(self) -> list[int]:
        return self.kv.token_ids[self.prompt_len :]

    def append_token(self, token: int, *, now_s: float, max_model_len: int) -> None:
        """Add a sampled token and finish the request if it hit a stop condition."""
        self.kv.token_ids.append(token)
        if self.first_token_s is None:
            self.first_token_s = now_s
        stops = self.sampling.stop_token_ids + (self.eos_token_ids if self.sampling.eos is EosMode.STOP else ())
        if token in stops:
            self.finish(FinishReason.STOP, now_s)
        elif len(self.output_ids) >= self.sampling.max_tokens:
            self.finish(FinishReason.LENGTH, now_s)
        elif self.num_tokens >= max_model_len:
            self.finish(FinishReason.MODEL_LENGTH, now_s)

    def finish(self, reason: FinishReason, now_s: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_s = now_s
