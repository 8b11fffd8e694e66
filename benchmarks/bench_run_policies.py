#!/usr/bin/env python
"""Prompt tokens `hybridkv run` computes on a Gated DeltaNet hybrid: vLLM's settings vs ours, same tokens.

A tiny random-weight Qwen3.5 text model (full attention every 4th layer, Gated DeltaNet elsewhere;
built from a `transformers` config, saved in HF format to a temp dir) runs a seeded multi-turn
workload (`hybridkv simulate`'s chat and agentic generators, each chain of turns one `run`
session: a turn extends the previous turn's prompt and answer) through `hybridkv run --json`
twice, at a KV cache budget holding 25% of the workload's distinct tokens (as in `bench_hits.py
--targets`):

    vllm   one-page state layout, LRU, vLLM's checkpoints, no admission headroom (every default)
    ours   multi-page state layout, value eviction, placed checkpoints, last decode checkpoint,
           admission headroom (`bench_hits.OURS`)

Prints one line per side (prompt tokens computed, hits, preemptions, wall time) and last:

    prefill_ours_vs_vllm=<prompt tokens computed, ours / vLLM's> hits_ours_vs_vllm=<...> same_tokens=<bool>

    .venv/bin/python benchmarks/bench_run_policies.py [--quick]

Counts, not times, decide: the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hits  # noqa: E402

from hybridkv.plan.model_specs import model_spec_from_config  # noqa: E402
from hybridkv.plan.planner import GIB, KVCacheConfig, PlannerOptions, StateLayout, plan  # noqa: E402
from hybridkv.simulate.generators import Generator, GeneratorOptions, generate  # noqa: E402
from hybridkv.simulate.simulator import SimOptions, simulate  # noqa: E402
from hybridkv.simulate.trace import TraceRequest  # noqa: E402

VOCAB = 32768  # the generators draw token ids below 32,000
MAX_MODEL_LEN = 16384
STEP_TOKENS = 512
MAX_NUM_SEQS = 16
OURS_FLAGS = ["--preset", "hybridkv"]


def build_model(target: Path) -> None:
    """A tiny Qwen3.5 text model with random weights (seed 0), saved in HF format."""
    import torch
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, max_position_embeddings=MAX_MODEL_LEN,
        eos_token_id=1, bos_token_id=2, pad_token_id=0, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        architectures=["Qwen3_5ForCausalLM"])
    torch.manual_seed(0)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(target, safe_serialization=True)


def workload(num_requests: int, seed: int) -> list[TraceRequest]:
    """Chat then agentic chains, parents re-indexed into one list (every parent has one child)."""
    out: list[TraceRequest] = []
    for generator in (Generator.CHAT, Generator.AGENTIC):
        base = len(out)
        for item in generate(generator, GeneratorOptions(num_requests=num_requests // 2, seed=seed)):
            parent = None if item.parent is None else item.parent + base
            out.append(dataclasses.replace(item, parent=parent))
    return out


def write_jsonl(trace: list[TraceRequest], path: Path) -> None:
    """One `run` session per chain of turns: a turn's prompt is its new tokens (run prepends the history)."""
    session: list[int] = []
    lines = []
    for index, item in enumerate(trace):
        session.append(index if item.parent is None else session[item.parent])
        lines.append(json.dumps({"session": f"s{session[index]}", "prompt_token_ids": list(item.new_tokens),
                                 "max_tokens": item.output_tokens}))
    path.write_text("\n".join(lines) + "\n")


def budget_gib(model_dir: Path, trace: list[TraceRequest], fraction: float) -> float:
    """The budget holding `fraction` of the workload's distinct tokens in the one-page layout."""
    config_json = json.loads((model_dir / "config.json").read_text())
    spec = model_spec_from_config(config_json, name="tiny-qwen3.5")
    planned: KVCacheConfig = plan(spec, PlannerOptions(memory_bytes=GIB, max_model_len=MAX_MODEL_LEN,
                                                       max_num_batched_tokens=STEP_TOKENS,
                                                       state_layout=StateLayout.ONE_PAGE)).config
    distinct = simulate(trace, planned, SimOptions(max_model_len=MAX_MODEL_LEN)).distinct_tokens
    blocks = bench_hits.budget_blocks(planned, distinct, fraction)
    return blocks * bench_hits.bytes_per_block(planned) / GIB


def run_side(model_dir: Path, jsonl: Path, gib: float, flags: list[str]) -> dict[str, Any]:
    command = [sys.executable, "-m", "hybridkv", "run", "--model", str(model_dir), "--workload", str(jsonl),
               "--json", "--kv-cache-memory-gib", f"{gib:.6f}", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS), *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"hybridkv run failed ({' '.join(command)}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="prompt tokens computed by `hybridkv run`: vLLM's settings vs ours")
    parser.add_argument("--quick", action="store_true", help="a short workload (CI smoke)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    trace = workload(12 if args.quick else 40, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, jsonl = Path(tmp) / "tiny-qwen3.5", Path(tmp) / "workload.jsonl"
        build_model(model_dir)
        write_jsonl(trace, jsonl)
        gib = budget_gib(model_dir, trace, 0.25)
        sides = {"vllm": run_side(model_dir, jsonl, gib, []), "ours": run_side(model_dir, jsonl, gib, OURS_FLAGS)}
    totals = {}
    for name, report in sides.items():
        totals[name] = (report["totals"]["computed_prefill_tokens"], report["totals"]["local_hit_tokens"])
        print(f"side={name} budget_gib={gib:.5f} requests={report['requests']} prompt_tokens={report['prompt_tokens']} "
              f"prompt_tokens_computed={totals[name][0]} hit_tokens={totals[name][1]} "
              f"preemptions={report['preemptions']} steps={report['steps']} elapsed_s={report['elapsed_s']}")
    same = ([r["token_ids"] for r in sides["ours"]["per_request"]]
            == [r["token_ids"] for r in sides["vllm"]["per_request"]])
    print(f"prefill_ours_vs_vllm={totals['ours'][0] / max(1, totals['vllm'][0]):.3f} "
          f"hits_ours_vs_vllm={totals['ours'][1] / max(1, totals['vllm'][1]):.3f} same_tokens={same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
