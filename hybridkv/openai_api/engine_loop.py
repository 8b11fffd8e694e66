"""The one thread that owns the engine: requests come in through a queue, tokens go out per request.

The engine is not thread-safe, so every call on the `LLM` happens on this thread:

    HTTP handlers (event loop)                 engine thread
    submit(prompt, sampling) --Add-->  inbox  --> llm.add_request
    abort(stream)            --Abort-->       --> llm.abort (blocks freed)
    await call(fn)           --Call-->        --> fn(llm), between two steps (call_sync: other threads)
                                               while llm.has_unfinished: llm.step()
    stream.get() <-- call_soon_threadsafe ---- each StepOutput, to its request's stream

Before every step the thread takes every command waiting in the inbox, so a request that
arrives while others run joins the next step's batch (continuous batching); with nothing to
run it sleeps on the inbox. If a step raises, every request in flight gets the error (their
blocks are freed) and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hybridkv.engine.llm import LLM
from hybridkv.engine.outputs import StepOutput
from hybridkv.engine.sampler import SamplingParams

log = logging.getLogger("hybridkv.openai_api")
T = TypeVar("T")


class RequestStream:
    """One request's StepOutputs (or the error that ended it), read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self.request_id: str | None = None  # set by the engine thread once added
        self.finished = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def put(self, item: StepOutput | BaseException) -> None:
        """Called on the engine thread (one wake-up of the event loop per call)."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def put_here(self, item: StepOutput | BaseException) -> None:
        """Called on the event loop."""
        self._queue.put_nowait(item)

    async def get(self) -> StepOutput:
        """The next StepOutput; raises what the engine raised for this request."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.done:
            self.finished = True
        return item


@dataclass(slots=True)
class _Add:
    prompt_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    stream: RequestStream
    cache_checkpoints: tuple[int, ...] = ()


@dataclass(slots=True)
class _Abort:
    stream: RequestStream


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLM], Any]
    future: asyncio.Future[Any] | concurrent.futures.Future[Any] = field(repr=False)
    loop: asyncio.AbstractEventLoop | None  # None: `future` is a concurrent one

    def deliver(self, result: Any, exc: BaseException | None) -> None:
        """Called on the engine thread: resolve the future on its own loop (or directly)."""
        if self.loop is None:
            assert isinstance(self.future, concurrent.futures.Future)
            _resolve(self.future, result, exc)
        else:
            self.loop.call_soon_threadsafe(_resolve, self.future, result, exc)


class _Stop:
    pass


class EngineLoop:
    """Runs `llm` on a background thread (see the module docstring)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort whatever still runs and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, *,
               cache_salt: str | None = None, cache_checkpoints: tuple[int, ...] = ()) -> RequestStream:
        """Queue a request; its tokens arrive on the returned stream (call on the event loop)."""
        stream = RequestStream(asyncio.get_running_loop())
        self._inbox.put(_Add(prompt_ids, sampling, cache_salt, stream, cache_checkpoints))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stop the stream's request and free its blocks (a no-op once it finished)."""
        if not stream.finished:
            self._inbox.put(_Abort(stream))

    async def call(self, fn: Callable[[LLM], T]) -> T:
        """`fn(llm)` run on the engine thread between two steps; its result or its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._put_call(_Call(fn, future, loop))
        return await future

    def call_sync(self, fn: Callable[[LLM], T], timeout_s: float = 30.0) -> T:
        """`call` for a thread outside the event loop (tests, benchmarks): blocks until done."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put_call(_Call(fn, future, None))
        return future.result(timeout_s)

    def _put_call(self, call: _Call) -> None:
        if not self.alive:
            raise RuntimeError("the engine thread is not running")
        self._inbox.put(call)

    def _run(self) -> None:
        while True:
            commands = [self._inbox.get()] if not self.llm.has_unfinished else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if isinstance(command, _Stop):
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return
                self._handle(command)
            if self.llm.has_unfinished:
                self._step()

    def _handle(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            try:
                request_id = self.llm.add_request(command.prompt_ids, command.sampling,
                                                  cache_salt=command.cache_salt,
                                                  cache_checkpoints=command.cache_checkpoints)
            except Exception as exc:  # a prompt the engine refuses: that request's error only
                command.stream.put(exc)
                return
            command.stream.request_id = request_id
            self._streams[request_id] = command.stream
        elif isinstance(command, _Abort):
            aborted = command.stream.request_id
            if aborted is not None and self._streams.pop(aborted, None) is not None:
                self.llm.abort(aborted)
        else:
            try:
                result = command.fn(self.llm)
            except Exception as exc:
                command.deliver(None, exc)
            else:
                command.deliver(result, None)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:
            log.exception("engine step failed; failing the %d request(s) in flight", len(self._streams))
            self._fail_all(exc)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StepOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream, out))
            if out.done:
                del self._streams[out.request_id]
        for loop, items in by_loop.items():  # one wake-up per step, not one per request
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.llm.abort(request_id)
            stream.put(exc)
        self._streams.clear()


def _put_all(items: list[tuple[RequestStream, StepOutput]]) -> None:
    for stream, out in items:
        stream.put_here(out)


def _resolve(future: asyncio.Future[Any] | concurrent.futures.Future[Any], result: Any,
             exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
