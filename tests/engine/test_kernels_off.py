"""The engine with `HYBRIDKV_KERNELS=0` (the plain-torch paths a machine without a C compiler runs),
end to end in a fresh interpreter (the setting is read at the first kernel use): greedy outputs still
equal transformers' on a sliding-window model and a Gated DeltaNet hybrid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import hf_greedy, prompts

NEW_TOKENS = 8
SCRIPT = """
import json, sys
from hybridkv.engine import kernels
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
if kernels.kernels_available():
    sys.exit("the kernels are on despite HYBRIDKV_KERNELS=0")
path, batch, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, max_model_len=256, max_num_batched_tokens=40, block_size=4, kv_cache_memory_gib=0.01)
outputs = llm.generate(batch, SamplingParams(max_tokens=new, eos=EosMode.IGNORE))
print(json.dumps([o.token_ids for o in outputs]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5"])
def test_the_plain_torch_engine_matches_transformers(kind: str, model_dir: Callable[[str], Path],
                                                     hf_model: Callable[[Path], Any]) -> None:
    path = model_dir(kind)
    batch = prompts([57, 23, 41])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), json.dumps(batch), str(NEW_TOKENS)],
                          env={**os.environ, "HYBRIDKV_KERNELS": "0"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outputs = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, tokens in zip(batch, outputs, strict=True):
        assert tokens == hf_greedy(hf_model(path), prompt, NEW_TOKENS)[0]
