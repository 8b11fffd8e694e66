"""One `hybridkv serve` app on the embedded default model for the whole package (127.0.0.1, a free
port), an `openai` client for it, and an offline `LLM` on the same model as the reference."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.openai_api.engine_loop import EngineLoop  # noqa: E402
from hybridkv.openai_api.http_server import ServeServer  # noqa: E402

MODEL = "default-gemma3"
ENGINE = dict(kv_cache_memory_gib=0.05, num_threads=1, max_num_batched_tokens=256)


@pytest.fixture(scope="package")
def server() -> Iterator[ServeServer]:
    serve = ServeServer(LLM(MODEL, **ENGINE), port=0, model_name=MODEL)
    serve.start()
    yield serve
    serve.stop()


@pytest.fixture(scope="package")
def engine(server: ServeServer) -> EngineLoop:
    """The server's engine loop (tests run engine checks on its thread with `call_sync`)."""
    loop: EngineLoop = server.app.state.serve.engine
    return loop


@pytest.fixture(scope="package")
def client(server: ServeServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="package")
def offline() -> LLM:
    return LLM(MODEL, **ENGINE)


def http(server: ServeServer, path: str, body: bytes | dict[str, Any] | None = None,
         method: str | None = None) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one raw HTTP call (for what the openai client cannot send)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metric(server: ServeServer, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    _, text = http(server, "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(r"([a-z_:]+)(?:\{(.*)\})? (\S+)", line)
        if match and match[1] == name and ",".join(sorted((match[2] or "").split(","))) == want:
            return float(match[3])
    return 0.0
