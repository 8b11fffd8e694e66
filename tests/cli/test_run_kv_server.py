"""`hybridkv run --kv-server` end to end: two engine processes on one server share hits, other
cache salts never do, and `--kv-server auto --passes 2` (what `make run` runs) serves the second
pass from the server with identical outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.connector.server_process import ServerProcess, start_server_process

pytest.importorskip("torch")

PROMPTS = [[2, *range(10, 90)], [2, *range(10, 60), *range(100, 140)], [2, *range(150, 250)]]


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    env = dict(os.environ, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="120")
    proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "run", "--json", "--max-tokens", "4", *args],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    process = start_server_process("--chunk-size", "16", "--l1-size-gib", "0.05")
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.slow
def test_two_engine_processes_share_hits_and_salts_never_do(tmp_path: Path, server: ServerProcess) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS))
    first = _run(tmp_path, "--workload", str(workload), "--kv-server", server.endpoint)
    second = _run(tmp_path, "--workload", str(workload), "--kv-server", server.endpoint)
    other = _run(tmp_path, "--workload", str(workload), "--kv-server", server.endpoint, "--cache-salt", "tenant-b")
    tokens = [r["token_ids"] for r in first["per_request"]]
    assert [r["token_ids"] for r in second["per_request"]] == tokens == [r["token_ids"] for r in other["per_request"]]
    # A prompt's hit: its whole 16-token chunks, the last token always computed.
    assert [r["external_hit_tokens"] for r in second["per_request"]] == [(len(p) - 1) // 16 * 16 for p in PROMPTS]
    assert [r["local_hit_tokens"] for r in second["per_request"]] == [0, 0, 0]
    assert second["totals"]["computed_prefill_tokens"] == sum(len(p) - (len(p) - 1) // 16 * 16 for p in PROMPTS)
    assert first["totals"]["computed_prefill_tokens"] < sum(map(len, PROMPTS))  # prompt 1 shares 51 with prompt 0
    assert other["totals"]["external_hit_tokens"] == 0
    assert second["kv_server"]["failed_loads"] == 0 and second["kv_server"]["errors"] == 0
    assert all(og["retrieved_bytes"] > 0 for og in second["kv_server"]["object_groups"])


@pytest.mark.slow
def test_auto_server_two_passes(tmp_path: Path) -> None:
    report = _run(tmp_path, "--kv-server", "auto", "--passes", "2")
    assert report["outputs_identical_across_passes"] is True
    one, two = report["passes"]
    assert one["external_hit_tokens"] == 0 < two["external_hit_tokens"]
    assert two["computed_prefill_tokens"] < one["computed_prefill_tokens"]
    assert report["kv_server"]["started_for_this_run"]
    assert {og["name"] for og in report["kv_server"]["object_groups"]} == {"full", "window:4"}  # 64 / 16


@pytest.mark.slow
def test_bad_kv_server_and_passes_are_clear_errors(tmp_path: Path) -> None:
    env = dict(os.environ, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"))
    for args, message in ((["--kv-server", "localhost:5555"], "tcp://host:port"), (["--passes", "0"], "--passes")):
        proc = subprocess.run([sys.executable, "-m", "hybridkv.cli", "run", *args], capture_output=True, text=True,
                              env=env, timeout=120, check=False)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_port_with_nothing_listening_reports_unreachable(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt_token_ids": p}) for p in PROMPTS))
    report = _run(tmp_path, "--workload", str(workload), "--kv-server", f"tcp://127.0.0.1:{port}")
    server = report["kv_server"]
    assert server["reachable"] is False and server["started_for_this_run"] is False
    assert server["errors"] == 1 and server["lookups"] == 0  # one failed registration, then the breaker
    assert report["totals"]["external_hit_tokens"] == 0
