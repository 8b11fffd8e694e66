"""What the engine reports: a finished request's output, and per step which live request got which
new tokens.

`LLM.add_request` registers a request here, `LLM.step` runs one engine step and asks
`LiveRequests.step_outputs` what changed, `LLM.abort` takes a request out. `LLM.generate` is a
loop over these three, so batch generation and a server share one code path:

    add_request(prompt) -> id           queued (FCFS); joins the next step's batch
    step() -> [StepOutput, ...]         one per request that got tokens (or finished) this step
    abort(id)                           freed: blocks back to the pool, never reported again

A request's generated tokens only grow: preemption recomputes its K/V but keeps its tokens, so
"new tokens" is everything after the count already reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridkv.engine.request import FinishReason, Request
from hybridkv.kvcache.ids import RequestId


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestMetrics:
    """Timing and cache use of one request (seconds from its arrival in `generate`)."""

    ttft_s: float
    latency_s: float
    prefix_hit_tokens: int  # served by the local prefix cache
    num_preemptions: int
    external_hit_tokens: int = 0  # loaded from the KV cache server
    computed_prefill_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)

    @property
    def local_hit_tokens(self) -> int:
        return self.prefix_hit_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    metrics: RequestMetrics
    logprobs: list[dict[int, float]]  # per generated token: top `SamplingParams.logprobs` ids (+ its own) -> logprob


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOutput:
    """What one step produced for one request: its new tokens, and its whole output if it finished."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]  # one per new token when the request asked for logprobs
    finished: RequestOutput | None  # set in the step the request finished; it is then forgotten

    @property
    def done(self) -> bool:
        return self.finished is not None


class LiveRequests:
    """Requests added and not yet finished or aborted, with how many of their tokens were reported."""

    def __init__(self) -> None:
        self._requests: dict[RequestId, Request] = {}
        self._reported: dict[RequestId, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def add(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._reported[request.request_id] = 0

    def pop(self, request_id: str) -> Request | None:
        """The live request with this id, now forgotten; None if it is unknown or already finished."""
        self._reported.pop(RequestId(request_id), None)
        return self._requests.pop(RequestId(request_id), None)

    def step_outputs(self, finished: list[Request],
                     output: Callable[[Request], RequestOutput]) -> list[StepOutput]:
        """Per live request with new tokens or in `finished`: a StepOutput (finished ones are forgotten)."""
        done = {r.request_id for r in finished}
        outputs: list[StepOutput] = []
        for request_id, request in list(self._requests.items()):
            sent, total = self._reported[request_id], len(request.output_ids)
            if total == sent and request_id not in done:
                continue
            outputs.append(StepOutput(
                request_id=request_id, new_token_ids=request.output_ids[sent:total],
                new_logprobs=request.logprobs[sent:total],
                finished=output(request) if request_id in done else None))
            if request_id in done:
                self.pop(request_id)
            else:
                self._reported[request_id] = total
        return outputs
