"""vLLM's own benchmark client against `hybridkv serve`: `vllm bench serve --backend openai` and
`--backend openai-chat` run every request to completion, and the TTFT they report agrees within 20%
with one measured by a plain streaming client here.

The plain client times the first event that carries a generated token (it asks for logprobs, so an
event without one, like a role chunk sent before prefill, does not stop its clock). Load on this
shared machine moves TTFT by up to 2x from one minute to the next, so each client's mean TTFT is
taken relative to the server's own mean TTFT for the same requests, measured over the same seconds
(the `hybridkv_serve_time_to_first_token_seconds` histogram: arrival to first token): vLLM's ratio
must be within 20% of the plain client's. A role chunk sent before prefill put vLLM's chat ratio near
0.05, against about 1 for the plain client."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.openai_api.chat import plain_template
from tests.vllm.conftest import HERE

MODEL = "default-gemma3"
PROMPTS, INPUT_LEN, OUTPUT_LEN = 24, 512, 4


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(URL, tokenizer dir) of a `hybridkv serve` process on the default model, on a free port."""
    from hybridkv.engine.default_model import ensure_default_model

    tokenizer = ensure_default_model()  # its directory holds tokenizer.json
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--threads", "1",
                             "--kv-cache-memory-gib", "0.2", "--max-model-len", "2048", "--log-level", "warning",
                             "--prefix-caching", "off"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        yield match[1], tokenizer
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        if proc.stderr is not None:
            proc.stderr.close()


def _bench(url: str, tokenizer: Path, backend: str, endpoint: str, out: Path) -> dict[str, Any]:
    args = ["bench", "serve", "--backend", backend, "--base-url", url, "--endpoint", endpoint, "--model", MODEL,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--num-prompts", str(PROMPTS), "--max-concurrency", "1",
            "--ignore-eos", "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm", "--seed", "0",
            "--save-result", "--save-detailed",
            "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run([sys.executable, str(HERE / "bench_client.py"), *args], capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _client_ttfts_s(url: str, endpoint: str, prompt_lens: list[int]) -> list[float]:
    """TTFT of fresh streamed requests whose prompts have `prompt_lens` tokens (what the server's usage
    counted for vLLM's requests: with the byte tokenizer, BOS + one token per ASCII character, plus the
    plain chat template's tokens for chat)."""
    rng = random.Random(1)
    overhead = len(plain_template([("user", "")])) if "chat" in endpoint else 0
    ttfts = []
    for prompt_len in prompt_lens:
        text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_len - 1 - overhead))
        body: dict[str, Any] = {"model": MODEL, "max_tokens": OUTPUT_LEN, "stream": True, "ignore_eos": True}
        if "chat" in endpoint:
            body.update(messages=[{"role": "user", "content": text}], logprobs=True)
        else:
            body.update(prompt=text, logprobs=1)
        request = urllib.request.Request(url + endpoint, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: ") and _has_a_token(json.loads(line[6:])):
                    ttfts.append(time.perf_counter() - start)
                    break
            response.read()
    return ttfts


def _has_a_token(event: dict[str, Any]) -> bool:
    logprobs = event["choices"][0]["logprobs"] if event.get("choices") else None
    return bool(logprobs and (logprobs.get("content") or logprobs.get("tokens")))


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "endpoint"), [("openai", "/v1/completions"),
                                                   ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_completes_with_a_true_ttft(serve: tuple[str, Path], backend: str, endpoint: str,
                                                     tmp_path: Path) -> None:
    url, tokenizer = serve
    before = _server_ttft(url)
    result = _bench(url, tokenizer, backend, endpoint, tmp_path / "result.json")
    between = _server_ttft(url)
    assert (result["completed"], result["failed"]) == (PROMPTS, 0), result.get("errors")
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    chat_tokens = 1 + len(plain_template([("user", "")])) if "chat" in endpoint else 1  # BOS (+ the template)
    assert max(abs(n - INPUT_LEN - chat_tokens) for n in result["input_lens"]) <= 2
    ours = statistics.mean(_client_ttfts_s(url, endpoint, result["input_lens"]))
    after = _server_ttft(url)
    server_theirs = (between[0] - before[0]) / (between[1] - before[1])
    server_ours = (after[0] - between[0]) / (after[1] - between[1])
    assert (between[1] - before[1], after[1] - between[1]) == (PROMPTS, PROMPTS)
    theirs = result["mean_ttft_ms"] / 1000
    assert server_ours > 0.01  # a prefill of ~500 tokens: the comparison measures something
    figures = (backend, round(theirs, 4), round(server_theirs, 4), round(ours, 4), round(server_ours, 4))
    print("vllm bench serve mean TTFT s (vLLM, server for its requests, plain client, server for ours):", figures)
    assert abs(theirs / server_theirs - ours / server_ours) <= 0.2 * ours / server_ours, figures


def _server_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the server's time-to-first-token histogram."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = dict(re.findall(r"^hybridkv_serve_time_to_first_token_seconds_(sum|count) (\S+)$", text, re.MULTILINE))
    return float(values["sum"]), float(values["count"])
