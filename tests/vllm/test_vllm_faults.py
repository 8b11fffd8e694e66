"""vLLM keeps serving, with correct outputs, when the hybridkv server is absent, killed mid-run or
restarted: lookups that fail are misses, loads that fail are recomputed, and a server that comes
(back) is registered with and used again."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.cache_server.helpers import start_server_process
from tests.redis_server import free_port
from tests.vllm.conftest import hf_greedy, run_vllm
from tests.vllm.test_vllm_gemma3 import MAX_TOKENS, PROMPTS, SERVER_HITS, job

FAST_RETRY = {"retry_after_s": 0.5, "timeout_s": 1.0}


def server_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "hybridkv", "server", "--port", str(port), "--http-port", "0",
            "--l1-size-gib", "0.25"]


class Endpoint:
    """A server endpoint on a fixed free port (nothing listening on it yet)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.http_url = None


def test_server_absent_then_started(gemma3_dir: Path, tmp_path: Path) -> None:
    reference = hf_greedy(gemma3_dir, PROMPTS, MAX_TOKENS)
    where = Endpoint()
    phases = ["generate", "start_server", "reset", "generate", "reset", "generate"]
    absent, _, _, first, _, hit = run_vllm(
        job(gemma3_dir, where, phases, extra=FAST_RETRY, server_cmd=server_cmd(where.port)), tmp_path)
    assert absent["tokens"] == reference and absent["cached"] == [0, 0, 0]
    assert first["tokens"] == reference  # the server appeared: registered now, the chunks stored
    assert hit["tokens"] == reference and hit["cached"] == SERVER_HITS


def test_server_killed_and_restarted(gemma3_dir: Path, tmp_path: Path) -> None:
    reference = hf_greedy(gemma3_dir, PROMPTS, MAX_TOKENS)
    where = Endpoint()
    server = start_server_process("--port", str(where.port), "--l1-size-gib", "0.25")
    try:
        phases = ["generate", "kill_server", "reset", "generate", "start_server", "reset", "generate", "reset",
                  "generate", "reset", "fail_next_retrieves", "generate"]
        results = run_vllm(job(gemma3_dir, where, phases, extra=FAST_RETRY, server_cmd=server_cmd(where.port),
                               server_pid=server.proc.pid), tmp_path)
    finally:
        server.proc.kill()
        server.proc.wait()
    stored, _, _, dead, _, _, refilled, _, hit, _, _, failed_loads = results
    assert stored["tokens"] == reference
    assert dead["tokens"] == reference and dead["cached"] == [0, 0, 0]  # the lookups failed: recomputed
    assert refilled["tokens"] == reference and refilled["cached"] == [0, 0, 0]  # the new server starts empty
    assert hit["tokens"] == reference and hit["cached"] == SERVER_HITS  # registered again by itself, and used
    # hits found, then every retrieve fails: vLLM recomputes the blocks reported as failed. The first
    # failure opens the connector's breaker, so a second load in the same step is reported failed
    # without calling the server (1 call), or called after the breaker's wait (2 calls)
    assert failed_loads["tokens"] == reference and 1 <= failed_loads["load_errors"] <= 2


