"""The engine with a KV cache server that is absent, killed mid-run, restarted (with its disk
tier) or answering errors: outputs stay those of the engine alone, the engine keeps serving and
says so once; and a layout that differs (same model, another block size) never gets its pages."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from hybridkv.cache_server.registered_layout import RequestError
from hybridkv.cache_server.store import StoreConfig
from hybridkv.connector.server_process import start_server_process
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.kvcache.manager import PrefixCaching
from hybridkv.wire import ErrorCode
from tests.cache_server.helpers import running_server
from tests.engine.conftest import prompts

GREEDY = SamplingParams(max_tokens=5, eos=EosMode.IGNORE)
OPTIONS = dict(max_model_len=128, kv_server_timeout_s=1.0)


def _alone(path: Path, batch: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in LLM(str(path), prefix_caching=PrefixCaching.OFF,
                                     max_model_len=128).generate(batch, GREEDY)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_absent_server_is_logged_once_and_the_engine_serves(model_dir: Callable[[str], Path],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    path = model_dir("gemma3")
    batch = prompts([41, 35], seed=8)
    with caplog.at_level(logging.WARNING, logger="hybridkv.connector"), \
            LLM(str(path), kv_server=f"tcp://127.0.0.1:{_free_port()}", **OPTIONS) as llm:
        first = llm.generate(batch, GREEDY)
        llm.reset_prefix_cache()
        second = llm.generate(batch, GREEDY)
        assert llm.transfer is not None and llm.transfer.connector.stats.errors >= 1
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == _alone(path, batch)
    assert all(o.metrics.external_hit_tokens == 0 for o in first + second)
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted_with_its_disk_tier(model_dir: Callable[[str], Path],
                                                                 tmp_path: Path) -> None:
    path = model_dir("gemma3")
    batch = prompts([41, 58], seed=9)
    port = _free_port()
    args = ("--port", str(port), "--chunk-size", "16", "--l1-size-gib", "0.05", "--l2-disk", str(tmp_path / "l2"))
    server = start_server_process(*args[2:], "--port", str(port))
    try:
        # 3 s per call: a restarted server answers its first registration slowly on a loaded machine
        with LLM(str(path), kv_server=f"tcp://127.0.0.1:{port}", **{**OPTIONS, "kv_server_timeout_s": 3.0}) as llm:
            assert llm.transfer is not None
            connector = llm.transfer.connector
            connector.retry_after_s = 0.0  # retry at once: the test restarts the server right away
            first = llm.generate(batch, GREEDY)  # stored in L1, written behind to disk
            server.stop()  # SIGTERM: the write-behind flushes to the disk tier
            server = start_server_process(*args[2:], "--port", str(port))
            server.proc.send_signal(signal.SIGKILL)  # killed: no server at all now
            server.proc.wait()
            llm.reset_prefix_cache()
            without = llm.generate(batch, GREEDY)
            assert all(o.metrics.external_hit_tokens == 0 for o in without)
            server = start_server_process(*args[2:], "--port", str(port))  # back, with the same disk
            llm.reset_prefix_cache()
            restored = llm.generate(batch, GREEDY)
    finally:
        server.stop()
    expected = _alone(path, batch)
    assert [o.token_ids for o in first] == [o.token_ids for o in without] == [o.token_ids for o in restored] == expected
    assert all(o.metrics.external_hit_tokens > 0 for o in restored)  # read through from the disk tier


def test_error_replies_mean_recompute(model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    path = model_dir("gemma3")
    batch = prompts([41, 58], seed=10)
    with running_server(StoreConfig(chunk_tokens=16, l1_bytes=1 << 24)) as server, \
            LLM(str(path), kv_server=server.endpoint, **OPTIONS) as llm:
        assert llm.transfer is not None
        llm.transfer.connector.retry_after_s = 0.0
        first = llm.generate(batch, GREEDY)

        def broken(*_: object) -> None:
            raise RequestError(ErrorCode.INTERNAL, "disk on fire")

        monkeypatch.setattr(server.store, "retrieve_steps", broken)
        llm.reset_prefix_cache()
        second = llm.generate(batch, GREEDY)  # lookups hit, every retrieve fails: recomputed
        stats = llm.transfer.connector.stats
        assert stats.failed_loads == len(batch) and stats.loads == 0
        assert all(o.metrics.external_hit_tokens == 0 and o.metrics.computed_prefill_tokens == len(p)
                   for o, p in zip(second, batch, strict=True))
        llm.manager.check_integrity()
        monkeypatch.undo()
        llm.reset_prefix_cache()
        third = llm.generate(batch, GREEDY)  # the server works again
    expected = _alone(path, batch)
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == [o.token_ids for o in third] == expected
    assert all(o.metrics.external_hit_tokens > 0 for o in third)


def test_another_layout_never_gets_the_pages(model_dir: Callable[[str], Path]) -> None:
    path = model_dir("gemma3")
    batch = prompts([41, 58], seed=11)
    with running_server(StoreConfig(chunk_tokens=16, l1_bytes=1 << 24)) as server:
        with LLM(str(path), kv_server=server.endpoint, block_size=16, **OPTIONS) as llm:
            llm.generate(batch, GREEDY)
        with LLM(str(path), kv_server=server.endpoint, block_size=8, **OPTIONS) as other:
            outputs = other.generate(batch, GREEDY)
        with LLM(str(path), kv_server=server.endpoint, block_size=16, **OPTIONS) as same:
            again = same.generate(batch, GREEDY)
    assert all(o.metrics.external_hit_tokens == 0 for o in outputs)
    assert all(o.metrics.external_hit_tokens > 0 for o in again)  # the control: the same layout hits
    assert [o.token_ids for o in outputs] == [o.token_ids for o in again] == _alone(path, batch)
