"""`--preset` on simulate, run and serve: the preset equals its settings spelled out flag by flag, a flag
changes one knob over it, and `--help` lists the cache flags under their own heading."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app

runner = CliRunner()
#: `--preset hybridkv` spelled out by hand (docs/prefix_caching.md's table)
HYBRIDKV_FLAGS = ["--eviction", "value", "--checkpoint-placement", "placed", "--release-order", "interleaved",
                  "--state-layout", "multi_page", "--running-state", "adopt", "--decode-checkpoints", "last",
                  "--admission-headroom", "waiting_hits", "--queue-order", "cache_aware", "--turn-checkpoints",
                  "--online-choice", "ghosts"]
SIM = ["simulate", "qwen3.5-0.8b", "--generate", "chat", "--num-requests", "24", "--memory-gib", "0.4", "--json"]


def _simulate(*flags: str) -> dict[str, Any]:
    result = runner.invoke(app, [*SIM, *flags])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.output)
    return report


def test_simulate_presets_equal_their_flags() -> None:
    vllm, vllm_flags = _simulate("--preset", "vllm"), _simulate("--release-order", "by_group")
    ours, ours_flags = _simulate("--preset", "hybridkv"), _simulate(*HYBRIDKV_FLAGS)
    assert vllm["request_hits"] == vllm_flags["request_hits"] == _simulate()["request_hits"]  # the default: vllm
    assert ours["request_hits"] == ours_flags["request_hits"] and ours["hit_tokens"] == ours_flags["hit_tokens"]
    assert ours["request_hits"] != vllm["request_hits"]
    lru = _simulate("--preset", "hybridkv", "--eviction", "lru")  # one knob over the preset
    assert lru["request_hits"] == _simulate(*HYBRIDKV_FLAGS[2:])["request_hits"]


def test_a_bad_preset_or_knob_is_one_error_line() -> None:
    result = runner.invoke(app, [*SIM, "--preset", "best"])
    assert result.exit_code == 2 and "error:" in result.output and "best" in result.output
    result = runner.invoke(app, [*SIM, "--running-state", "fixed", "--mamba-cache-mode", "all"])
    assert result.exit_code == 2
    assert result.output.startswith("error: --running-state=fixed") or "running_state=fixed" in result.output
    assert result.output.count("\n") == 1


@pytest.mark.parametrize("command", ["run", "serve", "simulate"])
def test_help_groups_the_cache_flags(command: str) -> None:
    text = runner.invoke(app, [command, "--help"]).output
    panel = text.split("Cache policy:\n", 1)[1]
    for flag in ("--preset", "--eviction", "--checkpoint-placement", "--admission-headroom", "--queue-order",
                 "--running-state", "--state-layout", "--turn-checkpoints"):
        assert re.search(rf"^\s+{flag}\b", panel, re.MULTILINE), (command, flag)
        assert not re.search(rf"^\s+{flag}\b", text.split("Cache policy:\n", 1)[0], re.MULTILINE), (command, flag)


@pytest.mark.slow
def test_run_takes_a_preset(tmp_path: Path) -> None:
    env = dict(os.environ, HYBRIDKV_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "hybridkv", "run", "--json", "--max-tokens", "4", "--preset",
                           "hybridkv", "--eviction", "lru"], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["config"]["cache"] == "hybridkv + eviction=lru"
    assert report["config"]["queue_order"] == "cache_aware" and report["config"]["eviction"] == "lru"
    assert report["prefix_cache"]["hit_rate"] > 0.3


@pytest.mark.slow
def test_serve_takes_a_preset() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--threads", "1",
                             "--kv-cache-memory-gib", "0.05", "--log-level", "warning", "--preset", "hybridkv"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert match and "cache hybridkv" in line, line
        body = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
        request = urllib.request.Request(match[1] + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(60)
        if proc.stderr is not None:
            proc.stderr.close()
