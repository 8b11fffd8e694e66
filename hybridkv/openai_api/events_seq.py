"""`x-hybridkv-kv-events-seq`: how many KV event batches the engine had published when it answered.

With `--kv-events-config`, every response of `/v1/...` carries the number of event batches the
engine has queued for publishing so far, which is the sequence number its next batch will carry.
For a non-streamed completion that count includes the batch of the request's own last step (the
engine publishes a step's events before it hands out the step's outputs). A router that remembers
the latest number per engine can tell when the index's answer (`events_seq` per instance) is
older than what it has already seen: `hybridkv route` then asks again (docs/routing.md).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridkv.kv_events.publisher import ZmqPublisher

__all__ = ["EVENTS_SEQ_HEADER", "EventsSeqHeader"]

EVENTS_SEQ_HEADER = "x-hybridkv-kv-events-seq"


class EventsSeqHeader:
    """ASGI middleware adding EVENTS_SEQ_HEADER to every `/v1/` response."""

    def __init__(self, app: ASGIApp, publisher: ZmqPublisher) -> None:
        self.app = app
        self._publisher = publisher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def send_with_seq(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []),
                           (EVENTS_SEQ_HEADER.encode(), str(self._publisher.queued_batches).encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_seq)
