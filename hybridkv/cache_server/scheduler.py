"""Fair slicing between the control channel's connections.

Every request becomes a task: steps that yield between bounded slices of work (store.py: at most
limits.SLICE_CHUNKS chunks or limits.SLICE_BYTES copied per slice). Each connection has its own
FIFO of tasks (its requests are answered in the order sent); the loop runs one slice of the first
task of the next busy connection, round robin:

    turns:  A B C A B A ...     A: a lookup of 16,384 chunks (64 slices)
                                B: a 3-chunk lookup (one slice), answered after at most one of A's

So a request waits at most one slice per other busy connection before each of its own slices,
whatever the size of the others' requests. Fairness is per connection (a ZeroMQ identity): a
client that opens several connections gets a turn on each, as it would with several processes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass

from hybridkv.cache_server.metrics import ServerMetrics
from hybridkv.wire import AnyReply

Steps = Generator[None, None, AnyReply]


@dataclass(slots=True)
class Task:
    identity: bytes  # the connection
    steps: Steps
    started: bool = False


class FairScheduler:
    """Per-connection FIFOs of tasks, served one slice at a time in turn. `on_error(task, exc)`: the
    reply to a task whose slice raised (a bug: the steps answer every request error themselves)."""

    def __init__(self, max_queued: int, metrics: ServerMetrics,
                 on_error: Callable[[Task, Exception], AnyReply]) -> None:
        self.max_queued = max_queued
        self._metrics = metrics
        self._on_error = on_error
        self._queues: dict[bytes, deque[Task]] = {}
        self._turns: deque[bytes] = deque()  # busy connections, next first
        self.longest_slice_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._turns)

    def add(self, task: Task) -> bool:
        """Queue `task` behind its connection's; False (nothing queued) when that connection already
        has `max_queued` waiting."""
        queue = self._queues.get(task.identity)
        if queue is None:
            queue = self._queues[task.identity] = deque()
            self._turns.append(task.identity)
        elif len(queue) >= self.max_queued:
            return False
        queue.append(task)
        return True

    def run_slice(self) -> tuple[Task, AnyReply] | None:
        """One slice of the next busy connection's first task; (task, its reply) when it finished."""
        if not self._turns:
            return None
        identity = self._turns.popleft()
        queue = self._queues[identity]
        task = queue[0]
        task.started = True
        t0 = time.perf_counter()
        reply: AnyReply | None = None
        try:
            next(task.steps)
        except StopIteration as done:
            reply = done.value
        except Exception as e:  # the guard: a bug answers `internal`, the loop goes on
            reply = self._on_error(task, e)
        spent = time.perf_counter() - t0
        self._metrics.slice_seconds.observe(spent)
        if spent > self.longest_slice_s:
            self.longest_slice_s = spent
            self._metrics.longest_slice.set(spent)
        if reply is not None:
            queue.popleft()
        if queue:
            self._turns.append(identity)
        else:
            del self._queues[identity]
        return (task, reply) if reply is not None else None

    def take_unstarted(self) -> list[Task]:
        """Remove and return every task that has not run a slice (shutdown answers them)."""
        unstarted: list[Task] = []
        for identity in list(self._queues):
            queue = self._queues[identity]
            unstarted += [t for t in queue if not t.started]
            kept = deque(t for t in queue if t.started)
            if kept:
                self._queues[identity] = kept
            else:
                del self._queues[identity]
                self._turns.remove(identity)
        return unstarted
