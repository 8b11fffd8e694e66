"""The runner's per-step thread setting: one thread for small (decode) steps, the setting restored after."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.runner import SMALL_STEP_TOKENS, step_threads  # noqa: E402


@pytest.fixture
def two_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_small_step_runs_on_one_thread_and_restores_the_setting() -> None:
    with step_threads(SMALL_STEP_TOKENS - 1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_large_step_keeps_every_thread() -> None:
    with step_threads(SMALL_STEP_TOKENS):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_setting_restored_when_the_step_raises() -> None:
    with pytest.raises(RuntimeError), step_threads(1):
        raise RuntimeError("step failed")
    assert torch.get_num_threads() == 2
