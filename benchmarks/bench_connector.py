"""TTFT of one long prompt: cold, with a local prefix hit, and retrieved from the KV cache server.

The tiny Gemma 3 and the tiny Qwen3.5 of bench_engine.py (float32), one engine attached to a
`hybridkv server` child process (loopback, chunk 256 tokens, or the smallest multiple of the
model's block sizes above it). Per model: a 2048-token prompt runs cold (its chunks are stored as
they complete), again with a local prefix hit, then after `reset_prefix_cache()` (local only) with
the prefix retrieved from the server; each of the three is the median of `--repeats` runs, on a
fresh prompt for the cold ones. The greedy token must be the same every time.

Prints one line per model and, last, `server_hit_vs_cold=<cold TTFT / server-hit TTFT>
server_hit_vs_local=<server-hit TTFT / local-hit TTFT>` for the Gemma 3 model (targets: >= 5 and
<= 1.5). `--quick`: a 512-token prompt, one repeat (CI smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_engine import VOCAB, build_model
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams

ONE = SamplingParams(max_tokens=1, eos=EosMode.IGNORE)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def measure(llm: LLM, length: int, repeats: int) -> tuple[float, float, float, int]:
    """Median TTFT (s) cold, local hit, server hit; and the tokens the server hit covered."""
    cold, local, server, external = [], [], [], 0
    llm.generate([prompt(64, 99)], ONE)  # warm-up: first-call allocations
    for r in range(repeats):
        p = prompt(length, seed=r + 1)
        first = llm.generate([p], ONE)[0]
        cold.append(first.metrics.ttft_s)
        hit = llm.generate([p], ONE)[0]
        local.append(hit.metrics.ttft_s)
        if not llm.reset_prefix_cache():
            raise SystemExit("reset_prefix_cache refused: requests still hold blocks")
        again = llm.generate([p], ONE)[0]
        server.append(again.metrics.ttft_s)
        external = again.metrics.external_hit_tokens
        if not first.token_ids == hit.token_ids == again.token_ids:
            raise SystemExit(f"outputs differ: cold {first.token_ids}, local hit {hit.token_ids}, "
                             f"server hit {again.token_ids}")
        if hit.metrics.prefix_hit_tokens == 0 or external == 0:
            raise SystemExit(f"no hit: local {hit.metrics.prefix_hit_tokens}, server {external} tokens")
    return statistics.median(cold), statistics.median(local), statistics.median(server), external


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512-token prompt, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length, repeats = (512, 1) if args.quick else (2048, args.repeats)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("gemma3", "qwen3_5"):
            path = Path(tmp) / name
            build_model(name, path)
            with LLM(str(path), kv_server="auto", max_model_len=length + 64, kv_cache_memory_gib=0.5) as llm:
                cold, local, server, external = measure(llm, length, repeats)
            results[name] = (cold, local, server)
            print(f"{name}: {length}-token prompt TTFT cold {cold * 1000:.1f} ms, local prefix hit "
                  f"{local * 1000:.1f} ms, server hit {server * 1000:.1f} ms ({external} tokens retrieved); "
                  f"server hit vs cold {cold / server:.2f}x, vs local hit {server / local:.2f}x", flush=True)
    cold, local, server = results["gemma3"]
    print(f"server_hit_vs_cold={cold / server:.2f} server_hit_vs_local={server / local:.2f}")


if __name__ == "__main__":
    main()
