"""The runner's per-step thread policy: every thread for prefill steps unless the rest of the machine
took a whole core; for small (decode) steps every thread only while the rest of the machine leaves a
core for each, else one; the setting restored."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.threads import (  # noqa: E402
    SMALL_STEP_TOKENS,
    CpuSample,
    StepThreads,
    kernel_threads,
    one_thread,
    read_cpu,
)


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # spinning waits (libgomp's default); see the passive test
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeCpu:
    """CPU readings the test scripts: each call advances wall time by 1 s, in which the rest of the
    machine uses `others` cores and this process `own` cores."""

    def __init__(self) -> None:
        self.at = self.machine = self.own = 0.0
        self.others, self.own_rate = 0.0, 1.0
        self.readable = True

    def __call__(self) -> CpuSample | None:
        if not self.readable:
            return None
        self.at += 1.0
        self.machine += self.others + self.own_rate
        self.own += self.own_rate
        return CpuSample(at=self.at, machine_busy_s=self.machine, own_busy_s=self.own)


def threads_in_step(policy: StepThreads, tokens: int) -> int:
    with policy(tokens):
        used: int = torch.get_num_threads()
        assert kernel_threads() == used
    return used


@pytest.mark.usefixtures("two_threads")
def test_with_passive_waits_small_steps_keep_torch_on_one_thread_and_kernels_on_the_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    cpu = FakeCpu()
    policy = StepThreads(interval_s=0.5, cpus=2, sample=cpu)
    seen = []
    for others, tokens in ((0.0, 32), (1.0, 32), (0.0, SMALL_STEP_TOKENS)):
        cpu.others = others
        with policy(tokens):
            inner = [torch.get_num_threads(), kernel_threads()]
            with one_thread():  # a state mixer's block: torch on one thread, the kernels keep the step's choice
                inner += [torch.get_num_threads(), kernel_threads()]
            seen.append(inner)
    assert seen == [[1, 2, 1, 2], [1, 1, 1, 1], [2, 2, 1, 2]]
    assert torch.get_num_threads() == 2 and kernel_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_small_steps_use_every_thread_only_while_the_other_core_is_idle() -> None:
    cpu = FakeCpu()
    policy = StepThreads(interval_s=0.5, cpus=2, sample=cpu)
    # the rest of the machine in the second before each step: idle, 0.4 core (within the 0.5 spare), 0.6, 1, 0.2
    used = []
    for others in (0.0, 0.4, 0.6, 1.0, 0.2):
        cpu.others = others
        used.append(threads_in_step(policy, 32))
    assert used == [2, 2, 1, 1, 2]
    assert policy.others_cores == pytest.approx(0.2)
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_own_cpu_time_does_not_count_as_the_machine_being_busy() -> None:
    cpu = FakeCpu()
    cpu.own_rate = 2.0  # this process kept both cores busy (a two-thread prefill)
    policy = StepThreads(interval_s=0.5, cpus=2, sample=cpu)
    assert threads_in_step(policy, 1) == 2
    assert policy.others_cores == 0.0


@pytest.mark.usefixtures("two_threads")
def test_the_reading_is_kept_until_the_interval_has_passed() -> None:
    cpu = FakeCpu()
    cpu.others = 1.0
    policy = StepThreads(interval_s=1.5, cpus=2, sample=cpu)
    assert threads_in_step(policy, 8) == 1  # 1 s since the first reading: no estimate yet
    assert policy.others_cores is None
    cpu.others = 0.0
    assert threads_in_step(policy, 8) == 1  # 2 s: others averaged 0.5 core (1 s busy, 1 s idle): > 0.5 - 0
    assert policy.others_cores == pytest.approx(0.5)


@pytest.mark.usefixtures("two_threads")
def test_large_steps_drop_to_one_thread_only_when_the_others_took_a_whole_core() -> None:
    cpu = FakeCpu()
    policy = StepThreads(interval_s=0.5, cpus=2, sample=cpu)
    # the rest of the machine in the second before each prefill step: idle, 0.6 core (a decode would
    # drop to one thread), 0.99, 1 (the core our second thread needs), 2, idle again
    used = []
    for others in (0.0, 0.6, 0.99, 1.0, 2.0, 0.0):
        cpu.others = others
        used.append(threads_in_step(policy, SMALL_STEP_TOKENS))
    assert used == [2, 2, 2, 1, 1, 2]
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_unreadable_cpu_means_one_thread_for_small_steps_and_every_thread_for_large_ones() -> None:
    cpu = FakeCpu()
    cpu.readable = False
    policy = StepThreads(cpus=2, sample=cpu)
    assert threads_in_step(policy, SMALL_STEP_TOKENS - 1) == 1
    assert threads_in_step(policy, SMALL_STEP_TOKENS) == 2


def test_one_thread_setting_is_left_alone() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert threads_in_step(StepThreads(sample=FakeCpu()), 4) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_setting_restored_when_the_step_raises() -> None:
    cpu = FakeCpu()
    cpu.others = 2.0
    policy = StepThreads(cpus=2, sample=cpu)
    with pytest.raises(RuntimeError), policy(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("step failed")
    assert torch.get_num_threads() == 2


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s must be positive, got 0"):
        StepThreads(interval_s=0)


def test_read_cpu_reads_this_machine() -> None:
    first = read_cpu()
    if first is None:
        pytest.skip("no /proc/stat here")
    second = read_cpu()
    deadline = time.monotonic() + 5.0  # some CPU time of our own: os.times counts in clock ticks (10 ms)
    while second is not None and second.own_busy_s <= first.own_busy_s and time.monotonic() < deadline:
        sum(i * i for i in range(100_000))
        second = read_cpu()
    assert second is not None and second.own_busy_s > first.own_busy_s
    assert second.machine_busy_s >= first.machine_busy_s
