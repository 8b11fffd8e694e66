"""How many torch threads each step runs on: every thread for large steps; for small ones, as many
as the machine's other work leaves cores for.

A decode step is hundreds of small ops (a 16 x 256 x 768 matmul is ~100 us of work). Whether a
second thread helps depends on the rest of the machine:

    other cores busy (load 3 on 2 cores)   one thread: such a matmul took 0.16 ms, two threads 16 ms
                                           (the second thread waits for a core at every join)
    other cores idle (load 1.3)            two threads: the Gemma 3 bench 8.3 s, one thread 10.0 s

A prefill step's ops are large (a 2048-row matmul: ~13 ms of CPU), but a thread that shares its core
with other work still holds up every join: under load 9 on 2 cores a two-thread 2048-token prefill
took 0.91 s of wall time for 0.40 s of CPU, while vLLM's one model thread took 0.50 s.

So `StepThreads` looks at the CPU time the rest of the machine used over the last `interval_s`: a
step of fewer than `SMALL_STEP_TOKENS` tokens (decodes) runs on torch's setting only when that
leaves a core for each of our threads (with half a core to spare), a larger one (prefill) unless
the others took a whole core of the ones our threads need (`LARGE_STEP_SPARE`); else on one
thread. The rest of the machine = all CPUs' busy time (/proc/stat) minus this process's (os.times).
Before the first reading, and where /proc/stat cannot be read, large steps run on torch's setting and
small ones on one thread. The previous setting is restored after each step.

Native kernels (`engine/kernels`) take their thread count from `kernel_threads`: the step's choice,
also inside `one_thread` blocks and also when OpenMP waits are passive (`passive_waits`), where a
small step's torch ops run on one thread (every op's parallel region would pay a thread wake-up)
and only its few kernel calls use the second core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

SMALL_STEP_TOKENS = 256  # steps of fewer tokens (decodes) run on one thread unless cores are idle
SPARE_CORES = 0.5  # idle CPU, in cores, that must remain beyond one per thread
LARGE_STEP_SPARE = 1.0  # large steps: the others may use up to (not including) this much of our threads' cores


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Busy CPU seconds of the whole machine and of this process, at wall time `at` (seconds)."""

    at: float
    machine_busy_s: float
    own_busy_s: float


def read_cpu() -> CpuSample | None:
    """The machine's busy CPU seconds from /proc/stat and this process's from os.times; None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
        ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError, IndexError):
        return None
    idle = ticks[3] + ticks[4]
    own = os.times()
    return CpuSample(at=time.monotonic(), machine_busy_s=(sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"),
                     own_busy_s=own.user + own.system)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block on `n` torch threads; the previous setting is restored after (also on errors)."""
    threads = torch.get_num_threads()
    if n == threads:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_kernel_threads: list[int] = []  # threads for native kernels, innermost setting last (see `kernel_threads`)


@contextmanager
def kernel_threads_as(n: int) -> Iterator[None]:
    """Native kernels inside the block run on `n` OpenMP threads, whatever torch's setting."""
    _kernel_threads.append(n)
    try:
        yield
    finally:
        _kernel_threads.pop()


def kernel_threads() -> int:
    """Threads for a native kernel: the innermost `kernel_threads_as` (a step's choice, kept inside
    `one_thread`), else torch's setting. One kernel call pays a single OpenMP fork and join where a
    sequence of torch ops pays one per op, so kernels may use threads that torch ops do not."""
    return _kernel_threads[-1] if _kernel_threads else torch.get_num_threads()


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread (the previous setting restored after); native kernels keep
    the threads they had (`kernel_threads`).

    The state layers' scans and conv are many mid-sized ops (a 1024-token Gated DeltaNet scan is
    ~100 ops on tensors of ~1 MB); a second thread's wake-up and join per op cost more than it
    saves: the scan took 2x as long on two threads as on one (measured on the 2-core CI machine kind).
    """
    with kernel_threads_as(kernel_threads()), torch_threads(1):
        yield


def passive_waits() -> bool:
    """True when OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=PASSIVE, read when
    torch loaded libgomp). Each region then pays a futex wake-up (~50 us measured here): a small
    step's ~1,000 torch ops run faster on one thread, its few native kernels still on more."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


class StepThreads:
    """The per-step thread policy of one runner (see the module docstring)."""

    def __init__(self, *, interval_s: float = 0.5, cpus: int | None = None,
                 sample: Callable[[], CpuSample | None] = read_cpu) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        self._sample = sample
        self._last = sample()
        self.others_cores: float | None = None  # CPU the rest of the machine used over the last interval

    def small_step_threads(self, threads: int) -> int:
        """Threads for a small step given torch's setting `threads`: all of them if the rest of the
        machine used less than `cpus - threads + SPARE_CORES` cores over the last interval, else 1."""
        if not self._update() or self.others_cores is None:
            return 1
        return threads if self.others_cores < self.cpus - threads + SPARE_CORES else 1

    def large_step_threads(self, threads: int) -> int:
        """Threads for a large step: all of them unless the rest of the machine used at least
        `cpus - threads + LARGE_STEP_SPARE` cores over the last interval (or none known yet)."""
        if not self._update() or self.others_cores is None:
            return threads
        return threads if self.others_cores < self.cpus - threads + LARGE_STEP_SPARE else 1

    def _update(self) -> bool:
        """Refresh `others_cores` once `interval_s` has passed since the last reading; False when the
        machine's CPU time cannot be read."""
        now = self._sample()
        if now is None or self._last is None:
            return False
        elapsed = now.at - self._last.at
        if elapsed >= self.interval_s:
            others = (now.machine_busy_s - self._last.machine_busy_s) - (now.own_busy_s - self._last.own_busy_s)
            self.others_cores = max(0.0, others / elapsed)
            self._last = now
        return True

    @contextmanager
    def __call__(self, num_tokens: int) -> Iterator[None]:
        """Run the step inside on the chosen thread count; the setting is restored after."""
        threads = torch.get_num_threads()
        if threads == 1:
            yield
            return
        if num_tokens >= SMALL_STEP_TOKENS:
            with kernel_threads_as(n := self.large_step_threads(threads)), torch_threads(n):
                yield
            return
        n = self.small_step_threads(threads)
        with kernel_threads_as(n), torch_threads(1 if passive_waits() else n):
            yield
