"""`hybridkv serve` as a user runs it: a process on a free port, graceful Ctrl-C, bad options, the
README's flag list and its curl / openai examples run as written (against the test server's port)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.openai_api.http_server import ServeServer

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
SERVE_SECTION = README.split("## Serving over HTTP", 1)[1].split("\n## ", 1)[0]


def _stream_lines(url: str, body: bytes, lines: list[str], first: threading.Event) -> None:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            if raw.strip():
                lines.append(raw.decode().strip())
                first.set()


@pytest.mark.slow
def test_the_process_serves_on_a_free_port_with_its_kv_server_and_ctrl_c_lets_a_stream_finish() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--threads", "1",
                             "--kv-cache-memory-gib", "0.05", "--log-level", "warning", "--kv-server", "auto"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:(\d+))", line)
        assert match, line
        assert re.search(r"; KV cache server tcp://127\.0\.0\.1:\d+ \(started for this server", line), line
        url = match[1]
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            assert "hybridkv_serve_kv_server_attached 1.0" in response.read().decode()
        body = json.dumps({"prompt": "a long answer", "max_tokens": 150, "stream": True, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        lines: list[str] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream_lines, args=(url + "/v1/completions", body, lines, first))
        reader.start()
        assert first.wait(30), "no first chunk"
        proc.send_signal(signal.SIGINT)  # graceful: the stream in flight runs to its end
        reader.join(60)
        assert proc.wait(60) == 130  # Ctrl-C: 128 + SIGINT, once the stream in flight has ended
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in lines[-2]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 150  # every token, after the Ctrl-C


@pytest.mark.slow
def test_sigterm_stops_cleanly_with_exit_code_0() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--threads", "1",
                             "--kv-cache-memory-gib", "0.05", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert "Ctrl-C to stop" in proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # as `hybridkv server`; uvicorn alone re-raises SIGTERM (143)
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize(("args", "message"), [
    (["--host", "10.1.2.3"], "--host 10.1.2.3 is not a loopback address; pass --allow-remote"),
    (["--host", "not-an-ip"], "--host must be an IP address or localhost, got 'not-an-ip'"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
    (["--log-level", "loud"], "--log-level must be debug, info, warning or error"),
    (["--port", "70000"], "--port must be in [0, 65535] (0: any free port), got 70000"),
    (["--port", "-5"], "--port must be in [0, 65535] (0: any free port), got -5"),
    (["--api-key", " "], "--api-key is empty"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1, got 0"),
    (["--max-connections", "0"], "--max-connections must be at least 1, got 0"),
    (["--kv-server", "localhost:5555"], "--kv-server 'localhost:5555' is not a KV cache server URL; expected auto "
                                        "or a running server's tcp://host:port"),
    (["--kv-server", "tcp://127.0.0.1:99999"], "is not a KV cache server URL"),
])
def test_bad_options_are_one_error_line(args: list[str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridkv.engine.llm

    def no_model(*_: Any, **__: Any) -> None:
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(hybridkv.engine.llm, "LLM", no_model)
    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split()), result.output


def test_a_port_in_use_is_an_error_line(server: ServeServer) -> None:
    result = CliRunner().invoke(app, ["serve", "--port", str(server.port), "--kv-cache-memory-gib", "0.05"])
    assert result.exit_code == 2 and f"cannot bind 127.0.0.1:{server.port}" in result.output


def test_readme_flag_list_matches_help() -> None:
    paragraph = SERVE_SECTION.split("`hybridkv serve` flags:", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`(--[a-z][a-z-]*)", paragraph))
    command: Any = typer.main.get_command(app)
    options = [p for p in command.commands["serve"].params if p.param_type_name == "option"]
    actual = {opt for option in options for opt in option.opts if opt.startswith("--")} - {"--help"}
    assert documented == actual, (sorted(documented - actual), sorted(actual - documented))


def _on_port(code: str, port: int) -> str:
    assert "localhost:8000" in code
    return code.replace("localhost:8000", f"127.0.0.1:{port}")


def test_readme_curl_examples_work_as_written(server: ServeServer) -> None:
    blocks = re.findall(r"^```bash\n(.*?)^```", SERVE_SECTION, re.DOTALL | re.MULTILINE)
    commands = [b for b in blocks if b.startswith("curl")]
    assert len(commands) >= 2
    for command in commands:
        out = subprocess.run(["bash", "-c", "set -eo pipefail; " + _on_port(command, server.port)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert '"choices"' in out.stdout or "data: [DONE]" in out.stdout or "hybridkv_serve" in out.stdout


def test_readme_openai_example_works_as_written(server: ServeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code = re.findall(r"^```python\n(# needs: a running `hybridkv serve`.*?)^```", SERVE_SECTION,
                      re.DOTALL | re.MULTILINE)
    assert len(code) == 1
    exec(compile(_on_port(code[0], server.port), "README serve example", "exec"), {})
    assert capsys.readouterr().out.strip()

