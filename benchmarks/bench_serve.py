"""`hybridkv serve` under concurrent chat sessions vs the same workload through offline `LLM.generate`.

Workload (seed 0): 16 sessions on the embedded default model, each 3 turns; every session starts
with the same 512-token system prompt, then a user turn of 48 random byte-tokens; each next turn
is the previous prompt + its answer + a new user turn. 32 new tokens per turn, greedy, EOS
ignored, prompts sent as token ids (`/v1/completions`), so both paths compute the same tokens.

- serve: `hybridkv serve --port 0` in a subprocess; 16 streaming clients at once (httpx2, the HTTP
  library of the `openai` client, reading the SSE lines with msgspec: the official client's
  parsing costs ~1 ms of CPU per chunk, which on a 2-core machine the server would pay for),
  each running its session turn after turn (a turn is sent when the previous one ended).
- offline: `LLM.generate` in this process, one batch per round (turn k of every session).

Both start with an empty prefix cache and use the same engine options and `--threads`; each runs
`--repeat` times (default 2, alternating), and the fastest run of each counts. Prints
requests/s, generated tok/s and TTFT p50/p99 of the served run, the offline throughput, whether
every served answer equals the offline one, and last `serve_vs_offline_throughput=<ratio>`
(served / offline generated tokens per second; target >= 0.8). `--quick`: 4 sessions, 2 turns,
8 new tokens (CI smoke run; use `--repeat 1` there).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep (see bench_engine.py)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2
import msgspec
import openai

from hybridkv.engine.tokenizer import BOS_ID, BYTE_OFFSET

MODEL = "default-gemma3"


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    sessions: int
    turns: int
    system_tokens: int
    user_tokens: int
    new_tokens: int


FULL = Workload(sessions=16, turns=3, system_tokens=512, user_tokens=48, new_tokens=32)
QUICK = Workload(sessions=4, turns=2, system_tokens=64, user_tokens=16, new_tokens=8)


def user_turns(w: Workload) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per session, its user turns (random byte tokens, seed 0)."""
    rng = random.Random(0)
    byte = lambda: BYTE_OFFSET + rng.randrange(32, 127)  # noqa: E731  printable ASCII
    system = [BOS_ID, *(byte() for _ in range(w.system_tokens - 1))]
    return system, [[[byte() for _ in range(w.user_tokens)] for _ in range(w.turns)] for _ in range(w.sessions)]


def engine_options(threads: int) -> list[str]:
    return ["--kv-cache-memory-gib", "0.25", "--threads", str(threads)]


def start_server(threads: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv", "serve", "--port", "0", "--log-level", "warning",
                             *engine_options(threads)], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
    if match is None:
        proc.kill()
        raise SystemExit(f"hybridkv serve did not start: {line}{proc.stderr.read()}")
    return proc, match[1]


async def serve_run(url: str, w: Workload) -> tuple[float, list[float], list[list[list[int]]]]:
    """Wall seconds, TTFTs and each session's answers of the concurrent served run."""
    system, turns = user_turns(w)
    ttfts: list[float] = []

    async def session(client: httpx2.AsyncClient, user: list[list[int]]) -> list[list[int]]:
        prompt, answers = list(system), []
        for turn in user:
            prompt += turn
            body = {"model": MODEL, "prompt": prompt, "max_tokens": w.new_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "return_token_ids": True}
            sent = time.perf_counter()
            answer: list[int] = []
            async with client.stream("POST", url + "/v1/completions", content=msgspec.json.encode(body),
                                     headers={"Content-Type": "application/json"}) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ids = msgspec.json.decode(line[6:], type=Chunk).choices[0].token_ids
                    if ids and not answer:
                        ttfts.append(time.perf_counter() - sent)
                    answer += ids
            answers.append(answer)
            prompt += answer
        return answers

    limits = httpx2.Limits(max_connections=w.sessions + 1)
    async with httpx2.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(session(client, user) for user in turns))
        return time.perf_counter() - start, ttfts, list(answers)


class _Choice(msgspec.Struct):
    token_ids: list[int] = []


class Chunk(msgspec.Struct):
    """The part of a completion stream chunk the benchmark reads."""

    choices: list[_Choice]


def offline_run(w: Workload, threads: int) -> tuple[float, list[list[list[int]]]]:
    """Wall seconds and answers of the same sessions through `LLM.generate`, one batch per round."""
    from hybridkv.engine.llm import LLM
    from hybridkv.engine.sampler import EosMode, SamplingParams

    llm = LLM(MODEL, kv_cache_memory_gib=0.25, num_threads=threads)
    llm.generate([[BOS_ID, 40, 41, 42]], SamplingParams(max_tokens=4))  # the server's warm-up request
    llm.manager.reset_prefix_cache()
    system, turns = user_turns(w)
    prompts = [list(system) for _ in turns]
    answers: list[list[list[int]]] = [[] for _ in turns]
    params = SamplingParams(max_tokens=w.new_tokens, eos=EosMode.IGNORE)
    start = time.perf_counter()
    for k in range(w.turns):
        for prompt, user in zip(prompts, turns, strict=True):
            prompt += user[k]
        outputs = llm.generate(prompts, params)
        for i, out in enumerate(outputs):
            answers[i].append(out.token_ids)
            prompts[i] += out.token_ids
    return time.perf_counter() - start, answers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def warm_up_server(url: str) -> None:
    """One unrelated request (first-call costs), then an empty prefix cache."""
    import urllib.request

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.completions.create(model=MODEL, prompt=[BOS_ID, 40, 41, 42], max_tokens=4, temperature=0)
    client.close()
    urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")).close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both engines")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each path (alternating); the best counts")
    args = parser.parse_args()
    w = QUICK if args.quick else FULL
    requests, generated = w.sessions * w.turns, w.sessions * w.turns * w.new_tokens
    served_runs: list[tuple[float, list[float], list[list[list[int]]]]] = []
    offline_runs: list[tuple[float, list[list[list[int]]]]] = []
    for _ in range(max(args.repeat, 1)):  # alternating, so a burst of load on a shared machine hits both
        proc, url = start_server(args.threads)
        try:
            warm_up_server(url)
            served_runs.append(asyncio.run(serve_run(url, w)))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            if proc.stderr is not None:
                proc.stderr.close()
        offline_runs.append(offline_run(w, args.threads))
    served_s, ttfts, served = min(served_runs, key=lambda r: r[0])
    offline_s, offline = min(offline_runs, key=lambda r: r[0])
    equal = sum(a == b for a, b in zip(served, offline, strict=True))
    serve_tps, offline_tps = generated / served_s, generated / offline_s
    print(f"workload: {w.sessions} sessions x {w.turns} turns, {w.system_tokens}-token shared system prompt, "
          f"{w.new_tokens} new tokens per turn, --threads {args.threads}, best of {len(served_runs)}")
    print(f"serve: {requests / served_s:.2f} requests/s, {serve_tps:.1f} generated tok/s, "
          f"TTFT p50 {percentile(ttfts, 0.5) * 1000:.1f} ms p99 {percentile(ttfts, 0.99) * 1000:.1f} ms "
          f"({served_s:.2f} s; all runs {', '.join(f'{r[0]:.2f}' for r in served_runs)} s)")
    print(f"offline LLM.generate: {requests / offline_s:.2f} requests/s, {offline_tps:.1f} generated tok/s "
          f"({offline_s:.2f} s; all runs {', '.join(f'{r[0]:.2f}' for r in offline_runs)} s)")
    print(f"sessions_equal={equal}/{len(served)}")
    print(f"serve_vs_offline_throughput={serve_tps / offline_tps:.2f}")


if __name__ == "__main__":
    main()
